#include "lt2/ops/conv/short_conv.h"

#include "lt2/util/error.h"

namespace lt2::ops {

namespace {

// The convolution over packed documents: each tap masked where it would reach into the document
// before (a sum over the W taps, differentiable through autograd).
Tensor masked_taps(const Tensor& xp, const Tensor& weight, const Tensor& bias, const Tensor& offsets) {
  const int64_t T = offsets.size(1), W = weight.size(2);
  const auto dist = offsets.to(xp.device()).unsqueeze(-1);  // [B, T, 1]
  const auto w = weight.to(xp.scalar_type()).select(1, 0);  // [C, W]
  Tensor y = bias.defined() ? bias.to(xp.scalar_type()).expand({xp.size(0), T, xp.size(2)}) : Tensor();
  for (int64_t i = 0; i < W; ++i) {  // tap i reads x_{t - (W - 1 - i)}
    const auto term = xp.narrow(1, i, T) * w.select(1, i) * (dist >= W - 1 - i).to(xp.scalar_type());
    y = y.defined() ? y + term : term;
  }
  return y;
}

}  // namespace

Tensor short_conv(const Tensor& x, const Tensor& weight, const Tensor& bias, bool silu,
                  Tensor* window, const Tensor& offsets) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), W = weight.size(2);
  LT2_CHECK(weight.dim() == 3 && weight.size(0) == C && weight.size(1) == 1,
            "short conv: weight must be [C, 1, W] with C = ", C, ", found ", weight.sizes());
  Tensor past;  // [B, W-1, C]
  if (window) {
    LT2_CHECK(window->sizes() == torch::IntArrayRef({B, W - 1, C}),
              "short conv: window must be [B, W-1, C] = [", B, ", ", W - 1, ", ", C, "], found ",
              window->sizes());
    past = window->to(x.scalar_type());
  } else {
    past = torch::zeros({B, W - 1, C}, x.options());
  }
  auto xp = torch::cat({past, x}, 1);                                 // [B, T+W-1, C]
  if (offsets.defined()) {
    LT2_CHECK(!window, "short conv: packed documents (offsets) run without a window");
    LT2_CHECK(offsets.sizes() == torch::IntArrayRef({B, T}), "short conv: offsets must be [B, T] = [", B, ", ", T,
              "], found ", offsets.sizes());
    const auto y = masked_taps(xp, weight, bias, offsets);
    return silu ? torch::silu(y) : y;
  }
  auto y = torch::conv1d(xp.transpose(1, 2), weight.to(x.scalar_type()),
                         bias.defined() ? bias.to(x.scalar_type()) : bias,
                         /*stride=*/torch::IntArrayRef{1}, /*padding=*/torch::IntArrayRef{0},
                         /*dilation=*/torch::IntArrayRef{1}, /*groups=*/C)
               .transpose(1, 2);                                      // [B, T, C]
  if (window) window->copy_(xp.narrow(1, T, W - 1).detach());
  return silu ? torch::silu(y) : y;
}

}  // namespace lt2::ops
