#include "lt2/config/layer_pattern.h"

#include <sstream>

#include "lt2/config/model_config.h"
#include "lt2/util/error.h"

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

std::vector<std::string> layer_pattern_names(const ModelConfig& cfg) {
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
  return layers;
}

std::optional<std::pair<int64_t, int64_t>> random_pattern_ratio(const ModelConfig& cfg) {
  auto parts = split(cfg.layer_pattern, ':');
  if (parts.size() != 3 || parts[0] != "random") return std::nullopt;
  return std::make_pair(parse_count(parts[1], cfg.layer_pattern), parse_count(parts[2], cfg.layer_pattern));
}

}  // namespace lt2
