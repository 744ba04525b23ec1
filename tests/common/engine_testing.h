// Engine invariant shared by the CPU and GPU tests: sequences of different lengths prefilled into
// their slots and decoded together give, at every step, the logits of a plain forward pass over
// each sequence alone.
#pragma once
#include <gtest/gtest.h>

#include "common/testing.h"
#include "lt2/infer/engine.h"

namespace lt2::testing {

inline void expect_engine_matches_per_sequence(LoopedLM m, const EngineOptions& eo,
                                               const std::vector<int64_t>& prompt_lengths, int64_t steps,
                                               double tol, uint64_t seed = 3) {
  torch::NoGradGuard ng;
  m->eval();
  const auto dev = m->parameters().front().device();
  const int64_t V = m->config().vocab_size, n = static_cast<int64_t>(prompt_lengths.size());
  Engine engine(m, eo);
  torch::manual_seed(seed);
  std::vector<torch::Tensor> seqs;  // [T_s] int64 on the CPU: each slot's tokens so far
  for (int64_t s = 0; s < n; ++s) {
    seqs.push_back(torch::randint(V, {prompt_lengths[s]}, torch::kLong));
    auto got = engine.prefill(s, seqs[s]);
    auto want = m->forward(seqs[s].to(dev).view({1, -1})).logits[0][-1];
    EXPECT_LT(rel_err(got.cpu(), want.cpu()), tol) << "prefill of slot " << s;
    EXPECT_EQ(engine.length(s), prompt_lengths[s]);
  }
  for (int64_t step = 0; step < steps; ++step) {
    auto next = torch::randint(V, {n}, torch::kLong);
    auto logits = engine.decode(next).cpu();  // [n, V]
    for (int64_t s = 0; s < n; ++s) {
      seqs[s] = torch::cat({seqs[s], next.narrow(0, s, 1)});
      auto want = m->forward(seqs[s].to(dev).view({1, -1})).logits[0][-1].cpu();
      EXPECT_LT(rel_err(logits[s], want), tol) << "decode step " << step << ", slot " << s
                                               << " (length " << seqs[s].numel() << ")";
      EXPECT_EQ(engine.length(s), seqs[s].numel());
    }
  }
}

}  // namespace lt2::testing
