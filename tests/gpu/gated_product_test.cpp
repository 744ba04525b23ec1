// GPU (CTest label `gpu`): the gated-product kernels (kernels/cuda/norm_decode.cu behind
// ops::silu_mul, ops::sigmoid_gate and ops::silu_gate). Output and every gradient against the
// float64 reference (the libtorch math on the CPU, through autograd) on random inputs: fp32 and
// bf16, hidden sizes that take the 16-byte form and one that does not, a gate read in place from a
// column slice of a wider tensor; the forward without gradients; the switch `gated_product` off
// takes the reference. The gated sum of NSA's branches (ops::sigmoid_gated_sum) the same way: logits read
// in place from a column slice, branches as [B, H, T, D] storage transposed, head dims 64, 128 and 8 (one
// piece a row) and one off the kernel (48 in bf16: six pieces), the switch `gated_sum` off. Skips where no
// CUDA GPU (or kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <vector>

#include "common/testing.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct Result {
  Tensor out, d_first, d_second;
};

// The product under test: silu_mul of the halves of first, or the gate applied to second.
enum class Form { SiluMul, SigmoidGate, SiluGate };

// The form on `device` in `dt`, with the upstream gradient dout. For the gates `first` [..., 2 n]
// holds the gate in its first n columns, read as a column slice (rows 2 n apart).
Result run(Form form, const Tensor& first, const Tensor& second, const Tensor& dout, torch::Device device,
           torch::ScalarType dt) {
  auto f = first.to(device, dt).detach().requires_grad_(true);
  auto s = second.defined() ? second.to(device, dt).detach().requires_grad_(true) : Tensor();
  const Tensor out = form == Form::SiluMul       ? ops::silu_mul(f)
                     : form == Form::SigmoidGate ? ops::sigmoid_gate(s, f.narrow(-1, 0, s.size(-1)))
                                                 : ops::silu_gate(s, f.narrow(-1, 0, s.size(-1)));
  out.backward(dout.to(device, dt));
  return {out.detach().cpu(), f.grad().cpu(), s.defined() ? s.grad().cpu() : Tensor()};
}

}  // namespace

TEST(GatedProductGpu, ForwardAndGradientsMatchTheFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(21);
  for (int64_t n : {192, 64, 33}) {  // 33: the one-element form
    for (Form form : {Form::SiluMul, Form::SigmoidGate, Form::SiluGate}) {
      const bool gate = form != Form::SiluMul;
      SCOPED_TRACE(cat(form == Form::SiluMul ? "silu mul" : form == Form::SigmoidGate ? "sigmoid gate" : "silu gate",
                       " n ", n));
      auto first = torch::randn({3, 37, 2 * n}, torch::kFloat64) * 2;
      auto second = gate ? torch::randn({3, 37, n}, torch::kFloat64) : Tensor();
      auto dout = torch::randn({3, 37, n}, torch::kFloat64);
      for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
        SCOPED_TRACE(name(dt));
        // bf16 rounds the inputs: the reference runs on the same rounded inputs.
        const auto r = [&](const Tensor& t) { return t.defined() ? t.to(dt).to(torch::kFloat64) : t; };
        const auto want = run(form, r(first), r(second), r(dout), torch::kCPU, torch::kFloat64);
        const auto got = run(form, first, second, dout, torch::kCUDA, dt);
        const double tol = tolerance(dt);
        EXPECT_LT(rel_err(got.out, want.out), tol);
        EXPECT_LT(rel_err(got.d_first, want.d_first), tol);
        if (gate) {
          EXPECT_LT(rel_err(got.d_second, want.d_second), tol);
        }
      }
    }
  }
}

TEST(GatedProductGpu, WithoutGradientsAndWithTheSwitchOff) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard no_grad;
  torch::manual_seed(22);
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(name(dt));
    const auto gate_up = torch::randn({5, 40, 256}, gpu(dt));
    const auto y = torch::randn({5, 40, 96}, gpu(dt)), gate = torch::randn({5, 40, 96}, gpu(dt));
    const auto f64 = [](const Tensor& t) { return t.to(torch::kCPU, torch::kFloat64); };
    const auto silu_mul = ops::silu_mul(gate_up), gated = ops::sigmoid_gate(y, gate);
    const auto silu_gated = ops::silu_gate(y, gate);
    EXPECT_LT(rel_err(silu_mul.cpu(), ops::silu_mul(f64(gate_up))), tolerance(dt));
    EXPECT_LT(rel_err(gated.cpu(), ops::sigmoid_gate(f64(y), f64(gate))), tolerance(dt));
    EXPECT_LT(rel_err(silu_gated.cpu(), ops::silu_gate(f64(y), f64(gate))), tolerance(dt));
    DecodeOptions off;
    off.gated_product = false;
    DecodeOptionsGuard guard(off);
    EXPECT_LT(rel_err(ops::silu_mul(gate_up).cpu(), silu_mul.cpu()), tolerance(dt));
    EXPECT_LT(rel_err(ops::sigmoid_gate(y, gate).cpu(), gated.cpu()), tolerance(dt));
    EXPECT_LT(rel_err(ops::silu_gate(y, gate).cpu(), silu_gated.cpu()), tolerance(dt));
  }
}

TEST(GatedSumGpu, ForwardAndGradientsMatchTheFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(24);
  struct Case {
    int64_t B, T, H, D, n;
  };
  for (const auto& c : {Case{2, 37, 6, 64, 3}, Case{1, 20, 4, 128, 2}, Case{2, 9, 3, 8, 4}, Case{1, 11, 2, 48, 3}}) {
    SCOPED_TRACE(cat("B", c.B, " T", c.T, " H", c.H, " D", c.D, " branches ", c.n));
    // The logits: columns 5 .. 5 + H n of rows H n + 7 wide (a projection's slice), as [B, T, H, n].
    const auto wide = torch::randn({c.B, c.T, c.H * c.n + 7}, torch::kFloat64) * 2;
    std::vector<Tensor> branches;
    for (int64_t i = 0; i < c.n; ++i) branches.push_back(torch::randn({c.B, c.H, c.T, c.D}, torch::kFloat64));
    const auto dout = torch::randn({c.B, c.T, c.H, c.D}, torch::kFloat64);
    // Output, then the gradients of the wide logits and of each branch, on `device` in `dt`.
    auto run = [&](torch::Device device, torch::ScalarType dt) {
      auto w = wide.to(device, dt).detach().requires_grad_(true);
      std::vector<Tensor> leaves, xs;
      for (int64_t i = 0; i < c.n; ++i) {
        leaves.push_back(branches[i].to(device, dt).detach().requires_grad_(true));
        // The first branch as attention writes [B, H, T, D] and hands over transposed; the rest packed.
        xs.push_back(i == 0 ? leaves.back().transpose(1, 2) : leaves.back().transpose(1, 2).contiguous());
      }
      const auto logits = w.narrow(-1, 5, c.H * c.n).view({c.B, c.T, c.H, c.n});
      const auto out = ops::sigmoid_gated_sum(logits, xs);
      out.backward(dout.to(device, dt));
      std::vector<Tensor> r{out.detach().cpu().to(torch::kFloat64), w.grad().cpu().to(torch::kFloat64)};
      for (const auto& l : leaves) r.push_back(l.grad().cpu().to(torch::kFloat64));
      return r;
    };
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(name(dt));
      const auto round = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
      auto rounded_wide = round(wide);
      std::vector<Tensor> rounded;
      for (const auto& b : branches) rounded.push_back(round(b));
      // The reference on the same rounded inputs, in float64 on the CPU.
      const auto want = [&] {
        auto w = rounded_wide.clone().requires_grad_(true);
        std::vector<Tensor> leaves, xs;
        for (const auto& b : rounded) {
          leaves.push_back(b.clone().requires_grad_(true));
          xs.push_back(leaves.back().transpose(1, 2));
        }
        const auto g = torch::sigmoid(w.narrow(-1, 5, c.H * c.n).view({c.B, c.T, c.H, c.n}));
        Tensor out = g.select(-1, 0).unsqueeze(-1) * xs[0];
        for (int64_t i = 1; i < c.n; ++i) out = out + g.select(-1, i).unsqueeze(-1) * xs[i];
        out.backward(round(dout));
        std::vector<Tensor> r{out.detach(), w.grad()};
        for (const auto& l : leaves) r.push_back(l.grad());
        return r;
      }();
      const auto got = run(torch::kCUDA, dt);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tolerance(dt)) << "result " << i;
      // The logits' gradient lands on their columns only.
      EXPECT_EQ(got[1].narrow(-1, 0, 5).abs().max().item<double>(), 0.0);
    }
  }
}

TEST(GatedSumGpu, WithoutGradientsAndWithTheSwitchOff) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard no_grad;
  torch::manual_seed(25);
  const auto on = gpu(torch::kBFloat16);
  const auto logits = torch::randn({2, 30, 4, 3}, on);
  const std::vector<Tensor> xs{torch::randn({2, 30, 4, 64}, on), torch::randn({2, 30, 4, 64}, on),
                               torch::randn({2, 30, 4, 64}, on)};
  const auto kernel = ops::sigmoid_gated_sum(logits, xs);
  DecodeOptions off;
  off.gated_sum = false;
  DecodeOptionsGuard guard(off);
  const auto libtorch = ops::sigmoid_gated_sum(logits, xs);
  EXPECT_LT(rel_err(kernel.to(torch::kFloat64), libtorch.to(torch::kFloat64)), tolerance(torch::kBFloat16));
}
