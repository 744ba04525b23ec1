// Shared by the CPU (Gloo) and GPU (NCCL) data-parallel tests: the gradient buckets of a one-rank
// group must leave the gradients of a plain backward, and a trainer in a one-rank job must train
// as a plain one.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <cmath>
#include <filesystem>

#include "common/testing.h"
#include "lt2/train/distributed.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"
#include "train/train_testing.h"

namespace lt2::testing {

// Environment variables set for a scope (a job's RANK, WORLD_SIZE, ...) and removed at its end, so
// the in-process trainer tests that follow see no job.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::initializer_list<std::pair<std::string, std::string>> vars) : vars_(vars) {
    for (const auto& [name, value] : vars_) setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : vars_) unsetenv(name.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::vector<std::pair<std::string, std::string>> vars_;
};

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

// The tiny run on `device` (fp32), plain and then in the environment of a one-rank job (rank 0
// hosts its store on a free port), where the trainer joins a group and reduces its gradients
// through the buckets: the losses must agree to relative error tol.
inline void expect_one_rank_job_matches_plain_run(const std::string& device, double tol) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("lt2_one_rank_job_" + device)).string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  cfg.device = device;
  cfg.dtype = "fp32";
  auto losses = [](Trainer& t) {
    std::vector<double> out;
    t.on_step = [&](const StepMetrics& m) { out.push_back(m.loss); };
    t.run();
    return out;
  };
  Trainer plain(cfg, false);
  const auto a = losses(plain);
  ScopedEnv job({{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  cfg.out_dir = dir + "/job";
  Trainer in_job(cfg, false);
  EXPECT_EQ(in_job.world_size(), 1);
  const auto b = losses(in_job);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], tol * std::abs(a[i])) << "step " << i + 1;
}

}  // namespace lt2::testing
