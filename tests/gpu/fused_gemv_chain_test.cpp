// GPU (CTest label `gpu`): the chained decode GEMV (ops/projections/gemv.h: gemv_chain_fused, one
// persistent kernel for dependent products) beyond its kernel-case rows
// (tests/gpu/kernel_cases_test.cpp): against float64 on the CPU, N off the 8-row tiles, chains of
// one and two products, x a strided view, the SiLU·mul epilogue off its 4-column tiles; CUDA-graph
// replay with new inputs == eager; many launches on two streams (each stream's grid barrier resets
// itself); what it does not take runs nothing. Skips where no CUDA GPU.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/ops/projections/gemv.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;
using lt2::kernel_cases::BlockTail;

namespace {

Tensor f64(const Tensor& t) { return t.cpu().to(torch::kFloat64); }

}  // namespace

// N off the 8-row tiles (rows past N read row N - 1 and are not written), a chain of one and of
// two products, x as a strided view (copied to aligned rows), leading dims kept.
TEST(FusedGemvChain, OddRowsAndShortChainsMatchFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(22);
  const auto dt = torch::kBFloat16;
  for (int64_t M : {1, 5, 8}) {
    auto wide = torch::randn({M, 1, 2 * 320}, gpu(dt));
    auto x = wide.narrow(-1, 0, 320);  // rows 640 apart
    auto w1 = torch::randn({4101, 320}, gpu(dt)) / std::sqrt(320.0);
    ops::ChainProduct first{w1};
    auto one = ops::gemv_chain_fused(x, {first});
    ASSERT_EQ(one.size(), 1u);
    ASSERT_EQ(one[0].sizes(), torch::IntArrayRef({M, 1, 4101}));
    EXPECT_LT(rel_err(one[0].cpu(), torch::matmul(f64(x), f64(w1).t())), tolerance(dt)) << "M " << M;

    auto w_up = torch::randn({2 * 2048, 320}, gpu(dt)) / std::sqrt(320.0);
    ops::ChainProduct up{w_up}, down{torch::randn({37, 2048}, gpu(dt)) / std::sqrt(2048.0)};
    down.fusion.silu_mul = true;
    auto two = ops::gemv_chain_fused(x, {up, down});
    ASSERT_EQ(two.size(), 2u);
    auto gu = f64(two[0]);
    auto a = gu.narrow(-1, 0, 2048), b = gu.narrow(-1, 2048, 2048);
    EXPECT_LT(rel_err(two[0].cpu(), torch::matmul(f64(x), f64(w_up).t())), tolerance(dt)) << "M " << M;
    EXPECT_LT(rel_err(two[1].cpu(), torch::matmul(a * torch::sigmoid(a) * b, f64(down.w).t())), tolerance(dt))
        << "M " << M;

    // The SiLU·mul epilogue: 1030 columns (off its 4-column tiles) as the last product, and
    // 2048 as w2's x.
    auto silu_mul = [](const Tensor& gu64) {
      const int64_t F = gu64.size(-1) / 2;
      auto a = gu64.narrow(-1, 0, F), b = gu64.narrow(-1, F, F);
      return a * torch::sigmoid(a) * b;
    };
    ops::ChainProduct odd{torch::randn({2 * 1030, 320}, gpu(dt)) / std::sqrt(320.0)};
    odd.silu_mul_out = true;
    auto halves = ops::gemv_chain_fused(x, {odd});
    ASSERT_EQ(halves.size(), 1u);
    ASSERT_EQ(halves[0].sizes(), torch::IntArrayRef({M, 1, 1030}));
    EXPECT_LT(rel_err(halves[0].cpu(), silu_mul(torch::matmul(f64(x), f64(odd.w).t()))), tolerance(dt)) << "M " << M;
    up.silu_mul_out = true, down.fusion.silu_mul = false;
    auto fused = ops::gemv_chain_fused(x, {up, down});
    ASSERT_EQ(fused.size(), 2u);
    ASSERT_EQ(fused[0].sizes(), torch::IntArrayRef({M, 1, 2048}));
    EXPECT_LT(rel_err(fused[0].cpu(), silu_mul(torch::matmul(f64(x), f64(w_up).t()))), tolerance(dt)) << "M " << M;
    EXPECT_LT(rel_err(fused[1].cpu(), torch::matmul(f64(fused[0]), f64(down.w).t())), tolerance(dt)) << "M " << M;
  }
}

TEST(FusedGemvChain, GraphReplayWithNewInputsEqualsEager) {
  REQUIRE_FUSED_DECODE();
#ifdef LT2_WITH_CUDA
  torch::NoGradGuard ng;
  torch::manual_seed(23);
  BlockTail tail(4, 512, 384, 704, true, torch::kBFloat16);
  std::vector<Tensor> captured;
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    ASSERT_EQ(ops::gemv_chain_fused(tail.y, tail.products()).size(), 3u);  // warm-up outside the capture
    torch::cuda::synchronize();
    graph.capture_begin();
    captured = ops::gemv_chain_fused(tail.y, tail.products());
    graph.capture_end();
  }
  ASSERT_EQ(captured.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    tail.y.copy_(torch::randn_like(tail.y));
    tail.residual.copy_(torch::randn_like(tail.residual));
    graph.replay();
    torch::cuda::synchronize();
    const auto eager = ops::gemv_chain_fused(tail.y, tail.products());
    for (int j = 0; j < 3; ++j) EXPECT_TRUE(torch::equal(captured[j], eager[j])) << "replay " << i << " product " << j;
  }
#endif
}

// Back-to-back launches on two streams: each stream's grid barrier is left reset by every launch,
// so the hundredth result equals the first.
TEST(FusedGemvChain, ManyLaunchesOnTwoStreams) {
  REQUIRE_FUSED_DECODE();
#ifdef LT2_WITH_CUDA
  torch::NoGradGuard ng;
  torch::manual_seed(24);
  BlockTail tail(2, 256, 256, 320, false, torch::kBFloat16);
  const auto first = ops::gemv_chain_fused(tail.y, tail.products());
  ASSERT_EQ(first.size(), 3u);
  std::vector<Tensor> last[2];
  for (int s = 0; s < 2; ++s) {
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    for (int i = 0; i < 100; ++i) last[s] = ops::gemv_chain_fused(tail.y, tail.products());
  }
  torch::cuda::synchronize();
  for (int s = 0; s < 2; ++s)
    for (int j = 0; j < 3; ++j) EXPECT_TRUE(torch::equal(first[j], last[s][j])) << "stream " << s << " product " << j;
#endif
}

TEST(FusedGemvChain, WhatItDoesNotTakeRunsNothing) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  const auto bf = gpu(torch::kBFloat16);
  auto x = torch::randn({2, 256}, bf);
  ops::ChainProduct ok{torch::randn({128, 256}, bf)};
  EXPECT_EQ(ops::gemv_chain_fused(x, {ok}).size(), 1u);
  EXPECT_TRUE(ops::gemv_chain_fused(x.to(torch::kFloat32), {ops::ChainProduct{ok.w.to(torch::kFloat32)}}).empty())
      << "fp32 has no tensor-core chain";
  EXPECT_TRUE(ops::gemv_chain_fused(torch::randn({2, 264}, bf), {ops::ChainProduct{torch::randn({128, 264}, bf)}})
                  .empty())
      << "K off 32";
  EXPECT_TRUE(ops::gemv_chain_fused(torch::randn({9, 256}, bf), {ok}).empty()) << "more rows than a GEMV takes";
  EXPECT_TRUE(ops::gemv_chain_fused(x, {ok, ok}).empty()) << "product 1's x (128 wide) does not fit its W (256)";
  ops::ChainProduct later = ok;
  later.residual_of = 0;
  EXPECT_TRUE(ops::gemv_chain_fused(x, {later}).empty()) << "residual_of names no earlier product";
  ops::ChainProduct odd_halves{torch::randn({130, 256}, bf)}, halves_with_residual = ok;
  odd_halves.silu_mul_out = true;
  EXPECT_TRUE(ops::gemv_chain_fused(x, {odd_halves}).size() == 1u) << "130 rows: two halves of 65";
  odd_halves.w = torch::randn({129, 256}, bf);
  EXPECT_TRUE(ops::gemv_chain_fused(x, {odd_halves}).empty()) << "the SiLU·mul epilogue needs N even";
  halves_with_residual.silu_mul_out = true, halves_with_residual.fusion.residual = torch::randn({2, 128}, bf);
  EXPECT_TRUE(ops::gemv_chain_fused(x, {halves_with_residual}).empty()) << "the epilogue takes no residual";
  EXPECT_TRUE(ops::gemv_chain_fused(x, {}).empty());
  EXPECT_TRUE(ops::gemv_chain_fused(x, {ok, ok, ok, ok, ok}).empty()) << "more products than the kernel takes";
  // x rows too wide for shared memory with the ring beside them.
  auto wide = torch::randn({8, 16384}, bf);
  EXPECT_TRUE(ops::gemv_chain_fused(wide, {ops::ChainProduct{torch::randn({64, 16384}, bf)}}).empty());
}
