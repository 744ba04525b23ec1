// GPU (CTest label `gpu`): the chained decode GEMV (ops/fused_decode.h: gemv_chain_fused, one
// persistent kernel for dependent products) against float64 on the CPU, fresh random inputs,
// bf16 and fp16 (relative RMS error < 5e-3 on every product's output): a pre-norm block's tail
// (output projection with the sigmoid gate and the residual, w1|w3 with the RMSNorm prologue, w2
// with the first product's output as its residual; SiLU * mul as w1|w3's epilogue, the engine's
// form, or as w2's prologue) at 1..8 rows, K off the ring's slices, N off the 8-row tiles (and
// the epilogue's 4-column tiles), the 1.3B shapes; the same as gemv_fused one product at a time;
// CUDA-graph replay with new inputs == eager; many launches on two streams (each stream's grid
// barrier resets itself); what it does not take runs nothing. Skips where no CUDA GPU.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/ops/fused_decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

Tensor f64(const Tensor& t) { return t.cpu().to(torch::kFloat64); }

// A block tail: y [M, K] -> h = residual + (y sigmoid(gate)) Wo^T, [a | b] = rms(h) g W13^T,
// out = h + (silu(a) b) W2^T; with `epilogue` the second product stores silu(a) b, otherwise
// [a | b] and the third applies silu(a) b to its x.
struct BlockTail {
  Tensor y, gate, residual, wo, norm_weight, w13, w2;
  double eps = 1e-5;
  bool epilogue = true;

  BlockTail(int64_t M, int64_t d, int64_t k, int64_t ffn, bool gated, torch::ScalarType dt, bool silu_epilogue = true)
      : epilogue(silu_epilogue) {
    y = torch::randn({M, k}, gpu(dt));
    if (gated) gate = torch::randn({M, k}, gpu(dt)) * 2;
    residual = torch::randn({M, d}, gpu(dt));
    wo = torch::randn({d, k}, gpu(dt)) / std::sqrt(static_cast<double>(k));
    norm_weight = 1 + 0.3 * torch::randn({d}, gpu(dt));
    w13 = torch::randn({2 * ffn, d}, gpu(dt)) / std::sqrt(static_cast<double>(d));
    w2 = torch::randn({d, ffn}, gpu(dt)) / std::sqrt(static_cast<double>(ffn));
  }

  std::vector<ops::ChainProduct> products() const {
    ops::ChainProduct projection{wo}, gate_up{w13}, down{w2};
    projection.fusion.x_gate = gate, projection.fusion.residual = residual;
    gate_up.fusion.norm_weight = norm_weight, gate_up.fusion.norm_eps = eps;
    gate_up.silu_mul_out = epilogue;
    down.fusion.silu_mul = !epilogue, down.residual_of = 0;
    return {projection, gate_up, down};
  }

  // The three products one at a time through gemv_fused (the epilogue as silu_mul_fused).
  std::vector<Tensor> unchained() const {
    const auto p = products();
    ops::GemvFusion down = p[2].fusion;
    auto h = ops::gemv_fused(y, wo, p[0].fusion);
    auto gu = ops::gemv_fused(h, w13, p[1].fusion);
    if (epilogue) gu = ops::silu_mul_fused(gu);
    down.residual = h;
    return {h, gu, ops::gemv_fused(gu, w2, down)};
  }

  // float64 of each product from the previous product's output as the kernel stored it (dt).
  std::vector<Tensor> reference(const std::vector<Tensor>& got) const {
    auto in = f64(y);
    if (gate.defined()) in = in * torch::sigmoid(f64(gate));
    auto h = f64(residual) + torch::matmul(in, f64(wo).t());
    auto h_in = f64(got[0]);
    auto normed = h_in * torch::rsqrt(h_in.pow(2).mean(-1, true) + eps) * f64(norm_weight);
    auto gu = torch::matmul(normed, f64(w13).t());
    const int64_t F = w2.size(1);
    auto silu_mul = [F](const Tensor& t) {
      auto a = t.narrow(-1, 0, F), b = t.narrow(-1, F, F);
      return a * torch::sigmoid(a) * b;
    };
    if (epilogue) gu = silu_mul(gu);
    auto down_in = epilogue ? f64(got[1]) : silu_mul(f64(got[1]));
    auto out = h_in + torch::matmul(down_in, f64(w2).t());
    return {h, gu, out};
  }
};

}  // namespace

TEST(FusedGemvChain, BlockTailMatchesFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(21);
  struct Shape {
    int64_t d, k, ffn;
  };
  for (auto dt : {torch::kBFloat16, torch::kFloat16})
    for (Shape sh : {Shape{96, 64, 160}, Shape{1056, 2080, 1120}, Shape{2048, 3072, 5632}})
      for (int64_t M : {1, 3, 8})
        for (bool gated : {false, true})
          for (bool epilogue : {true, false}) {
            if (dt == torch::kFloat16 && (sh.d > 1056 || M == 3)) continue;  // fp16: the dtype path, not every shape
            if (!epilogue && gated) continue;  // the prologue form once per shape
            BlockTail tail(M, sh.d, sh.k, sh.ffn, gated, dt, epilogue);
            const auto got = ops::gemv_chain_fused(tail.y, tail.products());
            ASSERT_EQ(got.size(), 3u) << "the chain takes the block tail";
            const auto expected = tail.reference(got);
            const auto one_by_one = tail.unchained();
            for (int i = 0; i < 3; ++i) {
              SCOPED_TRACE(::testing::Message() << name(dt) << " M " << M << " d " << sh.d << " k " << sh.k << " ffn "
                                                << sh.ffn << " gated " << gated << " epilogue " << epilogue
                                                << " product " << i);
              ASSERT_EQ(got[i].sizes(), one_by_one[i].sizes());
              EXPECT_FALSE(torch::isnan(got[i]).any().item<bool>());
              EXPECT_LT(rel_err(got[i].cpu(), expected[i]), tolerance(dt));
              EXPECT_LT(rel_err(got[i].cpu(), f64(one_by_one[i])), tolerance(dt));
            }
          }
}

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
