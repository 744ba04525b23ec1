// GPU (CTest label `gpu`): the decode GEMV (ops/fused_decode.h: gemv_fused) against a float64
// product on the CPU, fresh random inputs, fp32 (relative RMS error < 1e-5) and bf16 (< 5e-3),
// every row count 1..kGemvMaxRows, N off multiples of the block's rows, K of one vector up to the
// FFN width (bf16: the tensor-core kernel at K % 32 == 0, the FMA one otherwise), x rows strided;
// each folded prologue / epilogue (RMSNorm, SiLU * mul, sigmoid gate, residual add, and with the
// add); K split over a cluster at every split count; apply_linear takes it exactly when
// gemv_fused_applies says so; a CUDA-graph replay with new inputs == eager. Skips where no CUDA GPU
// (or no CUDA kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/ops/fused_decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

Tensor reference(const Tensor& x, const Tensor& w) {
  return torch::matmul(x.cpu().to(torch::kFloat64), w.cpu().to(torch::kFloat64).t());
}

}  // namespace

TEST(FusedGemv, MatchesFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(11);
  struct Shape {
    int64_t N, K;
  };
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (Shape sh : {Shape{1, 8}, Shape{5, 24}, Shape{2051, 2048}, Shape{1030, 5632}, Shape{4099, 3072}})
      for (int64_t M = 1; M <= kernels::kGemvMaxRows; ++M) {
        // x rows 2K apart (a strided view), W with a non-trivial scale; y poisoned by NaN inputs
        // nowhere: every output is checked against the float64 product.
        auto wide = torch::randn({M, 1, 2 * sh.K}, gpu(dt));
        auto x = wide.narrow(-1, 0, sh.K);
        auto w = torch::randn({sh.N, sh.K}, gpu(dt)) / std::sqrt(static_cast<double>(sh.K));
        auto y = ops::gemv_fused(x, w);
        ASSERT_EQ(y.sizes(), torch::IntArrayRef({M, 1, sh.N}));
        ASSERT_EQ(y.scalar_type(), dt);
        EXPECT_FALSE(torch::isnan(y).any().item<bool>());
        EXPECT_LT(rel_err(y.cpu(), reference(x, w)), tolerance(dt))
            << (dt == torch::kFloat32 ? "fp32" : "bf16") << " M " << M << " N " << sh.N << " K " << sh.K;
      }
}

TEST(FusedGemv, FoldedProloguesAndResidualMatchFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(14);
  struct Shape {
    int64_t N, K;
  };
  enum class Fold { Norm, SiluMul, Residual, NormResidual, SiluMulResidual, Gate, GateResidual };
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (Shape sh : {Shape{37, 24}, Shape{2051, 2048}, Shape{1030, 5632}})
      for (int64_t M : {1, 5, 8})
        for (Fold fold : {Fold::Norm, Fold::SiluMul, Fold::Residual, Fold::NormResidual, Fold::SiluMulResidual,
                          Fold::Gate, Fold::GateResidual}) {
          const bool silu = fold == Fold::SiluMul || fold == Fold::SiluMulResidual;
          const bool norm = fold == Fold::Norm || fold == Fold::NormResidual;
          const bool gate = fold == Fold::Gate || fold == Fold::GateResidual;
          const bool add = fold == Fold::Residual || fold == Fold::NormResidual || fold == Fold::SiluMulResidual ||
                           fold == Fold::GateResidual;
          auto x = torch::randn({M, 1, silu ? 2 * sh.K : sh.K}, gpu(dt)) * 1.5;
          auto w = torch::randn({sh.N, sh.K}, gpu(dt)) / std::sqrt(static_cast<double>(sh.K));
          ops::GemvFusion f;
          auto x64 = x.cpu().to(torch::kFloat64);
          auto in = x64;
          if (norm) {
            f.norm_weight = 1 + 0.3 * torch::randn({sh.K}, gpu(dt));
            f.norm_eps = 1e-5;
            in = x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + f.norm_eps) * f.norm_weight.cpu().to(torch::kFloat64);
          }
          if (silu) {
            f.silu_mul = true;
            auto a = x64.narrow(-1, 0, sh.K), b = x64.narrow(-1, sh.K, sh.K);
            in = a * torch::sigmoid(a) * b;
          }
          if (gate) {
            f.x_gate = torch::randn({M, 1, sh.K}, gpu(dt)) * 2;
            in = x64 * torch::sigmoid(f.x_gate.cpu().to(torch::kFloat64));
          }
          auto expected = torch::matmul(in, w.cpu().to(torch::kFloat64).t());
          if (add) {
            f.residual = torch::randn({M, 1, sh.N}, gpu(dt));
            expected = expected + f.residual.cpu().to(torch::kFloat64);
          }
          ASSERT_TRUE(ops::gemv_fused_applies(x, w, f));
          auto y = ops::gemv_fused(x, w, f);
          EXPECT_FALSE(torch::isnan(y).any().item<bool>());
          EXPECT_LT(rel_err(y.cpu(), expected), tolerance(dt))
              << (dt == torch::kFloat32 ? "fp32" : "bf16") << " M " << M << " N " << sh.N << " K " << sh.K
              << " fold " << static_cast<int>(fold);
        }
}

// K split over a cluster: every split count (including more splits than K has 32-wide chunks,
// where some blocks add nothing), with the RMSNorm statistic and the residual reduced across the
// cluster too; the split each shape gets by default.
TEST(FusedGemv, SplitKMatchesFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(15);
  struct Shape {
    int64_t N, K;
  };
  const auto dt = torch::kBFloat16;
  for (Shape sh : {Shape{37, 64}, Shape{2051, 2048}, Shape{1030, 5632}})
    for (int64_t M : {1, 3, 8})
      for (int splits = 0; splits <= kernels::kGemvMaxKSplits; ++splits)
        for (bool fold : {false, true}) {
          auto x = torch::randn({M, 1, sh.K}, gpu(dt)) * 1.5;
          auto w = torch::randn({sh.N, sh.K}, gpu(dt)) / std::sqrt(static_cast<double>(sh.K));
          ops::GemvFusion f;
          f.k_splits = splits;
          auto in = x.cpu().to(torch::kFloat64);
          if (fold) {
            f.norm_weight = 1 + 0.3 * torch::randn({sh.K}, gpu(dt));
            f.residual = torch::randn({M, 1, sh.N}, gpu(dt));
            in = in * torch::rsqrt(in.pow(2).mean(-1, true) + f.norm_eps) * f.norm_weight.cpu().to(torch::kFloat64);
          }
          auto expected = torch::matmul(in, w.cpu().to(torch::kFloat64).t());
          if (fold) expected = expected + f.residual.cpu().to(torch::kFloat64);
          auto y = ops::gemv_fused(x, w, f);
          EXPECT_FALSE(torch::isnan(y).any().item<bool>());
          EXPECT_LT(rel_err(y.cpu(), expected), tolerance(dt))
              << "splits " << splits << " M " << M << " N " << sh.N << " K " << sh.K << " fold " << fold;
        }
  ops::GemvFusion bad;
  bad.k_splits = kernels::kGemvMaxKSplits + 1;
  auto w = torch::randn({64, 64}, gpu(dt));
  EXPECT_FALSE(ops::gemv_fused_applies(torch::randn({1, 64}, gpu(dt)), w, bad));
  EXPECT_THROW(ops::gemv_fused(torch::randn({1, 64}, gpu(dt)), w, bad), Error);
}

TEST(FusedGemv, ApplyLinearTakesItOnlyWhereItApplies) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(12);
  auto w = torch::randn({300, 256}, gpu(torch::kBFloat16));
  auto few = torch::randn({4, 1, 256}, gpu(torch::kBFloat16));
  auto many = torch::randn({kernels::kGemvMaxRows + 1, 256}, gpu(torch::kBFloat16));
  EXPECT_TRUE(ops::gemv_fused_applies(few, w));
  EXPECT_FALSE(ops::gemv_fused_applies(many, w));  // a GEMM: cuBLAS
  EXPECT_FALSE(ops::gemv_fused_applies(few, w.t().contiguous().t()));  // W not contiguous
  for (const auto& x : {few, many})
    EXPECT_LT(rel_err(ops::linear(x, w).cpu(), reference(x, w)), 5e-3);
  {
    torch::AutoGradMode grad(true);  // autograd needs at::linear
    EXPECT_FALSE(ops::gemv_fused_applies(few, w.detach().requires_grad_()));
  }
}

TEST(FusedGemv, GraphReplayWithNewInputsEqualsEager) {
  REQUIRE_FUSED_DECODE();
#ifdef LT2_WITH_CUDA
  torch::NoGradGuard ng;
  torch::manual_seed(13);
  auto w = torch::randn({1000, 512}, gpu(torch::kBFloat16));
  auto x = torch::randn({8, 512}, gpu(torch::kBFloat16));
  Tensor y;
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    ops::gemv_fused(x, w);  // warm-up outside the capture
    torch::cuda::synchronize();
    graph.capture_begin();
    y = ops::gemv_fused(x, w);
    graph.capture_end();
  }
  for (int i = 0; i < 3; ++i) {
    x.copy_(torch::randn_like(x));
    graph.replay();
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(y, ops::gemv_fused(x, w))) << "replay " << i;
  }
#endif
}

// gemv_batched (J products in one launch, the DSA latent absorptions) against float64: fp32 and
// bf16 (both kernels), every row count, x a strided view (the packed projection's q_nope) and a
// misaligned one (copied), out a view into a wider tensor whose other columns stay untouched, with
// and without the sigmoid output gate.
TEST(FusedGemv, BatchedMatchesFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(13);
  struct Shape {
    int64_t J, N, K;
  };
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (Shape sh : {Shape{16, 512, 128}, Shape{16, 128, 512}, Shape{3, 5, 24}, Shape{1, 33, 64}})
      for (int64_t M : std::initializer_list<int64_t>{1, 3, kernels::kGemvMaxRows})
        for (bool gated : {false, true})
          for (int64_t x_offset : {0, 1}) {
            SCOPED_TRACE(::testing::Message() << name(dt) << " J " << sh.J << " N " << sh.N << " K " << sh.K << " M "
                                              << M << (gated ? " gated" : "") << (x_offset ? " misaligned x" : ""));
            auto x = torch::randn({M, sh.J, sh.K + 16}, gpu(dt)).narrow(-1, x_offset, sh.K);
            auto w = torch::randn({sh.J, sh.N, sh.K}, gpu(dt)) / std::sqrt(static_cast<double>(sh.K));
            auto gate = gated ? torch::randn({M, sh.J, sh.N + 3}, gpu(dt)).narrow(-1, 0, sh.N) : Tensor();
            auto wide = torch::full({M, sh.J, sh.N + 8}, std::nan(""), gpu(dt));
            auto out = wide.narrow(-1, 4, sh.N);
            ASSERT_TRUE(ops::gemv_batched_applies(x, w, gate));
            ops::gemv_batched(x, w, out, gate);
            auto want = torch::einsum("mjk,jnk->mjn", {x.cpu().to(torch::kFloat64), w.cpu().to(torch::kFloat64)});
            if (gated) want = want * torch::sigmoid(gate.cpu().to(torch::kFloat64));
            EXPECT_LT(rel_err(out.cpu(), want), tolerance(dt));
            EXPECT_TRUE(torch::isnan(wide.narrow(-1, 0, 4)).all().item<bool>()) << "wrote outside out";
            EXPECT_TRUE(torch::isnan(wide.narrow(-1, sh.N + 4, 4)).all().item<bool>()) << "wrote outside out";
          }
  auto x = torch::randn({2, 4, 64}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::gemv_batched_applies(x, torch::randn({3, 8, 64}, gpu(torch::kBFloat16))));  // J differs
  EXPECT_FALSE(ops::gemv_batched_applies(x, torch::randn({4, 8, 64}, gpu(torch::kFloat32))));   // dtypes differ
  EXPECT_THROW(ops::gemv_batched(x, torch::randn({4, 8, 64}, gpu(torch::kBFloat16)),
                                 torch::empty({2, 4, 9}, gpu(torch::kBFloat16))),
               Error);  // out must be [2, 4, 8]
}
