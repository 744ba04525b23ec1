// The registered mixers as the suites of tests/mixers/ run them: every mixer of the registry at
// tiny shapes (d_model 32, 4 heads, sequences of ~12 tokens) with the options that make those
// sequences cross its chunks, top-k, windows and blocks, and after it the variants whose options
// take other code paths (grouped value heads, no output gate, grouped B/C, a short convolution).
// Registering a mixer puts it under every suite that runs over mixer_variants(); a mixer that
// needs settings for tiny shapes gets an entry in tiny_options, one with option-dependent paths
// entries in extra_variants.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/mixers/registry.h"
#include "lt2/util/json.h"

namespace lt2::testing {

struct MixerVariant {
  std::string label;  // the test's name: the mixer's name, or name_variant
  std::string name;   // the registered mixer
  json options;       // its mixer_options entry
};

// Options for tiny shapes, by mixer name (a mixer without an entry runs with its defaults).
inline json tiny_options(const std::string& name) {
  static const std::map<std::string, json> table = {
      {"gdn", {{"chunk_size", 4}}},
      {"kda", {{"chunk_size", 4}}},
      {"mamba2", {{"chunk_size", 4}, {"state_size", 8}}},
      {"retnet", {{"chunk_size", 4}}},
      {"deltanet", {{"chunk_size", 4}}},
      {"gla", {{"chunk_size", 4}}},
      {"hgrn2", {{"chunk_size", 4}, {"num_heads", 2}}},
      {"linear", {{"chunk_size", 4}}},
      {"dsa", {{"topk", 4}, {"index_heads", 2}, {"index_head_dim", 8}}},
      {"window", {{"window", 3}, {"windows", {2, 4, 0}}}},  // per loop; 0 = full
      {"nsa", {{"form", "paper"}, {"compress_block", 4}, {"compress_stride", 2}, {"select_block", 4},
               {"select_count", 2}, {"local_blocks", 1}, {"window", 3}, {"compress_hidden", 8}}},
  };
  const auto it = table.find(name);
  return it == table.end() ? json::object() : it->second;
}

// The variants of a mixer beyond its tiny options: {label suffix, options merged over them}.
inline std::vector<std::pair<std::string, json>> extra_variants(const std::string& name) {
  static const std::map<std::string, std::vector<std::pair<std::string, json>>> table = {
      {"gdn", {{"gva", {{"num_heads", 2}, {"num_v_heads", 4}, {"head_dim", 8}}}, {"no_gate", {{"use_gate", false}}}}},
      {"kda", {{"gva", {{"num_heads", 2}, {"num_v_heads", 4}}}}},
      {"mamba2", {{"groups", {{"state_size", 4}, {"n_groups", 2}}}}},
      {"gla", {{"conv", {{"use_short_conv", true}}}}},
      {"dsa", {{"latent", {{"attention", "latent"}, {"latent_dim", 12}, {"latent_rope_dim", 4}}}}},
  };
  const auto it = table.find(name);
  return it == table.end() ? std::vector<std::pair<std::string, json>>{} : it->second;
}

// Every registered mixer, each followed by its extra variants.
inline std::vector<MixerVariant> mixer_variants() {
  std::vector<MixerVariant> out;
  for (const auto& m : mixer_registry()) {
    out.push_back({m.name, m.name, tiny_options(m.name)});
    for (const auto& [suffix, extra] : extra_variants(m.name)) {
      auto options = tiny_options(m.name);
      options.update(extra);
      out.push_back({m.name + "_" + suffix, m.name, options});
    }
  }
  return out;
}

// tiny_config with every layer this variant's mixer.
inline ModelConfig variant_config(const MixerVariant& v) {
  auto cfg = tiny_config(v.name);
  cfg.mixer_options = json::object();
  cfg.mixer_options[v.name] = v.options;
  return cfg;
}

// Whether the registered mixer `name` is a linear-time recurrent mixer (a RecurrentMixerImpl).
inline bool is_recurrent(const std::string& name) {
  return std::dynamic_pointer_cast<RecurrentMixerImpl>(make_mixer(name, variant_config({name, name, tiny_options(name)}), 0)) !=
         nullptr;
}

// The variants of the recurrent mixers.
inline std::vector<MixerVariant> recurrent_variants() {
  std::vector<MixerVariant> out;
  for (const auto& v : mixer_variants())
    if (is_recurrent(v.name)) out.push_back(v);
  return out;
}

}  // namespace lt2::testing
