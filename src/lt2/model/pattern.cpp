#include "lt2/model/pattern.h"

#include <sstream>

#include "lt2/config/model_config.h"
#include "lt2/mixers/registry.h"
#include "lt2/mixers/window.h"

namespace lt2 {

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) out.push_back(item);
  if (!s.empty() && s.back() == sep) out.push_back("");
  return out;
}

int64_t parse_count(const std::string& s, const std::string& pattern) {
  try {
    size_t used = 0;
    long long v = std::stoll(s, &used);
    if (used == s.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  throw Error(cat("layer_pattern '", pattern, "': expected a non-negative count, found '", s, "'"));
}

}  // namespace

std::vector<std::string> resolve_pattern(const ModelConfig& cfg) {
  const std::string& p = cfg.layer_pattern;
  const int64_t N = cfg.n_layers;
  const std::string syntax =
      " (forms: 'full', 'gdn,gdn,full', 'interleaved:a:b:X:Y', 'bookend:k:X:Y', 'front:k:X:Y', "
      "'back:k:X:Y', 'random:a:b')";
  LT2_CHECK(!p.empty(), "layer_pattern is empty", syntax);
  std::vector<std::string> layers;
  auto parts = split(p, ':');
  const std::string& form = parts[0];
  if (parts.size() == 1) {
    auto names = split(p, ',');
    for (int64_t i = 0; i < N; ++i) layers.push_back(names[i % names.size()]);
    LT2_CHECK(names.size() <= static_cast<size_t>(N), "layer_pattern '", p, "' lists ",
              names.size(), " layers but the model has n_layers = ", N);
  } else if (form == "interleaved") {
    LT2_CHECK(parts.size() == 5, "layer_pattern '", p, "': interleaved takes a:b:X:Y", syntax);
    int64_t a = parse_count(parts[1], p), b = parse_count(parts[2], p);
    LT2_CHECK(a + b > 0, "layer_pattern '", p, "': a + b must be > 0");
    for (int64_t i = 0; i < N; ++i) layers.push_back(i % (a + b) < a ? parts[3] : parts[4]);
  } else if (form == "bookend" || form == "front" || form == "back") {
    LT2_CHECK(parts.size() == 4, "layer_pattern '", p, "': ", form, " takes k:X:Y", syntax);
    int64_t k = parse_count(parts[1], p);
    for (int64_t i = 0; i < N; ++i) {
      bool y = (form != "back" && i < k) || (form != "front" && i >= N - k);
      layers.push_back(y ? parts[3] : parts[2]);
    }
  } else if (form == "random") {
    LT2_CHECK(parts.size() == 3, "layer_pattern '", p, "': random takes a:b (full : window)", syntax);
    int64_t a = parse_count(parts[1], p), b = parse_count(parts[2], p);
    LT2_CHECK(a + b > 0, "layer_pattern '", p, "': a + b must be > 0");
    layers.assign(N, "window");
  } else {
    throw Error(cat("layer_pattern '", p, "': unknown form '", form, "'", syntax));
  }
  for (const auto& name : layers)
    LT2_CHECK(find_mixer(name), "layer_pattern '", p, "': unknown mixer '", name,
              "' (registered: ", registered_mixer_names(), ")");
  return layers;
}

std::optional<RandomSlots> random_slots(const ModelConfig& cfg) {
  auto parts = split(cfg.layer_pattern, ':');
  if (parts.size() != 3 || parts[0] != "random") return std::nullopt;
  const double a = parse_count(parts[1], cfg.layer_pattern), b = parse_count(parts[2], cfg.layer_pattern);
  RandomSlots r;
  r.p_full = a / (a + b);
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
