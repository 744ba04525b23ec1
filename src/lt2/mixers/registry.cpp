#include "lt2/mixers/registry.h"

#include "lt2/mixers/builtin.h"

namespace lt2 {

const std::vector<MixerInfo>& mixer_registry() {
  // One line per mixer; each info function lives beside its mixer (mixers/<name>.cpp).
  static const std::vector<MixerInfo> registry = {
      full_attention_info(),
      window_attention_info(),
      dsa_info(),
      nsa_info(),
      gdn_info(),
      kda_info(),
      mamba2_info(),
      retnet_info(),
      deltanet_info(),
      gla_info(),
      hgrn2_info(),
      linear_attention_info(),
  };
  return registry;
}

const MixerInfo* find_mixer(const std::string& name) {
  for (const auto& m : mixer_registry())
    if (m.name == name) return &m;
  return nullptr;
}

std::string registered_mixer_names() {
  std::string s;
  for (const auto& m : mixer_registry()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

Mixer make_mixer(const std::string& name, const ModelConfig& cfg, int64_t layer) {
  const MixerInfo* info = find_mixer(name);
  LT2_CHECK(info, "unknown mixer '", name, "' (registered: ", registered_mixer_names(), ")");
  return info->make(cfg, layer);
}

}  // namespace lt2
