// Next-token sampling: greedy, temperature, top-k, top-p (nucleus), with a seeded generator so the
// same seed gives the same text on any device.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <random>

namespace lt2 {

struct SamplingOptions {
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 0;         // 0 = off
  double top_p = 1.0;        // 1 = off
};

class Sampler {
 public:
  Sampler(SamplingOptions opts, uint64_t seed) : opts_(opts), rng_(seed) {}
  // logits: [V] (any device/dtype). Returns the chosen token id.
  int64_t sample(const torch::Tensor& logits);
  // Validates the options; throws lt2::Error naming the bad one.
  static void validate(const SamplingOptions& o);

 private:
  SamplingOptions opts_;
  std::mt19937_64 rng_;
};

}  // namespace lt2
