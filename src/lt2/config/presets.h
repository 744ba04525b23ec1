// Model presets: JSON files in configs/ (tiny CPU models, the LT2 0.6B/1.3B shapes, Ouro shapes).
#pragma once
#include <string>
#include <vector>

#include "lt2/config/model_config.h"

namespace lt2 {

// The folder holding the presets: $LT2_CONFIG_DIR if set (util/environment.h), else the source
// tree's configs/.
std::string preset_dir();
// Names of the presets (file names without .json), sorted.
std::vector<std::string> preset_names();
// A path to a JSON file, or a preset name. Throws lt2::Error listing the presets when neither.
ModelConfig load_model_config(const std::string& path_or_preset);

}  // namespace lt2
