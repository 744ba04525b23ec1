// GPU (CTest label `gpu`): sliding-window attention through libtorch's FlashAttention-2 kernels
// (ops::window_attention with DecodeOptions::window_flash on). Output, dq, dk and dv against the
// float64 reference (masked attention over window_mask on the CPU, through autograd) on random
// inputs in bf16 and fp16: windows 1 (where dq and dk are zero), 64, 1000, at and past the length
// and 0 (plain causal), lengths off the kernels' 128-row blocks, queries at the last T of L keys (a
// continued prefill), GQA; the window and NSA mixers' whole-sequence forward with the switch on
// equals it off. Skips where no CUDA GPU.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <string>
#include <vector>

#include "common/testing.h"
#include "mixers/sparse_testing.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct Case {
  int64_t B, H, H_kv, T, L, D, window;
  std::string name() const { return cat("B", B, " H", H, "/", H_kv, " T", T, " L", L, " D", D, " W", window); }
};

struct Result {
  Tensor o, dq, dk, dv;
};

// Output and gradients (for the output gradient `dout`) on `device` in `dt`.
Result run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, int64_t window,
           torch::Device device, torch::ScalarType dt) {
  auto qd = q.to(device, dt).detach().requires_grad_(true);
  auto kd = k.to(device, dt).detach().requires_grad_(true);
  auto vd = v.to(device, dt).detach().requires_grad_(true);
  auto o = window_attention(qd, kd, vd, window);
  o.backward(dout.to(device, dt));
  return {o.detach().cpu().to(torch::kFloat64), qd.grad().cpu().to(torch::kFloat64),
          kd.grad().cpu().to(torch::kFloat64), vd.grad().cpu().to(torch::kFloat64)};
}

// The switch on for the test's duration.
struct WindowFlash {
  WindowFlash() { options.window_flash = true; }
  DecodeOptions options;
  DecodeOptionsGuard guard{options};
};

}  // namespace

TEST(WindowAttentionGpu, FlashMatchesTheFloat64Reference) {
  REQUIRE_CUDA();
  WindowFlash on;
  torch::manual_seed(11);
  const std::vector<Case> cases{{2, 4, 4, 300, 300, 64, 1},     {2, 4, 2, 300, 300, 64, 64},
                                {1, 8, 2, 1500, 1500, 128, 1000}, {1, 4, 4, 200, 200, 128, 200},
                                {2, 4, 1, 77, 77, 64, 5000},     {1, 4, 4, 333, 333, 128, 0},
                                {2, 4, 2, 100, 700, 64, 256},    {1, 4, 4, 1, 500, 128, 64}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name());
    auto q = torch::randn({c.B, c.H, c.T, c.D}, torch::kFloat64);
    auto k = torch::randn({c.B, c.H_kv, c.L, c.D}, torch::kFloat64);
    auto v = torch::randn({c.B, c.H_kv, c.L, c.D}, torch::kFloat64);
    auto dout = torch::randn({c.B, c.T, c.H, c.D}, torch::kFloat64);
    for (auto dt : {torch::kBFloat16, torch::kHalf}) {
      SCOPED_TRACE(name(dt));
      ASSERT_TRUE(window_flash_serves(q.to(gpu(dt)), k.to(gpu(dt)), v.to(gpu(dt))));
      // The reference on the same rounded inputs.
      auto round = [dt](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
      const auto want = run(round(q), round(k), round(v), round(dout), c.window, torch::kCPU, torch::kFloat64);
      const auto got = run(q, k, v, dout, c.window, torch::kCUDA, dt);
      const double tol = tolerance(dt);
      EXPECT_LT(rel_err(got.o, want.o), tol);
      EXPECT_LT(rel_err(got.dv, want.dv), tol);
      if (c.window == 1) {
        // Each query sees only its own key: the softmax is constant, so dq and dk are exactly zero
        // and what the kernel returns is rounding, checked against the size of the output gradient.
        const double scale = dout.norm().item<double>();
        EXPECT_LT(got.dq.norm().item<double>() / scale, tol);
        EXPECT_LT(got.dk.norm().item<double>() / scale, tol);
      } else {
        EXPECT_LT(rel_err(got.dq, want.dq), tol);
        EXPECT_LT(rel_err(got.dk, want.dk), tol);
      }
    }
  }
}

TEST(WindowAttentionGpu, TakesTheMaskedPathWhereFlashDoesNotServe) {
  REQUIRE_CUDA();
  WindowFlash on;
  auto q = torch::randn({1, 2, 16, 64}, gpu(torch::kFloat32));
  auto k = torch::randn({1, 2, 16, 64}, gpu(torch::kFloat32));
  EXPECT_FALSE(window_flash_serves(q, k, k));  // fp32
  auto qb = q.to(torch::kBFloat16), kb = k.to(torch::kBFloat16);
  EXPECT_TRUE(window_flash_serves(qb, kb, kb));
  EXPECT_FALSE(window_flash_serves(qb.narrow(3, 0, 60), kb.narrow(3, 0, 60), kb.narrow(3, 0, 60)));  // D % 8
  EXPECT_FALSE(window_flash_serves(qb, kb.narrow(2, 0, 8), kb.narrow(2, 0, 8)));  // T > L
  DecodeOptions off;
  off.window_flash = false;
  DecodeOptionsGuard guard(off);
  EXPECT_FALSE(window_flash_serves(qb, kb, kb));
}

TEST(WindowAttentionGpu, MixerForwardWithFlashEqualsTheMaskedPath) {
  REQUIRE_CUDA();
  torch::manual_seed(12);
  for (const std::string mixer : {"window", "nsa"}) {
    SCOPED_TRACE(mixer);
    auto m = sparse_testing::make_f64(mixer, sparse_testing::attention_config(mixer, json{{"window", 24}}));
    m->to(torch::kCUDA, torch::kBFloat16);
    torch::NoGradGuard no_grad;
    auto x = torch::randn({2, 60, lt2::testing::tiny_config().d_model}, gpu(torch::kBFloat16));
    auto masked = m->forward(x, {0, 0});
    WindowFlash on;
    auto flash = m->forward(x, {0, 0});
    EXPECT_LT(rel_err(flash.to(torch::kFloat64), masked.to(torch::kFloat64)), tolerance(torch::kBFloat16));
  }
}
