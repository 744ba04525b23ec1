// Layer patterns: which mixer each of the N layers uses, and (for LT2's loop-level patterns) how an
// attention layer behaves in each loop iteration.
//   "full"                         every layer full attention
//   "gdn,gdn,full"                 explicit list, cycled to N layers
//   "interleaved:a:b:X:Y"          repeating [X x a, Y x b]   (Full+GDN = interleaved:4:1:gdn:full)
//   "bookend:k:X:Y"                Y on the first k and last k layers, X in between
//   "front:k:X:Y" / "back:k:X:Y"   Y on the first (last) k layers, X elsewhere
//   "random:a:b"                   every layer the `window` mixer; each (layer, loop) slot is full
//                                  attention with probability a / (a + b), else a window of the
//                                  configured W (see RandomSlots); the model passes each
//                                  slot's draw to its mixer (Positions::slot, LoopSettings)
// A window per loop ("128 -> 256 -> 512 -> full") is the window mixer's option
// `windows: [128, 256, 512, 0]` (mixers/window.h), with any of the forms above.
#pragma once
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "lt2/mixers/mixer.h"

namespace lt2 {

struct ModelConfig;

// Mixer name of each layer (size cfg.n_layers). Throws lt2::Error on a bad pattern or an
// unregistered mixer name.
std::vector<std::string> resolve_pattern(const ModelConfig& cfg);

// LT2's random full/window assignment over (layer, loop) slots ("random:a:b"). Training re-draws
// the assignment at every forward pass; inference averages the output distributions over `votes`
// fixed draws (the same draws for every call, so decoding and the parallel forward agree).
struct RandomSlots {
  double p_full = 0.5;  // a / (a + b)
  int64_t votes = 5;    // K
  // A fresh draw from the global torch generator: [n_loops, n_layers] bool, true = full.
  Tensor draw(int64_t n_loops, int64_t n_layers) const;
  // The K inference draws, from a fixed seed (identical in every process).
  std::vector<Tensor> vote_draws(int64_t n_loops, int64_t n_layers) const;
};

// The random-slot settings when cfg.layer_pattern is "random:a:b", nothing otherwise.
std::optional<RandomSlots> random_slots(const ModelConfig& cfg);

// The draw of slot (loop, layer) in `draw` ([n_loops, n_layers] bool, true = full): what the
// mixer of that layer receives in Positions::slot and LoopSettings::slot. Configured when `draw`
// is undefined (no random pattern).
SlotDraw slot_draw(const Tensor& draw, int64_t loop, int64_t layer);

}  // namespace lt2
