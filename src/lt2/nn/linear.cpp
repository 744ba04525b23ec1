#include "lt2/nn/linear.h"

#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

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

namespace {

// The first column of each of `widths`' blocks.
std::vector<int64_t> column_offsets(const std::vector<int64_t>& widths) {
  std::vector<int64_t> at(widths.size());
  int64_t column = 0;
  for (size_t i = 0; i < widths.size(); ++i) at[i] = column, column += widths[i];
  return at;
}

// The blocks as views of y under autograd, one node whose backward is columns_gradient.
struct SplitColumnsFunction : public torch::autograd::Function<SplitColumnsFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& y,
                                                const std::vector<int64_t>& widths) {
    ctx->set_materialize_grads(false);  // an unused block's gradient stays undefined, not zeros
    ctx->saved_data["sizes"] = y.sizes().vec();
    ctx->saved_data["widths"] = widths;
    const auto at = column_offsets(widths);
    torch::autograd::variable_list blocks;
    for (size_t i = 0; i < widths.size(); ++i) blocks.push_back(y.narrow(-1, at[i], widths[i]));
    return blocks;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {columns_gradient(grads, ctx->saved_data["sizes"].toIntVector(), ctx->saved_data["widths"].toIntVector()),
            Tensor()};
  }
};

}  // namespace

std::vector<Tensor> split_columns(const Tensor& y, std::vector<int64_t> widths) {
  int64_t columns = 0;
  for (const int64_t w : widths) columns += w;
  const int64_t padding = y.size(-1) - columns;
  LT2_CHECK(padding >= 0, "split_columns: the blocks are ", columns, " columns, y has ", y.size(-1));
  if (torch::GradMode::is_enabled() && y.requires_grad()) return SplitColumnsFunction::apply(y, widths);
  if (padding > 0) widths.push_back(padding);
  auto parts = torch::split_with_sizes(y, widths, -1);
  if (padding > 0) parts.pop_back();
  return parts;
}

Tensor columns_gradient(const std::vector<Tensor>& grads, const std::vector<int64_t>& sizes,
                        const std::vector<int64_t>& widths) {
  LT2_CHECK(grads.size() == widths.size() && !sizes.empty(), "columns_gradient: a gradient a block, found ",
            grads.size(), " for ", widths.size(), " blocks");
  const auto at = column_offsets(widths);
  const int64_t end = widths.empty() ? 0 : at.back() + widths.back(), width = sizes.back();
  LT2_CHECK(end <= width, "columns_gradient: the blocks are ", end, " columns, y has ", width);
  const auto strides = c10::contiguous_strides(sizes);
  const Tensor* any = nullptr;
  Tensor whole;  // a y-shaped packed buffer of which a block's gradient is that block's columns
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    any = &g;
    if (whole.defined() || g.dim() != static_cast<int64_t>(sizes.size()) || g.strides() != c10::IntArrayRef(strides) ||
        g.storage_offset() < at[i])
      continue;
    const int64_t first = g.storage_offset() - at[i];
    if ((first + c10::multiply_integers(sizes)) * static_cast<int64_t>(g.element_size()) <=
        static_cast<int64_t>(g.storage().nbytes()))
      whole = g.as_strided(sizes, strides, first);
  }
  if (!any) return Tensor();
  auto zeros = [&](int64_t columns) {
    auto shape = sizes;
    shape.back() = columns;
    return torch::zeros(shape, any->options());
  };
  if (!whole.defined()) {  // split's own backward: one concatenation
    std::vector<Tensor> parts;
    for (size_t i = 0; i < grads.size(); ++i) parts.push_back(grads[i].defined() ? grads[i] : zeros(widths[i]));
    if (end < width) parts.push_back(zeros(width - end));
    return torch::cat(parts, -1);
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    auto columns = whole.narrow(-1, at[i], widths[i]);
    const Tensor& g = grads[i];
    if (!g.defined()) columns.zero_();
    else if (g.data_ptr() != columns.data_ptr() || g.strides() != columns.strides()) columns.copy_(g);
  }
  if (end < width) whole.narrow(-1, end, width - end).zero_();  // the padding columns
  return whole;
}

}  // namespace lt2
