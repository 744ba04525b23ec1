#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/gated_linear/gated_linear.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

#ifdef LT2_WITH_CUDA
// The kernels' view of x [B, T, C] (columns packed, rows token_stride apart) and the outputs' dtypes.
kernels::LogSigmoidGatesParams gates_params(const Tensor& x, double normalizer,
                                            std::optional<torch::ScalarType> complement_dtype) {
  kernels::LogSigmoidGatesParams p{};
  p.x = x.data_ptr(), p.x_row_stride = detail::token_stride(x);
  p.rows = x.size(0) * x.size(1), p.cols = static_cast<int>(x.size(2));
  p.normalizer = static_cast<float>(normalizer);
  p.x_dtype = detail::kernel_dtype(x.scalar_type());
  p.k_dtype = detail::kernel_dtype(complement_dtype.value_or(torch::kFloat32));
  return p;
}

LogSigmoidGates gates_cuda(const Tensor& x, double normalizer, std::optional<torch::ScalarType> complement_dtype) {
  c10::cuda::CUDAGuard guard(x.device());
  LogSigmoidGates out;
  out.g = torch::empty(x.sizes(), x.options().dtype(torch::kFloat32));
  if (complement_dtype) out.complement = torch::empty(x.sizes(), x.options().dtype(*complement_dtype));
  auto p = gates_params(x, normalizer, complement_dtype);
  p.g = out.g.data_ptr<float>(), p.k = complement_dtype ? out.complement.data_ptr() : nullptr;
  kernels::log_sigmoid_gates(p, detail::current_stream(x));
  return out;
}

// Autograd over the two kernels: x is saved (the backward recomputes the activations); g's and k's
// gradients may each be absent.
struct LogSigmoidGatesFunction : public torch::autograd::Function<LogSigmoidGatesFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                double normalizer, std::optional<torch::ScalarType> complement_dtype) {
    auto out = gates_cuda(x, normalizer, complement_dtype);
    ctx->save_for_backward({x});
    ctx->saved_data["normalizer"] = normalizer;
    ctx->saved_data["complement_dtype"] = complement_dtype ? static_cast<int64_t>(*complement_dtype) : int64_t{-1};
    if (!complement_dtype) return {out.g};
    return {out.g, out.complement};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor x = ctx->get_saved_variables()[0];
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t k_dtype = ctx->saved_data["complement_dtype"].toInt();
    const auto complement_dtype =
        k_dtype >= 0 ? std::optional<torch::ScalarType>(static_cast<torch::ScalarType>(k_dtype)) : std::nullopt;
    const auto dg = grads[0].defined() ? grads[0].to(torch::kFloat32).contiguous() : Tensor();
    const auto dk = complement_dtype && grads[1].defined() ? grads[1].to(*complement_dtype).contiguous() : Tensor();
    auto dx = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
    kernels::LogSigmoidGatesBackwardParams bp{};
    bp.forward = gates_params(x, ctx->saved_data["normalizer"].toDouble(), complement_dtype);
    bp.dg = dg.defined() ? dg.data_ptr<float>() : nullptr;
    bp.dk = dk.defined() ? dk.data_ptr() : nullptr;
    bp.dx = dx.data_ptr();
    kernels::log_sigmoid_gates_backward(bp, detail::current_stream(x));
    return {dx, Tensor(), Tensor()};
  }
};

// x [B, T, H, P] as the kernels read it: a token's H P values packed, tokens a uniform stride apart
// (detail::token_stride of x as [B, T, H P]). The stride, or 0 where x is not so laid out.
int64_t scale_heads_token_stride(const Tensor& x) {
  if (x.stride(3) != 1 || x.stride(2) != x.size(3)) return 0;
  return detail::token_stride(x.view({x.size(0), x.size(1), x.size(2) * x.size(3)}));
}

kernels::ScaleHeadsParams scale_heads_params(const Tensor& x, const Tensor& s) {
  kernels::ScaleHeadsParams p{};
  p.x = x.data_ptr(), p.s = s.data_ptr<float>();
  p.rows = x.size(0) * x.size(1), p.x_row_stride = scale_heads_token_stride(x);
  p.heads = static_cast<int>(x.size(2)), p.head_dim = static_cast<int>(x.size(3));
  p.dtype = detail::kernel_dtype(x.scalar_type());
  return p;
}

Tensor scale_heads_cuda(const Tensor& x, const Tensor& s) {
  c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  auto p = scale_heads_params(x, s);
  p.y = y.data_ptr();
  kernels::scale_heads(p, detail::current_stream(x));
  return y;
}

// Autograd over the two kernels: x (a view, in place) and s (packed fp32) are saved.
struct ScaleHeadsFunction : public torch::autograd::Function<ScaleHeadsFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& s) {
    ctx->save_for_backward({x, s});
    return scale_heads_cuda(x, s);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &s = saved[1];
    c10::cuda::CUDAGuard guard(x.device());
    const auto dy = grads[0].to(x.scalar_type()).contiguous();
    auto dx = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
    auto ds = torch::empty(s.sizes(), s.options());
    kernels::ScaleHeadsBackwardParams bp{};
    bp.forward = scale_heads_params(x, s);
    bp.dy = dy.data_ptr(), bp.dx = dx.data_ptr(), bp.ds = ds.data_ptr<float>();
    kernels::scale_heads_backward(bp, detail::current_stream(x));
    return {dx, ds};
  }
};
#endif

}  // namespace

Tensor scale_heads(const Tensor& x, const Tensor& s) {
  LT2_CHECK(x.dim() == 4 && s.dim() == 3 && s.sizes() == x.sizes().slice(0, 3), "scale_heads: x must be [B, T, H, P] ",
            "and s [B, T, H], found ", x.sizes(), " and ", s.sizes());
#ifdef LT2_WITH_CUDA
  if (decode_options().scale_heads && x.is_cuda() && s.device() == x.device() && s.scalar_type() == torch::kFloat32 &&
      detail::kernel_dtype_ok(x.scalar_type()) && x.numel() > 0 && x.size(2) * x.size(3) <= INT32_MAX &&
      scale_heads_token_stride(x) > 0) {
    const auto packed_s = s.contiguous();
    if (!torch::GradMode::is_enabled() || !(x.requires_grad() || s.requires_grad()))
      return scale_heads_cuda(x, packed_s);
    return ScaleHeadsFunction::apply(x, packed_s);
  }
#endif
  return (x * s.unsqueeze(-1)).to(x.scalar_type());
}

LogSigmoidGates log_sigmoid_gates(const Tensor& x, double normalizer, torch::ScalarType dt,
                                  std::optional<torch::ScalarType> complement_dtype) {
  LT2_CHECK(x.dim() == 3, "log_sigmoid_gates: x must be [B, T, C], found ", x.sizes());
  LT2_CHECK(normalizer > 0, "log_sigmoid_gates: the normalizer must be > 0, found ", normalizer);
#ifdef LT2_WITH_CUDA
  if (decode_options().log_sigmoid_gate && x.is_cuda() && dt == torch::kFloat32 &&
      detail::kernel_dtype_ok(x.scalar_type()) && (!complement_dtype || detail::kernel_dtype_ok(*complement_dtype)) &&
      x.numel() > 0 && x.size(2) <= INT32_MAX && detail::token_stride(x) > 0) {
    const bool grad = torch::GradMode::is_enabled() && x.requires_grad();
    if (!grad) return gates_cuda(x, normalizer, complement_dtype);
    const auto out = LogSigmoidGatesFunction::apply(x, normalizer, complement_dtype);
    return {out[0], complement_dtype ? out[1] : Tensor()};
  }
#endif
  LogSigmoidGates out;
  out.g = torch::log_sigmoid(x.to(dt));
  if (normalizer != 1.0) out.g = out.g / normalizer;
  if (complement_dtype) out.complement = (-torch::expm1(out.g)).to(*complement_dtype);
  return out;
}

}  // namespace lt2::ops
