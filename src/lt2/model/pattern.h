// Layer patterns: which mixer each of the N layers uses.
//   "full"                         every layer full attention
//   "gdn,gdn,full"                 explicit list, cycled to N layers
//   "interleaved:a:b:X:Y"          repeating [X x a, Y x b]   (Full+GDN = interleaved:4:1:gdn:full)
//   "bookend:k:X:Y"                Y on the first k and last k layers, X in between
//   "front:k:X:Y" / "back:k:X:Y"   Y on the first (last) k layers, X elsewhere
#pragma once
#include <string>
#include <vector>

namespace lt2 {

struct ModelConfig;

// Mixer name of each layer (size cfg.n_layers). Throws lt2::Error on a bad pattern or an
// unregistered mixer name.
std::vector<std::string> resolve_pattern(const ModelConfig& cfg);

}  // namespace lt2
