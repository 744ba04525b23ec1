// Short causal depthwise convolution: matches a direct sum over taps, a split or token-by-token
// run through the window state matches one call over the whole input, and over packed documents
// (offsets) each document's output equals the document convolved alone.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lt2/nn/positions.h"
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

TEST(ShortConv, PackedDocumentsEqualEachAlone) {
  torch::manual_seed(2);
  const int64_t C = 3, W = 4;
  const lt2::PackedDocuments docs({{0, 1, 3, 7}, {0, 5}}, 9);  // lengths 1, 2, 4, 2 and 5, 4
  auto x = torch::randn({2, 9, C}, torch::kFloat64).requires_grad_(true);
  auto w = torch::randn({C, 1, W}, torch::kFloat64).requires_grad_(true);
  auto b = torch::randn({C}, torch::kFloat64).requires_grad_(true);
  const auto R = torch::randn({2, 9, C}, torch::kFloat64);
  const auto packed = short_conv(x, w, b, true, nullptr, docs.offsets);
  std::vector<Tensor> rows;
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<Tensor> parts;
    const auto& s = docs.starts[r];
    for (size_t d = 0; d < s.size(); ++d) {
      const int64_t end = d + 1 < s.size() ? s[d + 1] : docs.T;
      parts.push_back(short_conv(x.narrow(0, r, 1).narrow(1, s[d], end - s[d]), w, b, true));
    }
    rows.push_back(torch::cat(parts, 1));
  }
  const auto alone = torch::cat(rows, 0);
  EXPECT_LT(rel_err(packed, alone), 1e-14);
  EXPECT_GT(rel_err(short_conv(x, w, b, true), alone), 1e-3);  // the documents do interact unmasked
  const auto gp = torch::autograd::grad({(packed * R).sum()}, {x, w, b});
  const auto ga = torch::autograd::grad({(alone * R).sum()}, {x, w, b});
  for (size_t i = 0; i < gp.size(); ++i) EXPECT_LT(rel_err(gp[i], ga[i]), 1e-13) << "gradient " << i;
}

}  // namespace
