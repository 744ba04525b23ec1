#include "lt2/infer/sampling.h"

#include "lt2/util/error.h"

namespace lt2 {

void Sampler::validate(const SamplingOptions& o) {
  LT2_CHECK(o.temperature >= 0, "temperature must be >= 0 (0 = greedy), found ", o.temperature);
  LT2_CHECK(o.top_k >= 0, "top-k must be >= 0 (0 = off), found ", o.top_k);
  LT2_CHECK(o.top_p > 0 && o.top_p <= 1, "top-p must be in (0, 1], found ", o.top_p);
}

int64_t Sampler::sample(const torch::Tensor& logits) {
  auto l = logits.to(torch::kCPU, torch::kFloat64).contiguous();
  if (opts_.temperature == 0) return l.argmax().item<int64_t>();
  auto probs = torch::softmax(l / opts_.temperature, -1);
  auto [sorted, order] = probs.sort(/*dim=*/-1, /*descending=*/true);
  int64_t keep = sorted.size(0);
  if (opts_.top_k > 0) keep = std::min(keep, opts_.top_k);
  if (opts_.top_p < 1) {  // smallest prefix whose mass reaches top_p
    auto cdf = sorted.cumsum(0);
    auto acc = cdf.accessor<double, 1>();
    int64_t n = 1;
    while (n < keep && acc[n - 1] < opts_.top_p) ++n;
    keep = n;
  }
  auto p = sorted.accessor<double, 1>();
  double total = 0;
  for (int64_t i = 0; i < keep; ++i) total += p[i];
  double u = std::uniform_real_distribution<double>(0, total)(rng_);
  int64_t chosen = keep - 1;
  for (int64_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u <= 0) {
      chosen = i;
      break;
    }
  }
  return order[chosen].item<int64_t>();
}

}  // namespace lt2
