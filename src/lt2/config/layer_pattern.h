// The syntax of a model's layer pattern (the forms are listed in model/pattern.h): the mixer name
// of each layer as written, before any name is checked against the mixer registry.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lt2 {

struct ModelConfig;

// The mixer name of each of cfg.n_layers layers. Throws lt2::Error on a malformed pattern.
std::vector<std::string> layer_pattern_names(const ModelConfig& cfg);
// (a, b) of a "random:a:b" pattern, nothing for the other forms.
std::optional<std::pair<int64_t, int64_t>> random_pattern_ratio(const ModelConfig& cfg);

}  // namespace lt2
