// GPU (CTest label `gpu`): a block's forward (decode step and prefill) and a packed SwiGLU with the
// fused elementwise kernels (ops/norms/norms.h) and GEMVs on == off, fp32 and bf16; the kernels
// themselves are kernel-case rows (tests/gpu/kernel_cases_test.cpp). Skips where no CUDA GPU (or
// no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/model/block.h"
#include "lt2/ops/projections/projections.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

// A block's forward (decode step and prefill) and a packed SwiGLU with the fused kernels == the
// libtorch path, in fp32 and bf16.
TEST(FusedNorm, BlockAndSwiGLUFusedEqualReference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  auto cfg = lt2::testing::tiny_config("gdn");
  cfg.d_model = 96;  // d and the FFN width off multiples of 256
  cfg.n_heads = 2;
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(name(dt));
    torch::manual_seed(3);
    Block block(cfg, 0, "gdn");
    for (auto* norm : {&block->mixer_norm, &block->ffn_norm}) (*norm)->weight.normal_(1.0, 0.2);  // gains != 1
    block->to(torch::kCUDA, dt);
    block->ffn->pack();
    const int64_t B = 3, T = 5;
    auto x = torch::randn({B, T, cfg.d_model}, gpu(dt));
    // Prefill T - 1 tokens, then one decode step: the block's outputs [B, T, d] and the FFN's.
    auto run = [&](bool fused) {
      FusedDecode options(fused);
      auto state = block->mixer->make_state(B, T, x.options());
      auto y_pre = block->forward(x.narrow(1, 0, T - 1), Positions{0}, state.get());
      auto y_step = block->forward(x.narrow(1, T - 1, 1), Positions{T - 1}, state.get());
      auto f = ops::swiglu(*block->ffn, x);
      return std::make_pair(torch::cat({y_pre, y_step}, 1), f);
    };
    auto [y_fused, f_fused] = run(true);
    auto [y_ref, f_ref] = run(false);
    // The kernels' fp32 sums run in another order than ATen's: a few bf16 roundings apart at most.
    EXPECT_LT(rel_err(y_fused, y_ref), dt == torch::kFloat32 ? 1e-5 : 1e-2);
    EXPECT_LT(rel_err(f_fused, f_ref), dt == torch::kFloat32 ? 1e-5 : 1e-2);
  }
}
