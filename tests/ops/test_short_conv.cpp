// Short causal depthwise convolution: matches a direct sum over taps, and a split or
// token-by-token run through the window state matches one call over the whole input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lt2/ops/conv/short_conv.h"
#include "ops/numeric_check.h"

namespace {

using lt2::ops::short_conv;
using lt2::testing::rel_err;
using torch::Tensor;

TEST(ShortConv, MatchesDirectSumOverTaps) {
  torch::manual_seed(0);
  const int64_t B = 2, T = 9, C = 5, W = 4;
  auto x = torch::randn({B, T, C}, torch::kFloat64);
  auto w = torch::randn({C, 1, W}, torch::kFloat64);
  auto b = torch::randn({C}, torch::kFloat64);
  auto y = short_conv(x, w, b, /*silu=*/false);
  auto ref = b.expand({B, T, C}).clone();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < W; ++i) {
      const int64_t src = t - (W - 1) + i;
      if (src >= 0) ref.select(1, t) += w.select(1, 0).select(1, i) * x.select(1, src);
    }
  EXPECT_LT(rel_err(y, ref), 1e-14);
  EXPECT_LT(rel_err(short_conv(x, w, b, true), torch::silu(ref)), 1e-14);
}

TEST(ShortConv, WindowContinuesAcrossCalls) {
  torch::manual_seed(1);
  const int64_t B = 2, T = 11, C = 3, W = 4;
  auto x = torch::randn({B, T, C}, torch::kFloat64);
  auto w = torch::randn({C, 1, W}, torch::kFloat64);
  auto whole = short_conv(x, w, Tensor(), true);
  for (int64_t a : {1, 2, 5, 10}) {
    auto window = torch::zeros({B, W - 1, C}, torch::kFloat64);
    auto y1 = short_conv(x.narrow(1, 0, a), w, Tensor(), true, &window);
    auto y2 = short_conv(x.narrow(1, a, T - a), w, Tensor(), true, &window);
    EXPECT_LT(rel_err(torch::cat({y1, y2}, 1), whole), 1e-14) << "split at " << a;
  }
  auto window = torch::zeros({B, W - 1, C}, torch::kFloat64);
  std::vector<Tensor> ys;
  for (int64_t t = 0; t < T; ++t) ys.push_back(short_conv(x.narrow(1, t, 1), w, Tensor(), true, &window));
  EXPECT_LT(rel_err(torch::cat(ys, 1), whole), 1e-14);
}

}  // namespace
