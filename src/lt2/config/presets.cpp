#include "lt2/config/presets.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "lt2/util/environment.h"
#include "lt2/util/fs.h"

namespace lt2 {

std::string preset_dir() {
  return environment().config_dir.value_or(LT2_DEFAULT_CONFIG_DIR);
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(preset_dir(), ec))
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

ModelConfig load_model_config(const std::string& path_or_preset) {
  if (path_exists(path_or_preset) && !std::filesystem::is_directory(path_or_preset))
    return ModelConfig::load(path_or_preset);
  const std::string preset = preset_dir() + "/" + path_or_preset + ".json";
  if (path_exists(preset)) return ModelConfig::load(preset);
  std::string list;
  for (const auto& n : preset_names()) list += (list.empty() ? "" : ", ") + n;
  throw Error(cat("model '", path_or_preset, "' is neither a config file nor a preset (presets in ",
                  preset_dir(), ": ", list, ")"));
}

}  // namespace lt2
