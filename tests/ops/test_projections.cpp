// ops::linear_group: one GEMM for layers that read the same input, equal to a GEMM per layer in
// its outputs and in every gradient, with the grouped output's rows padded to whole 8 columns; and
// ops::linear_split, one layer's output split into column blocks the same way.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "lt2/nn/linear.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/util/error.h"

using namespace lt2;

namespace {

std::vector<torch::nn::Linear> float64_layers(const std::vector<int64_t>& outs, int64_t in) {
  std::vector<torch::nn::Linear> layers;
  for (int64_t out : outs) {
    layers.push_back(make_linear(in, out, 0.5));
    layers.back()->to(torch::kFloat64);
  }
  return layers;
}

}  // namespace

TEST(LinearGroup, EqualsALinearPerLayerWithGradients) {
  torch::manual_seed(3);
  for (const auto& outs : {std::vector<int64_t>{5, 7, 3}, std::vector<int64_t>{8, 8}}) {
    const int64_t in = 6;  // 15 columns (padded to 16) and 16
    auto layers = float64_layers(outs, in);
    const auto x = torch::randn({2, 3, in}, torch::kFloat64).requires_grad_();
    const auto parts = ops::linear_group(x, layers, Tensor());
    ASSERT_EQ(parts.size(), outs.size());
    // The parts are column blocks of one output whose rows are padded to a multiple of 8.
    EXPECT_EQ(parts[0].stride(1), 16);
    std::vector<Tensor> upstream;
    Tensor loss = torch::zeros({}, torch::kFloat64);
    for (size_t i = 0; i < parts.size(); ++i) {
      upstream.push_back(torch::randn_like(parts[i]));
      loss = loss + (parts[i] * upstream[i]).sum();
    }
    loss.backward();
    const auto x_grad = x.grad().clone();
    std::vector<Tensor> weight_grads;
    for (auto& l : layers) weight_grads.push_back(l->weight.grad().clone()), l->weight.mutable_grad().reset();
    x.mutable_grad().reset();
    Tensor reference_loss = torch::zeros({}, torch::kFloat64);
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto y = layers[i](x);
      EXPECT_TRUE(torch::allclose(parts[i], y, 1e-12, 1e-12)) << "part " << i;
      reference_loss = reference_loss + (y * upstream[i]).sum();
    }
    reference_loss.backward();
    EXPECT_TRUE(torch::allclose(x_grad, x.grad(), 1e-12, 1e-12));
    for (size_t i = 0; i < layers.size(); ++i)
      EXPECT_TRUE(torch::allclose(weight_grads[i], layers[i]->weight.grad(), 1e-12, 1e-12)) << "weight " << i;
  }
}

// Without a gradient: a few rows (a decode step) run one linear each, more rows one GEMM; both equal
// a linear per layer.
TEST(LinearGroup, FewRowsWithoutGradientRunALinearEach) {
  torch::manual_seed(4);
  auto layers = float64_layers({5, 7, 3}, 6);
  torch::NoGradGuard no_grad;
  for (int64_t rows : {int64_t{1}, ops::kLinearGroupFewRows, ops::kLinearGroupFewRows + 1}) {
    const auto x = torch::randn({rows, 1, 6}, torch::kFloat64);
    const auto parts = ops::linear_group(x, layers, Tensor());
    ASSERT_EQ(parts.size(), layers.size());
    const bool grouped = rows > ops::kLinearGroupFewRows;
    EXPECT_EQ(parts[0].stride(1), grouped ? 16 : 5) << rows << " rows";
    for (size_t i = 0; i < layers.size(); ++i)
      EXPECT_TRUE(torch::allclose(parts[i], layers[i](x), 1e-12, 1e-12)) << rows << " rows, part " << i;
  }
}

// Layers with biases among them: the group adds their biases (zeros for the others), and each
// bias gets its layer's gradient; packing for inference takes bias-free layers only.
TEST(LinearGroup, AddsTheBiasesOfTheLayersThatHaveOne) {
  torch::manual_seed(5);
  auto layers = float64_layers({5, 3}, 6);
  layers.push_back(make_linear(6, 4, 0.5, /*bias=*/true));
  layers.back()->to(torch::kFloat64);
  torch::NoGradGuard ng;
  layers.back()->bias.normal_();
  torch::AutoGradMode grad(true);
  const auto x = torch::randn({3, 4, 6}, torch::kFloat64);
  const auto parts = ops::linear_group(x, layers, Tensor());
  Tensor loss = torch::zeros({}, torch::kFloat64);
  for (size_t i = 0; i < layers.size(); ++i) {
    EXPECT_TRUE(torch::allclose(parts[i], layers[i](x), 1e-12, 1e-12)) << "part " << i;
    loss = loss + parts[i].sum();
  }
  loss.backward();
  EXPECT_TRUE(torch::allclose(layers.back()->bias.grad(), torch::full({4}, 12.0, torch::kFloat64)));
  EXPECT_THROW(pack_linears(layers), Error);
}

// One layer's output split into blocks: the blocks are column slices of a padded output (rows of 16 for
// 5 + 7 + 3 columns) under autograd and for many rows, of the layer's own output at a decode step; the
// values and every gradient (x, weight, bias) equal the layer's output split.
TEST(LinearSplit, EqualsTheLayersOutputSplitWithGradients) {
  torch::manual_seed(6);
  auto layer = make_linear(6, 15, 0.5, /*bias=*/true);
  layer->to(torch::kFloat64);
  {
    torch::NoGradGuard ng;
    layer->bias.normal_();
  }
  const std::vector<int64_t> widths{5, 7, 3};
  const auto x = torch::randn({2, 3, 6}, torch::kFloat64).requires_grad_();
  const auto parts = ops::linear_split(x, layer, widths);
  ASSERT_EQ(parts.size(), widths.size());
  EXPECT_EQ(parts[0].stride(1), 16);
  Tensor loss = torch::zeros({}, torch::kFloat64);
  std::vector<Tensor> upstream;
  for (const auto& part : parts) {
    upstream.push_back(torch::randn_like(part));
    loss = loss + (part * upstream.back()).sum();
  }
  loss.backward();
  const auto x_grad = x.grad().clone(), w_grad = layer->weight.grad().clone(), b_grad = layer->bias.grad().clone();
  x.mutable_grad().reset(), layer->weight.mutable_grad().reset(), layer->bias.mutable_grad().reset();
  const auto want = layer(x).split_with_sizes(widths, -1);
  Tensor reference_loss = torch::zeros({}, torch::kFloat64);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(parts[i], want[i], 1e-12, 1e-12)) << "block " << i;
    reference_loss = reference_loss + (want[i] * upstream[i]).sum();
  }
  reference_loss.backward();
  EXPECT_TRUE(torch::allclose(x_grad, x.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(w_grad, layer->weight.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(b_grad, layer->bias.grad(), 1e-12, 1e-12));
  torch::NoGradGuard ng;
  for (int64_t rows : {int64_t{1}, ops::kLinearGroupFewRows + 1}) {
    const auto xs = torch::randn({rows, 1, 6}, torch::kFloat64);
    const auto blocks = ops::linear_split(xs, layer, widths);
    EXPECT_EQ(blocks[0].stride(1), rows > ops::kLinearGroupFewRows ? 16 : 15) << rows << " rows";
    const auto expected = layer(xs).split_with_sizes(widths, -1);
    for (size_t i = 0; i < widths.size(); ++i)
      EXPECT_TRUE(torch::allclose(blocks[i], expected[i], 1e-12, 1e-12)) << rows << " rows, block " << i;
  }
  EXPECT_THROW(split_columns(torch::zeros({2, 14}), widths), Error);
}

// The split's backward (columns_gradient): where a block's gradient is its columns of a buffer shaped like
// the split tensor, that buffer is the gradient (the other blocks copied in, an absent gradient and the
// padding zeros); else one new tensor; through autograd, a hook handing block 0's gradient over as such a
// view gives the same gradient as the plain one.
TEST(SplitColumns, GradientTakesTheBufferItsBlocksShare) {
  torch::manual_seed(7);
  const std::vector<int64_t> widths{4, 6, 2}, sizes{2, 3, 14};  // 2 padding columns
  const auto buffer = torch::randn(sizes, torch::kFloat64);
  const auto q_part = buffer.narrow(-1, 0, 4).clone(), v_grad = torch::randn({2, 3, 6}, torch::kFloat64);
  auto expected = torch::cat({q_part, v_grad, torch::zeros({2, 3, 4}, torch::kFloat64)}, -1);
  const auto shared = columns_gradient({buffer.narrow(-1, 0, 4), v_grad, Tensor()}, sizes, widths);
  EXPECT_EQ(shared.data_ptr(), buffer.data_ptr());
  EXPECT_TRUE(torch::equal(shared, expected));
  // The same gradients apart: a new tensor with the same values.
  const auto apart = columns_gradient({q_part, v_grad, Tensor()}, sizes, widths);
  EXPECT_NE(apart.data_ptr(), buffer.data_ptr());
  EXPECT_TRUE(torch::equal(apart, expected));
  // A block's columns of a buffer at the wrong columns are copied, not taken.
  const auto other = torch::randn(sizes, torch::kFloat64);
  const auto moved = columns_gradient({Tensor(), other.narrow(-1, 0, 6), Tensor()}, sizes, widths);
  EXPECT_NE(moved.data_ptr(), other.data_ptr());
  EXPECT_TRUE(torch::equal(moved.narrow(-1, 4, 6), other.narrow(-1, 0, 6)));
  EXPECT_TRUE(torch::equal(moved.narrow(-1, 0, 4), torch::zeros({2, 3, 4}, torch::kFloat64)));
  EXPECT_FALSE(columns_gradient({Tensor(), Tensor(), Tensor()}, sizes, widths).defined());
  EXPECT_THROW(columns_gradient({v_grad}, sizes, widths), Error);

  const auto y = torch::randn(sizes, torch::kFloat64).requires_grad_();
  std::vector<Tensor> upstream;
  for (const int64_t w : widths) upstream.push_back(torch::randn({2, 3, w}, torch::kFloat64));
  auto backward = [&](bool as_view) {
    const auto blocks = split_columns(y * 1.0, widths);
    if (as_view)
      blocks[0].register_hook([&](const Tensor& g) {
        auto whole = torch::full(sizes, 7.0, torch::kFloat64);  // the other columns overwritten
        whole.narrow(-1, 0, 4).copy_(g);
        return whole.narrow(-1, 0, 4);
      });
    Tensor loss = torch::zeros({}, torch::kFloat64);
    for (size_t i = 0; i < blocks.size(); ++i) loss = loss + (blocks[i] * upstream[i]).sum();
    y.mutable_grad().reset();
    loss.backward();
    return y.grad().clone();
  };
  const auto plain = backward(false);
  const auto padding = torch::zeros({2, 3, 2}, torch::kFloat64);
  EXPECT_TRUE(torch::equal(plain, torch::cat({upstream[0], upstream[1], upstream[2], padding}, -1)));
  EXPECT_TRUE(torch::equal(backward(true), plain));
}
