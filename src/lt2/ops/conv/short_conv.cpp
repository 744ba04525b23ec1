#include "lt2/ops/conv/short_conv.h"

#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

#ifdef LT2_WITH_CUDA
// The kernels' view of a call: x [B, T, C] in a kernel dtype with a token stride (detail::token_stride),
// weight [C, W] packed in fp32 or x's dtype, bias fp32 [C] or undefined, offsets int64 [B, T] or
// undefined, past [B, W-1, C] in x's dtype or undefined.
kernels::ShortConvParams conv_params(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& offsets,
                                     const Tensor& past, bool silu) {
  kernels::ShortConvParams p{};
  p.x = x.data_ptr();
  p.x_token_stride = x.stride(1);
  p.past = past.defined() ? past.data_ptr() : nullptr;
  p.weight = weight.data_ptr();
  p.weight_dtype = detail::kernel_dtype(weight.scalar_type());
  p.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  p.offsets = offsets.defined() ? offsets.data_ptr<int64_t>() : nullptr;
  p.batch = static_cast<int>(x.size(0)), p.seq = static_cast<int>(x.size(1));
  p.channels = static_cast<int>(x.size(2)), p.width = static_cast<int>(weight.size(1));
  p.silu = silu;
  p.dtype = detail::kernel_dtype(x.scalar_type());
  return p;
}

Tensor conv_forward_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& offsets,
                         const Tensor& past, bool silu) {
  c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty(x.sizes(), x.options());  // packed, whatever x's strides
  auto p = conv_params(x, weight, bias, offsets, past, silu);
  p.y = y.data_ptr();
  kernels::short_conv_forward(p, detail::current_stream(x));
  return y;
}

// Autograd over the kernels: x, weight (fp32 [C, W]) and bias (fp32 [C], or empty) get gradients;
// pre is recomputed in the backward rather than stored. Function::apply takes no undefined
// tensors: an absent bias or offsets travels as an empty tensor.
struct ShortConvFunction : public torch::autograd::Function<ShortConvFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, const Tensor& offsets, bool silu) {
    const auto b = bias.numel() > 0 ? bias : Tensor(), o = offsets.numel() > 0 ? offsets : Tensor();
    ctx->save_for_backward({x, weight, bias, offsets});
    ctx->saved_data["silu"] = silu;
    return conv_forward_cuda(x, weight, b, o, Tensor(), silu);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1];
    const Tensor bias = saved[2].numel() > 0 ? saved[2] : Tensor(), offsets = saved[3].numel() > 0 ? saved[3] : Tensor();
    c10::cuda::CUDAGuard guard(x.device());
    const auto dy = grads[0].to(x.scalar_type()).contiguous();
    auto dx = torch::empty(x.sizes(), x.options());  // packed, whatever x's strides
    auto dweight = torch::zeros_like(weight);
    auto dbias = bias.defined() ? torch::zeros_like(bias) : Tensor();
    kernels::ShortConvBackwardParams p{};
    p.forward = conv_params(x, weight, bias, offsets, Tensor(), ctx->saved_data["silu"].toBool());
    p.dy = dy.data_ptr();
    p.dx = dx.data_ptr();
    p.dweight = dweight.data_ptr<float>();
    p.dbias = dbias.defined() ? dbias.data_ptr<float>() : nullptr;
    kernels::short_conv_backward(p, detail::current_stream(x));
    return {dx, dweight, dbias.defined() ? dbias : Tensor(), Tensor(), Tensor()};
  }
};

// Whether the CUDA kernels take this call: on, CUDA, a kernel dtype, W within the kernels' bound and
// sizes within their int32 indices. (A gradient through a window of past inputs they do not give.)
bool conv_kernel_applies(const Tensor& x, const Tensor& weight) {
  return decode_options().short_conv && x.is_cuda() && detail::kernel_dtype_ok(x.scalar_type()) &&
         weight.size(2) <= kernels::kMaxConvWidth && x.size(0) <= 65535 && x.size(1) <= INT32_MAX &&
         x.size(2) <= INT32_MAX;
}
#endif

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
  if (window)
    LT2_CHECK(window->sizes() == torch::IntArrayRef({B, W - 1, C}),
              "short conv: window must be [B, W-1, C] = [", B, ", ", W - 1, ", ", C, "], found ",
              window->sizes());
  // The W-1 inputs before the call: the window's, or zeros for a fresh sequence.
  const auto past = window ? window->to(x.scalar_type()) : Tensor();
  if (offsets.defined()) {
    LT2_CHECK(!window, "short conv: packed documents (offsets) run without a window");
    LT2_CHECK(offsets.sizes() == torch::IntArrayRef({B, T}), "short conv: offsets must be [B, T] = [", B, ", ", T,
              "], found ", offsets.sizes());
  }
#ifdef LT2_WITH_CUDA
  const bool grad = torch::GradMode::is_enabled() &&
                    (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()) ||
                     (window && window->requires_grad()));
  if (conv_kernel_applies(x, weight) && !(grad && window)) {
    // x is read in place where its tokens are evenly strided (a column slice of a packed projection,
    // also saved so for the backward); without gradients the weight is read in x's dtype: no copy or
    // conversion pass.
    const auto xc = detail::token_stride(x) ? x : x.contiguous();
    const bool weight_as_is = !grad && weight.scalar_type() == x.scalar_type();
    const auto w = (weight_as_is ? weight : weight.to(torch::kFloat32)).reshape({C, W}).contiguous();
    const auto b = bias.defined() ? bias.to(torch::kFloat32).contiguous() : Tensor();
    const auto o = offsets.defined() ? offsets.to(x.device(), torch::kLong).contiguous() : Tensor();
    Tensor y;
    if (window) {
      const auto pastc = past.contiguous();
      y = conv_forward_cuda(xc, w, b, o, pastc, silu);
      // The last W-1 inputs (older first), from the past where the call is shorter than that.
      window->copy_(T >= W - 1 ? xc.narrow(1, T - (W - 1), W - 1) : torch::cat({pastc.narrow(1, T, W - 1 - T), xc}, 1));
    } else if (grad) {
      y = ShortConvFunction::apply(xc, w, b.defined() ? b : torch::empty({0}, w.options()),
                                   o.defined() ? o : torch::empty({0}, x.options().dtype(torch::kLong)), silu);
    } else {
      y = conv_forward_cuda(xc, w, b, o, Tensor(), silu);
    }
    return y;
  }
#endif
  auto xp = torch::cat({window ? past : torch::zeros({B, W - 1, C}, x.options()), x}, 1);  // [B, T+W-1, C]
  if (offsets.defined()) {
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
