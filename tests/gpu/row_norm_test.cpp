// GPU (CTest label `gpu`): the row-norm kernels (kernels/cuda/row_norm.cu behind
// ops::gated_rms_norm and ops::l2_normalize). Output and the gradients of x, weight and gate
// against the float64 reference (the libtorch math on the CPU, through autograd) on random inputs:
// fp32 and bf16, row lengths off the warp width, past 256 and past 1024 (a block a row), every gate
// activation, no weight, a one-group gain [1, d], a gate read in place from a column slice of a
// packed projection; the switch `row_norm` off takes the
// reference on the GPU; the block RMSNorm (ops::rms_norm) under autograd, which takes the same
// kernels, and its form written in autocast's dtype for the products after it
// (ops::rms_norm_for_products); the residual add with the block norm after it (ops::add_rms_norm,
// switch `residual_norm`). Skips where no CUDA GPU (or kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/nn/norm.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

#define REQUIRE_ROW_NORM_KERNEL()                                      \
  if (!torch::cuda::is_available() || !lt2::fused_decode_available()) \
  GTEST_SKIP() << "no CUDA GPU or no CUDA kernels in this build"

const char* act_name(ops::GateActivation a) {
  return a == ops::GateActivation::Swish ? "swish" : a == ops::GateActivation::Sigmoid ? "sigmoid" : "none";
}

// The autograd node that made t, past the views over its result.
std::string producer(const Tensor& t) {
  auto node = t.grad_fn();
  while (node && node->name().rfind("ViewBackward", 0) == 0 && node->num_inputs() > 0 && !node->next_edges().empty())
    node = node->next_edges()[0].function;
  return node ? node->name() : "";
}

struct Grads {
  Tensor y, dx, dw, dg;
};

// kind 0: gated RMSNorm (weight, gate per `act`); kind 1: L2 norm. Inputs float64 on the CPU.
Grads run(int kind, const Tensor& x, const Tensor& w, const Tensor& g, ops::GateActivation act, const Tensor& dy,
          torch::Device device, torch::ScalarType dt) {
  auto xd = x.to(device, dt).detach().requires_grad_(true);
  auto wd = w.to(device, dt == torch::kFloat64 ? dt : torch::kFloat32).detach().requires_grad_(true);
  auto gd = g.to(device, dt).detach().requires_grad_(true);
  const bool gated = act != ops::GateActivation::None;
  auto y = kind == 0 ? ops::gated_rms_norm(xd, wd, 1e-6, gated ? gd : Tensor(), act) : ops::l2_normalize(xd);
  y.backward(dy.to(device, y.scalar_type()));
  return {y.detach().cpu(), xd.grad().cpu(), kind == 0 ? wd.grad().cpu() : Tensor(),
          kind == 0 && gated ? gd.grad().cpu() : Tensor()};
}

}  // namespace

TEST(RowNormGpu, ForwardAndGradientsMatchTheFloat64Reference) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(11);
  const std::vector<ops::GateActivation> acts = {ops::GateActivation::Swish, ops::GateActivation::Sigmoid,
                                                 ops::GateActivation::None};
  for (int64_t D : {192, 96, 33, 1000, 1536, 3000}) {  // 1536, 3000: a block a row (8 and 16 a thread)
    for (int kind : {0, 1}) {
      for (auto act : kind == 0 ? acts : std::vector<ops::GateActivation>{ops::GateActivation::None}) {
        SCOPED_TRACE(cat(kind == 0 ? "gated rms norm " : "l2 norm ", act_name(act), " D", D));
        const std::vector<int64_t> shape = {3, 37, 2, D};  // rows not a multiple of the block's 8
        auto x = torch::randn(shape, torch::kFloat64) * 2;
        auto w = 1 + 0.1 * torch::randn({D}, torch::kFloat64);
        auto g = torch::randn(shape, torch::kFloat64);
        auto dy = torch::randn(shape, torch::kFloat64);
        for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
          SCOPED_TRACE(name(dt));
          // bf16 rounds the inputs: the reference runs on the same rounded inputs.
          const auto r = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
          const auto want = run(kind, r(x), w, r(g), act, r(dy), torch::kCPU, torch::kFloat64);
          const auto got = run(kind, x, w, g, act, dy, torch::kCUDA, dt);
          const double tol = tolerance(dt);
          EXPECT_LT(rel_err(got.y, want.y), tol);
          EXPECT_LT(rel_err(got.dx, want.dx), tol);
          if (kind == 0) {
            EXPECT_LT(rel_err(got.dw, want.dw), tol);
          }
          if (got.dg.defined()) {
            EXPECT_LT(rel_err(got.dg, want.dg), tol);
          }
        }
      }
    }
  }
}

TEST(RowNormGpu, OneGroupGainTakesTheKernels) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(14);
  // Mamba2's norm: x [B, T, 1, d] with a gain [1, d] (one group), d 1536 (a block a row): the kernels
  // against the reference (the switch off), output and the gradients of x and the gain.
  const auto x0 = torch::randn({4, 50, 1, 1536}, gpu(torch::kFloat32));
  const auto w0 = 1 + 0.1 * torch::randn({1, 1536}, gpu(torch::kFloat32));
  const auto dy = torch::randn({4, 50, 1, 1536}, gpu(torch::kFloat32));
  auto run_norm = [&] {
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto y = ops::gated_rms_norm(x, w, 1e-5, Tensor(), ops::GateActivation::None);
    y.backward(dy);
    return std::vector<Tensor>{y.detach(), x.grad(), w.grad()};
  };
  const auto fused = run_norm();
  DecodeOptions off;
  off.row_norm = false;
  DecodeOptionsGuard guard(off);
  const auto reference = run_norm();
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_LT(rel_err(fused[i], reference[i]), 1e-5) << i;
}

TEST(RowNormGpu, SwitchOffTakesTheReference) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::NoGradGuard no_grad;
  torch::manual_seed(12);
  auto x = torch::randn({4, 50, 192}, gpu(torch::kFloat32));
  auto w = torch::randn({192}, gpu(torch::kFloat32));
  auto g = torch::randn({4, 50, 192}, gpu(torch::kFloat32));
  const auto fused = ops::gated_rms_norm(x, w, 1e-6, g, ops::GateActivation::Swish);
  const auto l2 = ops::l2_normalize(x);
  DecodeOptions off;
  off.row_norm = false;
  DecodeOptionsGuard guard(off);
  EXPECT_LT(rel_err(ops::gated_rms_norm(x, w, 1e-6, g, ops::GateActivation::Swish), fused), 1e-5);
  EXPECT_LT(rel_err(ops::l2_normalize(x), l2), 1e-5);
}

TEST(RowNormGpu, InferenceReadsModelDtypeWeightsAsTheyAre) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::NoGradGuard no_grad;
  torch::manual_seed(13);
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(name(dt));
    const auto x = torch::randn({5, 33, 192}, gpu(dt)), g = torch::randn({5, 33, 192}, gpu(dt));
    const auto w = (1 + 0.1 * torch::randn({192}, gpu(torch::kFloat32))).to(dt);
    const auto y = ops::gated_rms_norm(x, w, 1e-6, g, ops::GateActivation::Swish);
    const auto f64 = [](const Tensor& t) { return t.to(torch::kCPU, torch::kFloat64); };
    const auto want = ops::gated_rms_norm(f64(x), f64(w), 1e-6, f64(g), ops::GateActivation::Swish);
    EXPECT_LT(rel_err(y.cpu(), want), tolerance(dt));
  }
}

TEST(RowNormGpu, BlockRmsNormUnderAutogradMatchesTheReference) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(14);
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(name(dt));
    const int64_t d = 768;  // the 100M presets' width: the block norms take the row-norm kernels in training
    const auto x = torch::randn({2, 37, d}, torch::kFloat64).to(dt).to(torch::kFloat64);
    const auto w = 1 + 0.1 * torch::randn({d}, torch::kFloat64);
    const auto dy = torch::randn({2, 37, d}, torch::kFloat64).to(dt).to(torch::kFloat64);
    auto run = [&](torch::Device device, torch::ScalarType x_dtype) {
      RMSNorm norm(d, 1e-6);
      norm->to(device, x_dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32);
      {
        torch::NoGradGuard no_grad;
        norm->weight.copy_(w);
      }
      auto xd = x.to(device, x_dtype).detach().requires_grad_(true);
      auto y = ops::rms_norm(xd, norm);
      y.backward(dy.to(device, y.scalar_type()));
      return std::vector<Tensor>{y.detach().cpu(), xd.grad().cpu(), norm->weight.grad().cpu()};
    };
    const auto want = run(torch::kCPU, torch::kFloat64), got = run(torch::kCUDA, dt);
    EXPECT_LT(rel_err(got[0], want[0]), tolerance(dt));
    EXPECT_LT(rel_err(got[1], want[1]), tolerance(dt));
    EXPECT_LT(rel_err(got[2], want[2]), tolerance(dt));
  }
}

TEST(RowNormGpu, GateSlicedFromAPackedProjectionIsReadInPlace) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(15);
  // The gate a column slice [B, T, G, D] of a packed [B, T, N] projection, as GDN's output gate is:
  // at a 16-byte aligned column (the 16-byte form) and at an odd one (one warp a row); its gradient
  // reaches only its own columns of the projection. float64 on the CPU, on the same rounded inputs,
  // is the reference.
  const int64_t B = 2, T = 29, G = 3, D = 192;
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t column : {16, 13}) {
      SCOPED_TRACE(cat(name(dt), " gate from column ", column));
      const int64_t N = column + G * D + 24;
      const auto r = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
      const auto x = r(torch::randn({B, T, G, D}, torch::kFloat64) * 2);
      const auto packed = r(torch::randn({B, T, N}, torch::kFloat64));
      const auto w = 1 + 0.1 * torch::randn({D}, torch::kFloat64);
      const auto dy = r(torch::randn({B, T, G, D}, torch::kFloat64));
      auto run = [&](torch::Device device, torch::ScalarType t) {
        auto xd = x.to(device, t).detach().requires_grad_(true);
        auto pd = packed.to(device, t).detach().requires_grad_(true);
        auto wd = w.to(device, t == torch::kFloat64 ? t : torch::kFloat32).detach().requires_grad_(true);
        const auto gate = pd.narrow(2, column, G * D).view({B, T, G, D});
        auto y = ops::gated_rms_norm(xd, wd, 1e-6, gate, ops::GateActivation::Swish);
        y.backward(dy.to(device, y.scalar_type()));
        return std::vector<Tensor>{y.detach().cpu(), xd.grad().cpu(), wd.grad().cpu(), pd.grad().cpu()};
      };
      const auto want = run(torch::kCPU, torch::kFloat64), got = run(torch::kCUDA, dt);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tolerance(dt)) << "output " << i;
      EXPECT_EQ(got[3].narrow(2, 0, column).abs().max().item<double>(), 0.0);
      EXPECT_EQ(got[3].narrow(2, column + G * D, N - column - G * D).abs().max().item<double>(), 0.0);
    }
  }
}

TEST(RowNormGpu, NormForProductsWritesTheAutocastDtype) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(16);
  // Under bf16 autocast with fp32 x, rms_norm_for_products writes bf16: the values of the fp32 norm
  // cast to bf16, and the gradients of that norm for the same (bf16) output gradient; outside
  // autocast, or with the switch off, it is rms_norm itself. Rows of 768 (fp32: 24 elements a lane)
  // and 33 (one warp a row).
  for (int64_t d : {768, 33}) {
    SCOPED_TRACE(cat("d ", d));
    RMSNorm norm(d, 1e-6);
    norm->to(torch::kCUDA);
    {
      torch::NoGradGuard no_grad;
      norm->weight.copy_(1 + 0.1 * torch::randn({d}, gpu(torch::kFloat32)));
    }
    const auto x = torch::randn({3, 37, d}, gpu(torch::kFloat32));
    const auto dy = torch::randn({3, 37, d}, gpu(torch::kFloat32)).to(torch::kBFloat16);
    auto run = [&](bool for_products, bool autocast) {
      auto xd = x.clone().requires_grad_(true);
      norm->weight.mutable_grad() = Tensor();
      Tensor y;
      {
        AutocastStateScope scope(AutocastState{autocast, torch::kBFloat16});
        y = for_products ? ops::rms_norm_for_products(xd, norm) : ops::rms_norm(xd, norm);
      }
      y.backward(dy.to(y.scalar_type()));
      return std::vector<Tensor>{y.detach(), xd.grad(), norm->weight.grad().clone()};
    };
    const auto want = run(false, true), got = run(true, true);
    EXPECT_EQ(got[0].scalar_type(), torch::kBFloat16);
    EXPECT_EQ(want[0].scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(got[0], want[0].to(torch::kBFloat16)));
    EXPECT_LT(rel_err(got[1], want[1]), 1e-6);
    EXPECT_LT(rel_err(got[2], want[2]), 1e-6);
    EXPECT_EQ(run(true, false)[0].scalar_type(), torch::kFloat32);
    DecodeOptions off;
    off.norm_products_dtype = false;
    DecodeOptionsGuard guard(off);
    EXPECT_EQ(run(true, true)[0].scalar_type(), torch::kFloat32);
  }
}

TEST(RowNormGpu, ResidualAddAndNormMatchTheFloat64Reference) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(17);
  // ops::add_rms_norm under autograd: h = x + m and y = RMSNorm(h) by the row-norm kernels with a
  // residual, forward and backward, with gradients reaching both h (the residual stream) and y.
  // Cases: training's fp32 x with the mixer's bf16 m and y in bf16 for the products under autocast;
  // all fp32; all bf16. Rows of 768 and 33. Against the float64 reference through autograd, on the
  // same rounded inputs and output gradients; the kernel path is checked by its autograd node.
  struct Case {
    torch::ScalarType x, m;
    bool for_products;
  };
  for (const Case c : {Case{torch::kFloat32, torch::kBFloat16, true}, Case{torch::kFloat32, torch::kFloat32, false},
                       Case{torch::kBFloat16, torch::kBFloat16, false}}) {
    for (int64_t d : {768, 33}) {
      SCOPED_TRACE(cat("x ", name(c.x), " m ", name(c.m), c.for_products ? " for products" : "", " d ", d));
      const auto y_dtype = c.for_products ? torch::kBFloat16 : c.x;
      const auto r = [](const Tensor& t, torch::ScalarType dt) { return t.to(dt).to(torch::kFloat64); };
      const auto x = r(torch::randn({3, 37, d}, torch::kFloat64) * 2, c.x);
      const auto m = r(torch::randn({3, 37, d}, torch::kFloat64), c.m);
      const auto w = 1 + 0.1 * torch::randn({d}, torch::kFloat64);
      const auto dh = r(torch::randn({3, 37, d}, torch::kFloat64), c.x);
      const auto dy = r(torch::randn({3, 37, d}, torch::kFloat64), y_dtype);
      auto run = [&](torch::Device device, bool reference) {
        RMSNorm norm(d, 1e-6);
        norm->to(device, reference ? torch::kFloat64 : torch::kFloat32);
        {
          torch::NoGradGuard no_grad;
          norm->weight.copy_(w);
        }
        auto xd = x.to(device, reference ? torch::kFloat64 : c.x).detach().requires_grad_(true);
        auto md = m.to(device, reference ? torch::kFloat64 : c.m).detach().requires_grad_(true);
        ops::AddRmsNormResult out;
        {
          AutocastStateScope scope(AutocastState{c.for_products && !reference, torch::kBFloat16});
          out = ops::add_rms_norm(xd, md, norm, c.for_products);
        }
        if (!reference) {
          EXPECT_NE(producer(out.h).find("AddRowNormFunction"), std::string::npos) << producer(out.h);
          EXPECT_EQ(out.h.scalar_type(), c.x);
          EXPECT_EQ(out.y.scalar_type(), y_dtype);
        }
        torch::autograd::backward({out.h, out.y},
                                  {dh.to(device, out.h.scalar_type()), dy.to(device, out.y.scalar_type())});
        if (!reference) {
          EXPECT_EQ(md.grad().scalar_type(), c.m);
        }
        return std::vector<Tensor>{out.h.detach().cpu(), out.y.detach().cpu(), xd.grad().cpu(), md.grad().cpu(),
                                   norm->weight.grad().cpu()};
      };
      const auto want = run(torch::kCPU, true), got = run(torch::kCUDA, false);
      const double tol = tolerance(c.x == torch::kBFloat16 || c.m == torch::kBFloat16 || c.for_products
                                       ? torch::kBFloat16
                                       : torch::kFloat32);
      const char* names[] = {"h", "y", "dx", "dm", "dweight"};
      for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tol) << names[i];
    }
  }
}

TEST(RowNormGpu, ResidualNormSwitchOffAddsAndNormalisesApart) {
  REQUIRE_ROW_NORM_KERNEL();
  torch::manual_seed(18);
  // residual_norm off: the add and the norm as separate autograd nodes, with the same values and
  // gradients (fp32, where both paths compute the same sums).
  const int64_t d = 768;
  RMSNorm norm(d, 1e-6);
  norm->to(torch::kCUDA);
  const auto x = torch::randn({2, 19, d}, gpu(torch::kFloat32)), m = torch::randn({2, 19, d}, gpu(torch::kFloat32));
  const auto dh = torch::randn({2, 19, d}, gpu(torch::kFloat32)), dy = torch::randn({2, 19, d}, gpu(torch::kFloat32));
  auto run = [&](bool fused) {
    DecodeOptions o;
    o.residual_norm = fused;
    DecodeOptionsGuard guard(o);
    auto xd = x.clone().requires_grad_(true), md = m.clone().requires_grad_(true);
    norm->weight.mutable_grad() = Tensor();
    const auto out = ops::add_rms_norm(xd, md, norm);
    EXPECT_EQ(producer(out.h).find("AddRowNormFunction") != std::string::npos, fused) << producer(out.h);
    torch::autograd::backward({out.h, out.y}, {dh, dy});
    return std::vector<Tensor>{out.h.detach(), out.y.detach(), xd.grad(), md.grad(), norm->weight.grad().clone()};
  };
  const auto on = run(true), off = run(false);
  for (size_t i = 0; i < on.size(); ++i) EXPECT_LT(rel_err(on[i], off[i]), 1e-6) << i;
}
