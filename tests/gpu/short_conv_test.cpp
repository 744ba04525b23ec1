// GPU (CTest label `gpu`): the short convolution's CUDA kernels (kernels/cuda/short_conv.cu behind
// ops::short_conv). Output, dx, dweight and dbias against the float64 reference (the libtorch path
// on the CPU, through autograd) on random inputs: fp32 and bf16, widths 1 to 8, with and without
// SiLU and bias, lengths and channel counts off the kernels' tiles, packed documents (offsets);
// prefill in pieces through the window equals one call, and the window ends the same; column slices
// of a packed projection read in place, in inference and under autograd; the switch `short_conv` off
// takes the reference on the GPU. Skips where no CUDA GPU (or no CUDA kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/ops/conv/short_conv.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

#define REQUIRE_CONV_KERNEL()                                          \
  if (!torch::cuda::is_available() || !lt2::fused_decode_available()) \
  GTEST_SKIP() << "no CUDA GPU or no CUDA kernels in this build"

struct Case {
  int64_t B, T, C, W;
  bool silu, bias, documents;
  std::string name() const {
    return cat("B", B, " T", T, " C", C, " W", W, silu ? " silu" : "", bias ? " bias" : "",
               documents ? " documents" : "");
  }
};

// Each token's position in its document, documents of random lengths (1 included) packed in a row.
Tensor document_offsets(int64_t B, int64_t T) {
  auto offsets = torch::empty({B, T}, torch::kLong);
  auto a = offsets.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t pos = 0, left = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (left == 0) {
        left = 1 + torch::randint(0, 12, {1}).item<int64_t>();
        pos = 0;
      }
      a[b][t] = pos++;
      --left;
    }
  }
  return offsets;
}

// The op's output and gradients (with a fixed random output gradient) on `device` in `dt`;
// float64 on the CPU is the reference.
struct Result {
  Tensor y, dx, dw, db;
};
Result run(const Case& c, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& offsets,
           const Tensor& dy, torch::Device device, torch::ScalarType dt) {
  auto xd = x.to(device, dt).detach().requires_grad_(true);
  auto wd = w.to(device, torch::kFloat32).detach().requires_grad_(true);
  auto bd = c.bias ? b.to(device, torch::kFloat32).detach().requires_grad_(true) : Tensor();
  if (dt == torch::kFloat64) {
    wd = w.to(device, dt).detach().requires_grad_(true);
    if (c.bias) bd = b.to(device, dt).detach().requires_grad_(true);
  }
  auto y = ops::short_conv(xd, wd, bd, c.silu, nullptr, c.documents ? offsets.to(device) : Tensor());
  y.backward(dy.to(device, y.scalar_type()));
  return {y.detach().cpu(), xd.grad().cpu(), wd.grad().cpu(), c.bias ? bd.grad().cpu() : Tensor()};
}

std::vector<Case> cases() {
  return {{2, 77, 40, 4, true, true, false},   {1, 300, 96, 4, true, false, false}, {3, 64, 33, 2, false, true, false},
          {2, 129, 64, 1, true, true, false},  {2, 95, 48, 6, true, true, false},   {1, 40, 32, 8, false, false, false},
          {2, 200, 72, 4, true, true, true},   {1, 150, 40, 8, true, true, true},   {2, 513, 160, 3, true, false, true}};
}

}  // namespace

TEST(ShortConvGpu, ForwardAndGradientsMatchTheFloat64Reference) {
  REQUIRE_CONV_KERNEL();
  torch::manual_seed(7);
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name());
    auto x = torch::randn({c.B, c.T, c.C}, torch::kFloat64);
    auto w = torch::randn({c.C, 1, c.W}, torch::kFloat64) * 0.5;
    auto b = torch::randn({c.C}, torch::kFloat64) * 0.1;
    auto dy = torch::randn({c.B, c.T, c.C}, torch::kFloat64);
    const auto offsets = document_offsets(c.B, c.T);
    const auto want = run(c, x, w, b, offsets, dy, torch::kCPU, torch::kFloat64);
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(name(dt));
      // bf16 rounds the inputs: compare against the reference on the same rounded inputs.
      const auto xr = x.to(dt).to(torch::kFloat64), dyr = dy.to(dt).to(torch::kFloat64);
      const auto ref = dt == torch::kFloat32 ? want : run(c, xr, w, b, offsets, dyr, torch::kCPU, torch::kFloat64);
      const auto got = run(c, x, w, b, offsets, dy, torch::kCUDA, dt);
      const double tol = tolerance(dt);
      EXPECT_LT(rel_err(got.y, ref.y), tol);
      EXPECT_LT(rel_err(got.dx, ref.dx), tol);
      EXPECT_LT(rel_err(got.dw, ref.dw), tol);
      if (c.bias) {
        EXPECT_LT(rel_err(got.db, ref.db), tol);
      }
    }
  }
}

TEST(ShortConvGpu, PrefillInPiecesThroughTheWindowEqualsOneCall) {
  REQUIRE_CONV_KERNEL();
  torch::NoGradGuard no_grad;
  torch::manual_seed(8);
  for (int64_t W : {4, 2, 7}) {
    SCOPED_TRACE(cat("W", W));
    const int64_t B = 2, T = 90, C = 56;
    auto x = torch::randn({B, T, C}, gpu(torch::kFloat32));
    auto w = torch::randn({C, 1, W}, gpu(torch::kFloat32)) * 0.5;
    auto b = torch::randn({C}, gpu(torch::kFloat32)) * 0.1;
    auto whole_window = torch::zeros({B, W - 1, C}, gpu(torch::kFloat32));
    const auto whole = ops::short_conv(x, w, b, true, &whole_window);
    // Pieces shorter and longer than the window, one of a single token.
    auto window = torch::zeros({B, W - 1, C}, gpu(torch::kFloat32));
    std::vector<Tensor> parts;
    for (auto [begin, len] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {3, 40}, {43, 47}})
      parts.push_back(ops::short_conv(x.narrow(1, begin, len), w, b, true, &window));
    EXPECT_LT(rel_err(torch::cat(parts, 1), whole), 1e-6);
    EXPECT_LT(rel_err(window, whole_window), 1e-7);
    EXPECT_LT(rel_err(window, x.narrow(1, T - (W - 1), W - 1)), 1e-7);
    // The reference path (switch off) agrees.
    DecodeOptions off;
    off.short_conv = false;
    DecodeOptionsGuard guard(off);
    auto ref_window = torch::zeros({B, W - 1, C}, gpu(torch::kFloat32));
    EXPECT_LT(rel_err(ops::short_conv(x, w, b, true, &ref_window), whole), 1e-5);
  }
}

TEST(ShortConvGpu, InferenceReadsSlicesAndModelDtypeWeightsInPlace) {
  REQUIRE_CONV_KERNEL();
  torch::NoGradGuard no_grad;
  torch::manual_seed(9);
  // x a column slice of a packed projection [B, T, 3C] (as GDN's q, k and v are at inference), the
  // weight in the model's dtype, through the window as prefill runs it; float64 on the CPU is the
  // reference, on the same rounded inputs.
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t B : {1, 3}) {
      SCOPED_TRACE(cat(name(dt), " B", B));
      const int64_t T = 45, C = 40, W = 4;
      const auto packed = torch::randn({B, T, 3 * C}, gpu(dt));
      const auto x = packed.narrow(2, C, C);
      const auto w = (torch::randn({C, 1, W}, gpu(torch::kFloat32)) * 0.5).to(dt);
      const auto past = torch::randn({B, W - 1, C}, gpu(dt));
      auto window = past.clone();
      const auto y = ops::short_conv(x, w, Tensor(), true, &window);
      auto ref_window = past.to(torch::kCPU, torch::kFloat64);
      const auto want = ops::short_conv(x.to(torch::kCPU, torch::kFloat64), w.to(torch::kCPU, torch::kFloat64), Tensor(),
                                        true, &ref_window);
      EXPECT_LT(rel_err(y.cpu(), want), tolerance(dt));
      EXPECT_LT(rel_err(window.cpu(), ref_window), 1e-7);
    }
  }
}

TEST(ShortConvGpu, TrainingReadsSlicesInPlace) {
  REQUIRE_CONV_KERNEL();
  torch::manual_seed(10);
  // x a column slice of a packed projection [B, T, N] under autograd (GDN's q, k and v in training):
  // output, the projection's gradient (zero outside the slice), dweight and dbias against float64 on
  // the CPU, on the same rounded inputs; with and without packed documents.
  const int64_t B = 2, T = 70, C = 48, W = 4, N = 3 * C + 8;
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    for (bool documents : {false, true}) {
      SCOPED_TRACE(cat(name(dt), documents ? " documents" : ""));
      const auto r = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
      const auto packed = r(torch::randn({B, T, N}, torch::kFloat64));
      const auto w = torch::randn({C, 1, W}, torch::kFloat64) * 0.5;
      const auto b = torch::randn({C}, torch::kFloat64) * 0.1;
      const auto dy = r(torch::randn({B, T, C}, torch::kFloat64));
      const auto offsets = document_offsets(B, T);
      auto run = [&](torch::Device device, torch::ScalarType t) {
        const auto wt = t == torch::kFloat64 ? t : torch::kFloat32;
        auto pd = packed.to(device, t).detach().requires_grad_(true);
        auto wd = w.to(device, wt).detach().requires_grad_(true);
        auto bd = b.to(device, wt).detach().requires_grad_(true);
        auto y = ops::short_conv(pd.narrow(2, C, C), wd, bd, true, nullptr, documents ? offsets.to(device) : Tensor());
        y.backward(dy.to(device, y.scalar_type()));
        return std::vector<Tensor>{y.detach().cpu(), pd.grad().cpu(), wd.grad().cpu(), bd.grad().cpu()};
      };
      const auto want = run(torch::kCPU, torch::kFloat64), got = run(torch::kCUDA, dt);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tolerance(dt)) << "output " << i;
      EXPECT_EQ(got[1].narrow(2, 0, C).abs().max().item<double>(), 0.0);
      EXPECT_EQ(got[1].narrow(2, 2 * C, N - 2 * C).abs().max().item<double>(), 0.0);
    }
  }
}
