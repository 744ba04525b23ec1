// Mixers by name, so a layer pattern ("interleaved:4:1:gdn:full") can name any registered mixer
// without the model knowing them. Each mixer file defines a factory; registry.cpp lists them.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"

namespace lt2 {

// Builds the mixer of layer `layer` (0-based) of a model with config `cfg`. Mixer-specific
// settings come from cfg.options_for(name); unknown settings are an error.
using MixerFactory = std::function<Mixer(const ModelConfig& cfg, int64_t layer)>;

struct MixerInfo {
  std::string name;
  std::string summary;   // one line for `lt2 info` / --help
  MixerFactory make;
};

const std::vector<MixerInfo>& mixer_registry();
const MixerInfo* find_mixer(const std::string& name);
// Throws lt2::Error listing the registered names when `name` is unknown.
Mixer make_mixer(const std::string& name, const ModelConfig& cfg, int64_t layer);
std::string registered_mixer_names();  // "full, gdn, ..."

}  // namespace lt2
