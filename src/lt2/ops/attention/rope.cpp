#include "lt2/ops/attention/rope.h"

#include "lt2/nn/rope.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

#ifdef LT2_WITH_CUDA
// x [B, T, H, D] (last dim contiguous, other strides as they are) rotated at positions start..: one
// launch into `out` where given (x's sizes and dtype, last dim contiguous: x itself, or a slice of a
// bigger tensor), else into a packed new tensor; `inverse` rotates by the negative angles. With
// `rotated` < D only the first `rotated` dims rotate (their own frequencies) and the rest are copied.
Tensor rope_kernel(const Tensor& x, int64_t start, double theta, bool interleaved, bool inverse,
                   const Tensor& out = Tensor(), int64_t rotated = -1) {
  c10::cuda::CUDAGuard guard(x.device());
  auto y = out.defined() ? out : torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  kernels::RopeParams p{};
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.x_batch_stride = x.stride(0), p.x_token_stride = x.stride(1), p.x_head_stride = x.stride(2);
  p.y_batch_stride = y.stride(0), p.y_token_stride = y.stride(1), p.y_head_stride = y.stride(2);
  p.batch = static_cast<int>(x.size(0)), p.seq = static_cast<int>(x.size(1));
  if (rotated < 0) rotated = x.size(3);
  p.heads = static_cast<int>(x.size(2)), p.head_dim = static_cast<int>(rotated);
  p.pass_dims = static_cast<int>(x.size(3) - rotated);
  p.start = start;
  p.theta = theta;
  p.interleaved = interleaved;
  p.inverse = inverse;
  p.dtype = detail::kernel_dtype(x.scalar_type());
  kernels::rope_apply(p, detail::current_stream(x));
  return y;
}

// Autograd over the kernel. A rotation's backward is its inverse, dx = R^T dy, so nothing of x is
// saved: only the positions and the layout.
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, int64_t start, double theta,
                        bool interleaved) {
    ctx->saved_data["start"] = start;
    ctx->saved_data["theta"] = theta;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return rope_kernel(x, start, theta, interleaved, /*inverse=*/false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    Tensor dy = grads[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    // Attention's backward hands dy over as a transposed view: read in place where its last dim is
    // contiguous.
    const auto dt = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    if (dy.scalar_type() != dt || dy.stride(-1) != 1) dy = dy.to(dt).contiguous();
    return {rope_kernel(dy, ctx->saved_data["start"].toInt(), ctx->saved_data["theta"].toDouble(),
                        ctx->saved_data["interleaved"].toBool(), /*inverse=*/true),
            Tensor(), Tensor(), Tensor()};
  }
};

// RoPE of the first n dims of x [B, T, H, D] under autograd: a new packed tensor, the prefix rotated
// into it and the rest copied by one kernel pass; the backward the same with the inverse rotation.
// Where a rotated prefix and a cat would take autograd through a narrow (a zeroed full-size gradient
// per part, then their sum), each direction is one pass over x.
struct RopePrefixFunction : public torch::autograd::Function<RopePrefixFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, int64_t n, int64_t start, double theta,
                        bool interleaved) {
    ctx->saved_data["n"] = n;
    ctx->saved_data["start"] = start;
    ctx->saved_data["theta"] = theta;
    ctx->saved_data["interleaved"] = interleaved;
    return rope_kernel(x, start, theta, interleaved, /*inverse=*/false, /*out=*/Tensor(), /*rotated=*/n);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    return {rope_kernel(dy.stride(-1) == 1 ? dy : dy.contiguous(), ctx->saved_data["start"].toInt(),
                        ctx->saved_data["theta"].toDouble(), ctx->saved_data["interleaved"].toBool(), /*inverse=*/true,
                        /*out=*/Tensor(), /*rotated=*/ctx->saved_data["n"].toInt()),
            Tensor(), Tensor(), Tensor(), Tensor()};
  }
};
#endif

}  // namespace

bool rope_kernel_applies(const Tensor& x, const Positions& pos) {
#ifdef LT2_WITH_CUDA
  return decode_options().rope && !pos.documents && !pos.seq_pos.defined() && x.defined() && x.is_cuda() &&
         detail::kernel_dtype_ok(x.scalar_type()) && x.dim() == 4 && x.stride(3) == 1 &&
         kernels::rope_apply_supported(x.size(0), x.size(1), x.size(2), x.size(3));
#else
  (void)x, (void)pos;
  return false;
#endif
}

Tensor apply_rope_prefix_(const Tensor& x, int64_t n, const Positions& pos, double theta, RopeStyle style) {
  LT2_CHECK(n >= 0 && n <= x.size(-1) && n % 2 == 0, "rope: the rotated prefix must be even and within the ",
            x.size(-1), " dims, found ", n);
  if (n == 0) return x;
  const auto prefix = x.narrow(-1, 0, n);
#ifdef LT2_WITH_CUDA
  if (rope_kernel_applies(prefix, pos)) {
    const bool interleaved = style == RopeStyle::Interleaved;
    if (torch::GradMode::is_enabled() && x.requires_grad())
      return RopePrefixFunction::apply(x, n, pos.start, theta, interleaved);
    rope_kernel(prefix, pos.start, theta, interleaved, /*inverse=*/false, /*out=*/prefix);
    return x;
  }
#endif
  const auto rotated = ops::apply_rope(prefix, pos, theta, style);
  return n == x.size(-1) ? rotated : torch::cat({rotated, x.narrow(-1, n, x.size(-1) - n)}, -1);
}

Tensor apply_rope(const Tensor& x, const Positions& pos, double theta, RopeStyle style) {
#ifdef LT2_WITH_CUDA
  if (rope_kernel_applies(x, pos)) {
    const bool interleaved = style == RopeStyle::Interleaved;
    if (torch::GradMode::is_enabled() && x.requires_grad())
      return RopeFunction::apply(x, pos.start, theta, interleaved);
    return rope_kernel(x, pos.start, theta, interleaved, /*inverse=*/false);
  }
#endif
  return lt2::apply_rope(x, pos, theta, style);
}

}  // namespace lt2::ops
