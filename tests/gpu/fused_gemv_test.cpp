// GPU (CTest label `gpu`): the decode GEMVs (ops/projections/gemv.h) beyond their kernel-case rows
// (tests/gpu/kernel_cases_test.cpp): what gemv_fused and gemv_batched refuse; ops::linear takes the
// GEMV exactly when gemv_fused_applies says so; a CUDA-graph replay with new inputs == eager. Skips
// where no CUDA GPU (or no CUDA kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/kernels/decode.h"
#include "lt2/ops/projections/gemv.h"
#include "lt2/ops/projections/projections.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

Tensor reference(const Tensor& x, const Tensor& w) {
  return torch::matmul(x.cpu().to(torch::kFloat64), w.cpu().to(torch::kFloat64).t());
}

}  // namespace

TEST(FusedGemv, RejectsTooManyKSplits) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  const auto dt = torch::kBFloat16;
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

TEST(FusedGemv, BatchedRejectsWhatItCannotTake) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  auto x = torch::randn({2, 4, 64}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::gemv_batched_applies(x, torch::randn({3, 8, 64}, gpu(torch::kBFloat16))));  // J differs
  EXPECT_FALSE(ops::gemv_batched_applies(x, torch::randn({4, 8, 64}, gpu(torch::kFloat32))));   // dtypes differ
  EXPECT_THROW(ops::gemv_batched(x, torch::randn({4, 8, 64}, gpu(torch::kBFloat16)),
                                 torch::empty({2, 4, 9}, gpu(torch::kBFloat16))),
               Error);  // out must be [2, 4, 8]
}
