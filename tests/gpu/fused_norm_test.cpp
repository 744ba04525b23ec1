// GPU (CTest label `gpu`): the fused elementwise decode kernels (ops/fused_decode.h: rms_norm_fused,
// add_rms_norm_fused, silu_mul_fused) against float64 references on the CPU, fresh random inputs,
// fp32 (relative RMS error < 1e-5) and bf16 (< 5e-3), dims off multiples of 256 and strided rows;
// the residual h bit-equal to the unfused add; a block and a packed SwiGLU with the switch on ==
// off. Skips where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <vector>

#include "common/testing.h"
#include "lt2/model/block.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/ops/fused_decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

// RMSNorm in float64 on the CPU: x * rsqrt(mean(x^2) + eps) * w.
Tensor rms_norm_reference(const Tensor& x, const Tensor& w, double eps) {
  auto x64 = x.cpu().to(torch::kFloat64);
  return x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + eps) * w.cpu().to(torch::kFloat64);
}

// [rows, d] rows: d = 64, 2048 (the 1.3B width), dims off multiples of 256 and of 32, d < 256.
struct NormShape {
  int64_t rows, d;
};
const std::vector<NormShape> kNormShapes{{1, 64}, {1, 2048}, {3, 1000}, {5, 37}, {2, 4097}, {64, 300}};

}  // namespace

TEST(FusedNorm, RmsNormMatchesReference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (const auto& s : kNormShapes) {
      SCOPED_TRACE(::testing::Message() << name(dt) << " rows " << s.rows << " d " << s.d);
      torch::manual_seed(s.rows * 10000 + s.d);
      // Rows through a strided view (row stride 2d), values off unit scale.
      auto x = (3 * torch::randn({s.rows, 2 * s.d}, gpu(torch::kFloat32))).to(dt).narrow(1, 0, s.d);
      auto w = (1 + 0.3 * torch::randn({s.d}, gpu(torch::kFloat32))).to(dt);
      auto y = ops::rms_norm_fused(x, w, 1e-5);
      EXPECT_EQ(y.scalar_type(), dt);
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_LT(rel_err(y.cpu(), rms_norm_reference(x, w, 1e-5)), tolerance(dt));
    }
}

TEST(FusedNorm, AddRmsNormMatchesReference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (const auto& s : kNormShapes) {
      SCOPED_TRACE(::testing::Message() << name(dt) << " rows " << s.rows << " d " << s.d);
      torch::manual_seed(s.rows * 10000 + s.d + 1);
      auto x = torch::randn({s.rows, 1, s.d}, gpu(dt));  // a decode step's [B, 1, d]
      auto m = (0.5 * torch::randn({s.rows, 1, s.d}, gpu(torch::kFloat32))).to(dt);
      auto w = (1 + 0.3 * torch::randn({s.d}, gpu(torch::kFloat32))).to(dt);
      auto r = ops::add_rms_norm_fused(x, m, w, 1e-6);
      EXPECT_TRUE(torch::equal(r.h, x + m)) << "h must be the unfused add in the activation dtype";
      EXPECT_EQ(r.y.scalar_type(), dt);
      EXPECT_EQ(r.y.sizes(), x.sizes());
      // y normalises the rounded h, as ffn_norm(x + m) does.
      EXPECT_LT(rel_err(r.y.cpu(), rms_norm_reference(x + m, w, 1e-6)), tolerance(dt));
    }
}

TEST(FusedNorm, SiluMulMatchesReference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  struct Shape {
    int64_t rows, hidden;
  };
  // 5632: the 1.3B FFN width; 37, 1: not a multiple of the block size.
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (const Shape& s : std::vector<Shape>{{1, 5632}, {8, 5632}, {3, 37}, {2, 1}, {33, 300}})
      for (bool strided : {false, true}) {
        SCOPED_TRACE(::testing::Message() << name(dt) << " rows " << s.rows << " hidden " << s.hidden
                                          << (strided ? " strided" : ""));
        torch::manual_seed(s.rows * 10000 + s.hidden);
        auto gate_up = (3 * torch::randn({s.rows, 1, (strided ? 3 : 2) * s.hidden}, gpu(torch::kFloat32))).to(dt);
        if (strided) gate_up = gate_up.narrow(-1, s.hidden, 2 * s.hidden);
        auto out = ops::silu_mul_fused(gate_up);
        auto g64 = gate_up.cpu().to(torch::kFloat64);
        auto a = g64.narrow(-1, 0, s.hidden), b = g64.narrow(-1, s.hidden, s.hidden);
        EXPECT_EQ(out.scalar_type(), dt);
        EXPECT_EQ(out.sizes(), a.sizes());
        EXPECT_LT(rel_err(out.cpu(), a * torch::sigmoid(a) * b), tolerance(dt));
      }
}

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
