// One transformer block = token mixer + SwiGLU FFN.
//   pre-norm (LT2):       h = x + Mixer(mixer_norm(x));  out = h + FFN(ffn_norm(h))
//   sandwich (Ouro):      h = x + mixer_post_norm(Mixer(mixer_norm(x)));
//                         out = h + ffn_post_norm(FFN(ffn_norm(h)))
#pragma once
#include <functional>

#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

// Sees a block's mixer call: the mixer's input and its output (before any post-norm).
using MixerObserver = std::function<void(const Tensor& input, const Tensor& output)>;

// A block's output as two parts, out = h + f: the residual stream after the mixer and the FFN's
// output, not yet added, so that the next block's norm adds them in its own kernel.
struct BlockParts {
  Tensor h, f;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& cfg, int64_t layer, const std::string& mixer_name);
  // x: [B, T, d]. With a state, runs the mixer's step (T == 1) or continues its forward.
  // `observe`, when set, is called with the mixer's input and output. (The engine's decode folds
  // the norms into the mixer's and the FFN's kernels instead: model/decode_plan.h.)
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr,
                 const MixerObserver& observe = {});
  // The same on the stream x + pending (pending: the previous block's f, or undefined for x alone),
  // out returned as its parts: the add before the mixer's norm runs inside that norm
  // (ops::add_rms_norm), as the add before the FFN's does.
  BlockParts forward_parts(const Tensor& x, const Tensor& pending, const Positions& pos, MixerState* state = nullptr,
                           const MixerObserver& observe = {});

  Mixer mixer;
  SwiGLU ffn{nullptr};
  RMSNorm mixer_norm{nullptr}, ffn_norm{nullptr};
  RMSNorm mixer_post_norm{nullptr}, ffn_post_norm{nullptr};  // sandwich norm only
};
TORCH_MODULE(Block);

}  // namespace lt2
