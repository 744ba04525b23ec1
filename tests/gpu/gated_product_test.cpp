// GPU (CTest label `gpu`): the gated-product kernels (kernels/cuda/norm_decode.cu behind
// ops::silu_mul, ops::sigmoid_gate and ops::silu_gate). Output and every gradient against the
// float64 reference (the libtorch math on the CPU, through autograd) on random inputs: fp32 and
// bf16, hidden sizes that take the 16-byte form and one that does not, a gate read in place from a
// column slice of a wider tensor; the forward without gradients; the switch `gated_product` off
// takes the reference. Skips where no CUDA GPU (or kernels).
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
