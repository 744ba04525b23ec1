#include "lt2/model/pattern.h"

#include "lt2/config/layer_pattern.h"
#include "lt2/config/model_config.h"
#include "lt2/mixers/registry.h"
#include "lt2/mixers/window.h"

namespace lt2 {

std::vector<std::string> resolve_pattern(const ModelConfig& cfg) {
  auto layers = layer_pattern_names(cfg);
  for (const auto& name : layers)
    LT2_CHECK(find_mixer(name), "layer_pattern '", cfg.layer_pattern, "': unknown mixer '", name,
              "' (registered: ", registered_mixer_names(), ")");
  return layers;
}

std::optional<RandomSlots> random_slots(const ModelConfig& cfg) {
  const auto ratio = random_pattern_ratio(cfg);
  if (!ratio) return std::nullopt;
  RandomSlots r;
  r.p_full = double(ratio->first) / double(ratio->first + ratio->second);
  return r;
}

Tensor RandomSlots::draw(int64_t n_loops, int64_t n_layers) const {
  return torch::rand({n_loops, n_layers}, torch::kFloat64) < p_full;
}

std::vector<Tensor> RandomSlots::vote_draws(int64_t n_loops, int64_t n_layers) const {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/20260515);
  std::vector<Tensor> draws;
  for (int64_t k = 0; k < votes; ++k)
    draws.push_back(torch::rand({n_loops, n_layers}, gen, torch::kFloat64) < p_full);
  return draws;
}

void apply_slot_draw(const std::vector<Mixer>& layer_mixers, const Tensor& draw) {
  const int64_t n_loops = draw.size(0);
  LT2_CHECK(draw.size(1) == static_cast<int64_t>(layer_mixers.size()), "slot draw for ", draw.size(1),
            " layers, model has ", layer_mixers.size());
  auto full = draw.accessor<bool, 2>();
  for (size_t l = 0; l < layer_mixers.size(); ++l) {
    auto* w = dynamic_cast<WindowAttentionImpl*>(layer_mixers[l].get());
    if (!w) continue;
    std::vector<int64_t> windows(n_loops);
    for (int64_t loop = 0; loop < n_loops; ++loop) windows[loop] = full[loop][l] ? 0 : w->base_window;
    w->set_loop_windows(windows);
  }
}

}  // namespace lt2
