// NCCL on the one GPU a machine may have: a one-rank group runs the same collectives, the same
// gradient buckets and the same trainer path as a multi-GPU job (tests/train/test_distributed.cpp
// runs two ranks over Gloo).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "train/dist_testing.h"

using namespace lt2;
using namespace lt2::testing;


TEST(NcclOneRank, AllReduceAndBroadcast) {
  REQUIRE_CUDA();
  auto group = one_rank_group(torch::Device(torch::kCUDA, 0));
  auto t = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  group->all_reduce_sum(t, "test all-reduce");
  group->broadcast(t, 0, "test broadcast");
  EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(6, torch::kFloat32)));
}

TEST(NcclOneRank, GradientBucketsGiveThePlainGradients) {
  REQUIRE_CUDA();
  expect_buckets_match_plain_backward(torch::Device(torch::kCUDA, 0), /*checkpoint_loops=*/false, 1e-5);
  expect_buckets_match_plain_backward(torch::Device(torch::kCUDA, 0), /*checkpoint_loops=*/true, 1e-5);
}

TEST(NcclOneRank, TrainerInAOneRankJobMatchesAPlainRun) {
  REQUIRE_CUDA();
  expect_one_rank_job_matches_plain_run("cuda", 1e-4);
}
