// GPU (CTest label `gpu`): the RoPE kernel of training and prefill (kernels/cuda/rope_cache.cu:
// rope_apply, behind ops::apply_rope). Output and the gradient of a random upstream gradient against
// the float64 reference (lt2::apply_rope on the CPU, through autograd) on random inputs: fp32, bf16
// and fp16, both pair layouts, head dims 64, 96 and 20 (20: the element-wise form in bf16 and fp16),
// x contiguous, as the k part of a packed q|k|v projection (rows strided) and at an odd column
// (unaligned), one head of one sequence, T not a power of two, starts 5 and 100000; the gradient
// arrives as attention's backward hands it over, a transposed view. The attention mixers' layers
// agree with the switch `rope` off, which, like packed documents and per-sequence positions, takes
// the reference. A prefix of the head dims rotated in place without a gradient (apply_rope_prefix_). Skips where no CUDA GPU (or kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "lt2/mixers/registry.h"
#include "lt2/nn/rope.h"
#include "lt2/ops/attention/rope.h"
#include "lt2/util/error.h"
#include "mixers/mixer_testing.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

// Where x [B, T, H, D] sits in the [B, T, N] tensor it is a view of.
struct RopeLayout {
  const char* name;
  bool packed;  // N = H D, x the whole tensor; otherwise N = 3 H D + 8 (a padded q|k|v projection)
  bool odd;     // x starts at column 1 (unaligned); otherwise at column H D (the k part)
};

struct RopeResult {
  Tensor y, dx;  // float64 on the CPU: the output and the gradient of the [B, T, N] tensor at x's columns
  std::string grad_fn;
};

// RoPE of x, a view of `source` [B, T, N] (float64, CPU) at `offset`, in dtype dt on `device`, through
// ops::apply_rope (the kernel where it applies) or lt2::apply_rope; then the gradient of
// sum(y^T * w) for w [B, H, T, D], which reaches y as a transposed view, as from attention.
RopeResult rope_run(const Tensor& source, int64_t offset, int64_t H, int64_t D, int64_t start, RopeStyle style,
                    const Tensor& w, torch::Device device, torch::ScalarType dt, bool ops_path) {
  const int64_t B = source.size(0), T = source.size(1);
  auto p = source.to(device, dt).detach().requires_grad_(true);
  const auto x = p.narrow(2, offset, H * D).reshape({B, T, H, D});
  const Positions pos(start);
  const double theta = 1e4;
  auto y = ops_path ? ops::apply_rope(x, pos, theta, style) : lt2::apply_rope(x, pos, theta, style);
  const std::string grad_fn = y.grad_fn() ? y.grad_fn()->name() : "";
  (y.transpose(1, 2) * w.to(device, dt)).sum().backward();
  const auto f64 = [](const Tensor& t) { return t.detach().to(torch::kCPU, torch::kFloat64); };
  return {f64(y), f64(p.grad().narrow(2, offset, H * D).reshape({B, T, H, D})), grad_fn};
}

}  // namespace

TEST(RopeGpu, ForwardAndGradientMatchTheFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(21);
  const std::vector<RopeLayout> layouts = {{"packed", true, false}, {"k of q|k|v", false, false},
                                       {"odd column", false, true}};
  const int64_t T = 37;
  for (int64_t D : {64, 96, 20}) {
    for (auto [B, H] : std::vector<std::pair<int64_t, int64_t>>{{2, 3}, {1, 1}}) {
      for (const auto& layout : layouts) {
        const int64_t N = layout.packed ? H * D : 3 * H * D + 8;
        const int64_t offset = layout.packed ? 0 : layout.odd ? 1 : H * D;
        for (auto style : {RopeStyle::Interleaved, RopeStyle::Half}) {
          for (int64_t start : {5, 100000}) {
            SCOPED_TRACE(cat("D ", D, " B ", B, " H ", H, " ", layout.name, " ", to_string(style), " start ", start));
            const auto source = torch::randn({B, T, N}, torch::kFloat64);
            const auto w = torch::randn({B, H, T, D}, torch::kFloat64);
            for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
              SCOPED_TRACE(name(dt));
              // Low-precision dtypes round the inputs: the reference runs on the same rounded inputs.
              const auto r = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
              const auto want =
                  rope_run(r(source), offset, H, D, start, style, r(w), torch::kCPU, torch::kFloat64, false);
              const auto got = rope_run(source, offset, H, D, start, style, w, torch::kCUDA, dt, true);
              EXPECT_NE(got.grad_fn.find("RopeFunction"), std::string::npos) << "the kernel did not run: "
                                                                               << got.grad_fn;
              EXPECT_LT(rel_err(got.y, want.y), tolerance(dt));
              EXPECT_LT(rel_err(got.dx, want.dx), tolerance(dt));
              // Without gradients the same kernel runs alone.
              torch::NoGradGuard no_grad;
              const auto x = source.to(torch::kCUDA, dt).narrow(2, offset, H * D).reshape({B, T, H, D});
              const auto y = ops::apply_rope(x, Positions(start), 1e4, style);
              EXPECT_TRUE(torch::equal(y.cpu().to(torch::kFloat64), got.y));
            }
          }
        }
      }
    }
  }
}

TEST(RopeGpu, SwitchOffAndOtherPositionsTakeTheReference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard no_grad;
  torch::manual_seed(22);
  const int64_t B = 2, T = 9, H = 3, D = 64;
  const auto x = torch::randn({B, T, H, D}, gpu(torch::kBFloat16));
  const auto reference = [&](const Positions& pos) { return lt2::apply_rope(x, pos, 1e4, RopeStyle::Half); };
  const auto takes_reference = [&](const Positions& pos, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_FALSE(ops::rope_kernel_applies(x, pos));
    EXPECT_TRUE(torch::equal(ops::apply_rope(x, pos, 1e4, RopeStyle::Half), reference(pos)));
  };
  EXPECT_TRUE(ops::rope_kernel_applies(x, Positions(3)));
  PackedDocuments packed({{0, 4}, {0}}, T);
  packed.offsets = packed.offsets.to(torch::kCUDA);  // as LoopedLM moves them to the model's device
  Positions documents(0);
  documents.documents = std::make_shared<const PackedDocuments>(packed);
  takes_reference(documents, "packed documents");
  const auto one = x.narrow(1, 0, 1);
  const Positions seq_pos(0, 0, torch::tensor({3, 7}, gpu(torch::kLong)));
  EXPECT_FALSE(ops::rope_kernel_applies(one, seq_pos));
  EXPECT_TRUE(torch::equal(ops::apply_rope(one, seq_pos, 1e4, RopeStyle::Half),
                           lt2::apply_rope(one, seq_pos, 1e4, RopeStyle::Half)));
  DecodeOptions off;
  off.rope = false;
  DecodeOptionsGuard guard(off);
  takes_reference(Positions(3), "switch off");
}

// The attention mixers' layers in fp32, forward and backward, with the kernel against the switch off:
// the output and the gradients of the input and of every parameter agree to fp32's tolerance (both
// rotate in fp32; the reference's tables are rounded to fp32).
TEST(RopeGpu, AttentionLayersAgreeWithTheSwitchOff) {
  REQUIRE_FUSED_DECODE();
  for (const char* kind : {"full", "window", "retnet"}) {
    for (auto style : {RopeStyle::Interleaved, RopeStyle::Half}) {
      SCOPED_TRACE(cat(kind, " ", to_string(style)));
      auto cfg = lt2::testing::variant_config({kind, kind, lt2::testing::tiny_options(kind)});
      cfg.rope_style = style;
      torch::manual_seed(23);
      auto m = make_mixer(kind, cfg, 0);
      m->to(torch::kCUDA);
      const int64_t B = 2, T = 37;
      const auto x0 = torch::randn({B, T, cfg.d_model}, gpu(torch::kFloat32));
      const auto w = torch::randn({B, T, cfg.d_model}, gpu(torch::kFloat32));
      const auto pass = [&](bool rope) {
        DecodeOptions options;
        options.rope = rope;
        DecodeOptionsGuard guard(options);
        m->zero_grad();
        auto x = x0.clone().requires_grad_(true);
        auto y = m->forward(x, Positions(0));
        (y * w).sum().backward();
        std::vector<Tensor> out = {y.detach().cpu(), x.grad().cpu()};
        for (const auto& p : m->parameters()) out.push_back(p.grad().defined() ? p.grad().cpu() : Tensor());
        return out;
      };
      const auto got = pass(true), want = pass(false);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        SCOPED_TRACE(i == 0 ? "output" : i == 1 ? "input gradient" : "parameter gradient");
        ASSERT_EQ(got[i].defined(), want[i].defined());
        if (got[i].defined()) {
          EXPECT_LT(rel_err(got[i], want[i]), tolerance(torch::kFloat32));
        }
      }
    }
  }
}

TEST(RopeGpu, PrefixRotatesInPlaceWithoutAGradient) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(24);
  // apply_rope_prefix_ on x [B, T, H, D], a view of a wider projection, rotating its first n dims:
  // without a gradient in place (x itself returned, the other columns untouched), with one a new
  // tensor from the prefix kernel's autograd node with the gradient of the rotation; both against the
  // float64 reference (lt2::apply_rope of the prefix, the rest as is) on the same rounded inputs.
  // D 128, n 64: the 16-byte form; D 70, n 32: 38 copied dims, not whole pieces, the element form.
  const int64_t B = 2, T = 37, H = 3;
  for (auto [D, n] : {std::pair<int64_t, int64_t>{128, 64}, {70, 32}}) {
    const int64_t N = H * D + 16;
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      for (auto style : {RopeStyle::Half, RopeStyle::Interleaved}) {
        SCOPED_TRACE(cat(name(dt), style == RopeStyle::Half ? " half" : " interleaved", " D ", D, " n ", n));
        const Positions pos(7);
        const auto source = torch::randn({B, T, N}, torch::kFloat64).to(dt).to(torch::kFloat64);
        const auto view = [&](const Tensor& t) { return t.narrow(2, 8, H * D).view({B, T, H, D}); };
        const auto ref_x = view(source);
        const auto want =
            torch::cat({lt2::apply_rope(ref_x.narrow(-1, 0, n), pos, 1e4, style), ref_x.narrow(-1, n, D - n)}, -1);
        {
          torch::NoGradGuard no_grad;
          auto packed = source.to(torch::kCUDA, dt);
          const auto before = packed.clone();
          const auto x = view(packed);
          const auto y = ops::apply_rope_prefix_(x, n, pos, 1e4, style);
          EXPECT_EQ(y.data_ptr(), x.data_ptr());
          EXPECT_LT(rel_err(y.cpu().to(torch::kFloat64), want), tolerance(dt));
          EXPECT_TRUE(torch::equal(packed.narrow(2, 0, 8), before.narrow(2, 0, 8)));
          EXPECT_TRUE(torch::equal(packed.narrow(2, 8 + H * D, 8), before.narrow(2, 8 + H * D, 8)));
        }
        auto packed = source.to(torch::kCUDA, dt).requires_grad_(true);
        const auto y = ops::apply_rope_prefix_(view(packed), n, pos, 1e4, style);
        EXPECT_NE(y.grad_fn()->name().find("RopePrefixFunction"), std::string::npos) << y.grad_fn()->name();
        EXPECT_LT(rel_err(y.detach().cpu().to(torch::kFloat64), want), tolerance(dt));
        EXPECT_TRUE(torch::equal(y.detach().narrow(-1, n, D - n), view(packed).detach().narrow(-1, n, D - n)));
        const auto w = torch::randn({B, T, H, D}, torch::kFloat64);
        (y * w.to(torch::kCUDA, dt)).sum().backward();
        auto ref_source = source.clone().requires_grad_(true);
        const auto rx = view(ref_source);
        const auto ry =
            torch::cat({lt2::apply_rope(rx.narrow(-1, 0, n), pos, 1e4, style), rx.narrow(-1, n, D - n)}, -1);
        (ry * w).sum().backward();
        EXPECT_LT(rel_err(packed.grad().cpu().to(torch::kFloat64), ref_source.grad()), tolerance(dt));
      }
    }
  }
}
