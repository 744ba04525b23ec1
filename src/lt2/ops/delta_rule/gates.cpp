#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/fused_common.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

#ifdef LT2_WITH_CUDA
DeltaRuleGates gates_cuda(const Tensor& a_in, const Tensor& b_in, const Tensor& A_log, const Tensor& dt_bias,
                          double beta_scale) {
  c10::cuda::CUDAGuard guard(a_in.device());
  const auto a = detail::token_stride(a_in) ? a_in : a_in.contiguous();
  const auto b = detail::token_stride(b_in) && b_in.scalar_type() == a.scalar_type() ? b_in : b_in.to(a.scalar_type()).contiguous();
  const auto param_dtype = A_log.scalar_type() == a.scalar_type() && dt_bias.scalar_type() == a.scalar_type()
                               ? a.scalar_type()
                               : torch::kFloat32;
  const auto A = A_log.to(param_dtype).contiguous(), dt = dt_bias.to(param_dtype).contiguous();
  const auto f32 = a.options().dtype(torch::kFloat32);
  DeltaRuleGates out{torch::empty(a.sizes(), f32), torch::empty(b.sizes(), f32)};
  kernels::DeltaRuleGatesParams p{};
  p.a = a.data_ptr(), p.b = b.data_ptr(), p.A_log = A.data_ptr(), p.dt_bias = dt.data_ptr();
  p.g = out.g.data_ptr<float>(), p.beta = out.beta.data_ptr<float>();
  p.rows = a.size(0) * a.size(1), p.a_row_stride = detail::token_stride(a), p.b_row_stride = detail::token_stride(b);
  p.cols = static_cast<int>(a.size(2)), p.heads = static_cast<int>(A_log.numel());
  p.beta_cols = static_cast<int>(b.size(2));
  p.beta_scale = static_cast<float>(beta_scale);
  p.dtype = detail::kernel_dtype(a.scalar_type()), p.param_dtype = detail::kernel_dtype(param_dtype);
  kernels::delta_rule_gates(p, detail::current_stream(a));
  return out;
}
#endif

}  // namespace

DeltaRuleGates delta_rule_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                double beta_scale) {
  LT2_CHECK(a.dim() == 3 && b.dim() == 3 && b.size(0) == a.size(0) && b.size(1) == a.size(1), "delta_rule_gates: a ",
            "must be [B, T, cols] and b [B, T, H_b], found ", a.sizes(), " and ", b.sizes());
  const int64_t heads = A_log.numel(), cols = a.size(2);
  LT2_CHECK(A_log.dim() == 1 && heads >= 1 && cols % heads == 0 && dt_bias.dim() == 1 && dt_bias.size(0) == cols,
            "delta_rule_gates: A_log must be [heads] with heads dividing a's ", cols, " columns and dt_bias [", cols,
            "], found ", A_log.sizes(), " and ", dt_bias.sizes());
#ifdef LT2_WITH_CUDA
  const bool grad = torch::GradMode::is_enabled() &&
                    (a.requires_grad() || b.requires_grad() || A_log.requires_grad() || dt_bias.requires_grad());
  if (!grad && decode_options().delta_rule_gates && a.is_cuda() && detail::kernel_dtype_ok(a.scalar_type()) &&
      a.numel() > 0 && b.size(2) > 0 && cols <= INT32_MAX && b.size(2) <= INT32_MAX)
    return gates_cuda(a, b, A_log, dt_bias, beta_scale);
#endif
  const auto ct = accum_dtype(a);
  const int64_t B = a.size(0), T = a.size(1);
  auto softplus = torch::softplus((a.to(ct) + dt_bias.to(ct)).view({B, T, heads, cols / heads}));
  auto g = (-A_log.to(ct).exp().view({heads, 1}) * softplus).view({B, T, cols});
  auto beta = torch::sigmoid(b.to(ct));
  if (beta_scale != 1.0) beta = beta * beta_scale;
  return {g, beta};
}

}  // namespace lt2::ops
