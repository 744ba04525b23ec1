#include "lt2/nn/linear.h"

#include <algorithm>
#include <cmath>

#include "lt2/util/error.h"

namespace lt2 {

void trunc_normal_(Tensor w, double std) {
  torch::NoGradGuard ng;
  // Re-draw by inverse CDF on [-3, 3] std, like torch.nn.init.trunc_normal_.
  auto lo = 0.5 * (1.0 + std::erf(-3.0 / std::sqrt(2.0)));
  auto hi = 0.5 * (1.0 + std::erf(3.0 / std::sqrt(2.0)));
  w.uniform_(2 * lo - 1, 2 * hi - 1);
  w.erfinv_();
  w.mul_(std * std::sqrt(2.0));
  w.clamp_(-3 * std, 3 * std);
}

torch::nn::Linear make_linear(int64_t in, int64_t out, double std, bool bias) {
  torch::nn::Linear lin(torch::nn::LinearOptions(in, out).bias(bias));
  if (std > 0) trunc_normal_(lin->weight, std);
  else lin->weight.data().zero_();
  if (bias) lin->bias.data().zero_();
  return lin;
}

namespace {
// Rows to add after `rows` for a multiple of `multiple`.
int64_t padding_rows(int64_t rows, int64_t multiple) { return (multiple - rows % multiple) % multiple; }
}  // namespace

Tensor cat_weights(const std::vector<torch::nn::Linear>& layers, int64_t rows_multiple) {
  std::vector<Tensor> weights;
  int64_t rows = 0;
  for (const auto& l : layers) {
    weights.push_back(l->weight);
    rows += l->weight.size(0);
  }
  if (const int64_t padding = padding_rows(rows, rows_multiple); padding > 0)
    weights.push_back(torch::zeros({padding, weights.front().size(1)}, weights.front().options()));
  return torch::cat(weights, 0);
}

Tensor cat_biases(const std::vector<torch::nn::Linear>& layers, int64_t rows_multiple) {
  const auto with_bias = std::find_if(layers.begin(), layers.end(), [](const auto& l) { return l->bias.defined(); });
  if (with_bias == layers.end()) return Tensor();
  std::vector<Tensor> biases;
  int64_t rows = 0;
  for (const auto& l : layers) {
    const int64_t n = l->weight.size(0);
    biases.push_back(l->bias.defined() ? l->bias : torch::zeros({n}, (*with_bias)->bias.options()));
    rows += n;
  }
  if (const int64_t padding = padding_rows(rows, rows_multiple); padding > 0)
    biases.push_back(torch::zeros({padding}, (*with_bias)->bias.options()));
  return torch::cat(biases, 0);
}

Tensor pack_linears(const std::vector<torch::nn::Linear>& layers) {
  for (const auto& l : layers) LT2_CHECK(!l->bias.defined(), "pack_linears: only bias-free layers are packed");
  torch::NoGradGuard ng;
  auto packed = cat_weights(layers);
  int64_t row = 0;
  for (const auto& l : layers) {
    const int64_t n = l->weight.size(0);
    l->weight.set_data(packed.narrow(0, row, n));
    row += n;
  }
  return packed;
}

std::vector<Tensor> unpack_outputs(const Tensor& y, const std::vector<torch::nn::Linear>& layers) {
  std::vector<int64_t> widths;
  for (const auto& l : layers) widths.push_back(l->weight.size(0));
  return split_columns(y, widths);
}

std::vector<Tensor> split_columns(const Tensor& y, std::vector<int64_t> widths) {
  int64_t columns = 0;
  for (const int64_t w : widths) columns += w;
  const int64_t padding = y.size(-1) - columns;
  LT2_CHECK(padding >= 0, "split_columns: the blocks are ", columns, " columns, y has ", y.size(-1));
  if (padding > 0) widths.push_back(padding);
  auto parts = torch::split_with_sizes(y, widths, -1);
  if (padding > 0) parts.pop_back();
  return parts;
}

}  // namespace lt2
