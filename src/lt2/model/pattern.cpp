#include "lt2/model/pattern.h"

#include "lt2/config/layer_pattern.h"
#include "lt2/config/model_config.h"
#include "lt2/mixers/registry.h"

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

SlotDraw slot_draw(const Tensor& draw, int64_t loop, int64_t layer) {
  if (!draw.defined()) return SlotDraw::Configured;
  LT2_CHECK(draw.dim() == 2 && loop < draw.size(0) && layer < draw.size(1), "slot draw ", draw.sizes(),
            " has no slot (loop ", loop, ", layer ", layer, ")");
  return draw[loop][layer].item<bool>() ? SlotDraw::Full : SlotDraw::Window;
}

}  // namespace lt2
