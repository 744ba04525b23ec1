// Shared by the CPU (Gloo) and GPU (NCCL) data-parallel tests: the gradient buckets of a one-rank
// group must leave exactly the gradients of a plain backward.
#pragma once
#include <gtest/gtest.h>

#include "common/testing.h"
#include "lt2/train/distributed.h"

namespace lt2::testing {

// A one-rank group on `device`: rank 0 hosts its store on a free port.
inline std::shared_ptr<ProcessGroup> one_rank_group(torch::Device device) {
  DistEnv env;  // rank 0 of 1, MASTER_PORT 0
  return std::make_shared<ProcessGroup>(env, device, std::chrono::seconds(20));
}

// Trains nothing: `steps` rounds of two accumulated micro-batches through two identical models,
// one with plain backward, one through GradientBuckets (small buckets, so there are several);
// the gradients must agree, in the counting step and in the overlapped ones: bit for bit when
// tol is 0 (CPU), else to relative error tol (CUDA's attention backward may sum in any order).
inline void expect_buckets_match_plain_backward(torch::Device device, bool checkpoint_loops, double tol = 0,
                                                int steps = 3) {
  auto cfg = tiny_config();
  auto plain = make_test_model(cfg, 5, torch::kFloat32);
  auto synced = make_test_model(cfg, 5, torch::kFloat32);
  plain->to(device);
  synced->to(device);
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : synced->named_parameters()) named.emplace_back(p.key(), p.value());
  GradientBuckets buckets(one_rank_group(device), named, /*bucket_bytes=*/4096);
  ForwardOptions fo;
  fo.checkpoint_loops = checkpoint_loops;
  for (int step = 0; step < steps; ++step) {
    for (auto& p : plain->parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : synced->parameters()) p.mutable_grad() = torch::Tensor();
    for (int micro = 0; micro < 2; ++micro) {
      auto x = random_tokens(2, 12, cfg.vocab_size, 100 + 10 * step + micro).to(device);
      plain->forward(x, nullptr, fo).logits.square().mean().backward();
      if (micro == 1) buckets.begin_last_backward();
      synced->forward(x, nullptr, fo).logits.square().mean().backward();
    }
    buckets.finish(step + 1);
    EXPECT_GT(buckets.num_buckets(), 1);
    auto a = plain->named_parameters(), b = synced->named_parameters();
    for (const auto& p : a) {
      ASSERT_EQ(p.value().grad().defined(), b[p.key()].grad().defined()) << p.key();
      if (!p.value().grad().defined()) continue;
      if (tol == 0) EXPECT_TRUE(torch::equal(p.value().grad(), b[p.key()].grad())) << p.key() << " step " << step;
      else EXPECT_LT(rel_err(b[p.key()].grad(), p.value().grad()), tol) << p.key() << " step " << step;
    }
  }
}

}  // namespace lt2::testing
