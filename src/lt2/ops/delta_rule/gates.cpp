#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/fused_common.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

#ifdef LT2_WITH_CUDA
// The kernels' inputs: a and b read in place where each token's columns are packed (b in a's dtype),
// A_log and dt_bias in a's dtype where both are, else fp32.
struct GatesInputs {
  Tensor a, b, A_log, dt_bias;
};
GatesInputs gates_inputs(const Tensor& a_in, const Tensor& b_in, const Tensor& A_log, const Tensor& dt_bias) {
  GatesInputs in;
  in.a = detail::token_stride(a_in) ? a_in : a_in.contiguous();
  in.b = detail::token_stride(b_in) && b_in.scalar_type() == in.a.scalar_type()
             ? b_in
             : b_in.to(in.a.scalar_type()).contiguous();
  const auto param_dtype = A_log.scalar_type() == in.a.scalar_type() && dt_bias.scalar_type() == in.a.scalar_type()
                               ? in.a.scalar_type()
                               : torch::kFloat32;
  in.A_log = A_log.to(param_dtype).contiguous(), in.dt_bias = dt_bias.to(param_dtype).contiguous();
  return in;
}

kernels::DeltaRuleGatesParams gates_params(const GatesInputs& in, double beta_scale) {
  kernels::DeltaRuleGatesParams p{};
  p.a = in.a.data_ptr(), p.b = in.b.data_ptr(), p.A_log = in.A_log.data_ptr(), p.dt_bias = in.dt_bias.data_ptr();
  p.rows = in.a.size(0) * in.a.size(1);
  p.a_row_stride = detail::token_stride(in.a), p.b_row_stride = detail::token_stride(in.b);
  p.cols = static_cast<int>(in.a.size(2)), p.heads = static_cast<int>(in.A_log.numel());
  p.beta_cols = static_cast<int>(in.b.size(2));
  p.beta_scale = static_cast<float>(beta_scale);
  p.dtype = detail::kernel_dtype(in.a.scalar_type()), p.param_dtype = detail::kernel_dtype(in.A_log.scalar_type());
  return p;
}

DeltaRuleGates gates_cuda(const GatesInputs& in, double beta_scale) {
  c10::cuda::CUDAGuard guard(in.a.device());
  const auto f32 = in.a.options().dtype(torch::kFloat32);
  DeltaRuleGates out{torch::empty(in.a.sizes(), f32), torch::empty(in.b.sizes(), f32)};
  auto p = gates_params(in, beta_scale);
  p.g = out.g.data_ptr<float>(), p.beta = out.beta.data_ptr<float>();
  kernels::delta_rule_gates(p, detail::current_stream(in.a));
  return out;
}

// Autograd over the forward and backward kernels: the inputs are saved (the backward recomputes the
// activations), the gradients of a and b come in their dtype, of A_log and dt_bias in theirs.
struct GatesFunction : public torch::autograd::Function<GatesFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& a,
                                                const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                                double beta_scale) {
    const auto in = gates_inputs(a, b, A_log, dt_bias);
    auto out = gates_cuda(in, beta_scale);
    ctx->save_for_backward({in.a, in.b, in.A_log, in.dt_bias});
    ctx->saved_data["beta_scale"] = beta_scale;
    ctx->saved_data["A_log_dtype"] = static_cast<int64_t>(A_log.scalar_type());
    ctx->saved_data["dt_bias_dtype"] = static_cast<int64_t>(dt_bias.scalar_type());
    return {out.g, out.beta};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const GatesInputs in{saved[0], saved[1], saved[2], saved[3]};
    c10::cuda::CUDAGuard guard(in.a.device());
    const auto f32 = in.a.options().dtype(torch::kFloat32);
    auto grad = [&](size_t i, const Tensor& like) {
      return grads[i].defined() ? grads[i].to(torch::kFloat32).contiguous() : torch::zeros(like.sizes(), f32);
    };
    const auto dg = grad(0, in.a), dbeta = grad(1, in.b);
    auto da = torch::empty(in.a.sizes(), in.a.options()), db = torch::empty(in.b.sizes(), in.b.options());
    auto dt_bias_cols = torch::zeros({in.a.size(2)}, f32), A_log_cols = torch::zeros({in.a.size(2)}, f32);
    kernels::DeltaRuleGatesBackwardParams bp{};
    bp.forward = gates_params(in, ctx->saved_data["beta_scale"].toDouble());
    bp.dg = dg.data_ptr<float>(), bp.dbeta = dbeta.data_ptr<float>();
    bp.da = da.data_ptr(), bp.db = db.data_ptr();
    bp.dt_bias_cols = dt_bias_cols.data_ptr<float>(), bp.A_log_cols = A_log_cols.data_ptr<float>();
    kernels::delta_rule_gates_backward(bp, detail::current_stream(in.a));
    const auto heads = in.A_log.numel();
    const auto A_log_dtype = static_cast<torch::ScalarType>(ctx->saved_data["A_log_dtype"].toInt());
    const auto dt_bias_dtype = static_cast<torch::ScalarType>(ctx->saved_data["dt_bias_dtype"].toInt());
    return {da, db, A_log_cols.view({heads, -1}).sum(1).to(A_log_dtype), dt_bias_cols.to(dt_bias_dtype), Tensor()};
  }
};
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
  if (decode_options().delta_rule_gates && a.is_cuda() && detail::kernel_dtype_ok(a.scalar_type()) &&
      a.numel() > 0 && b.size(2) > 0 && cols <= INT32_MAX && b.size(2) <= INT32_MAX) {
    if (!grad) return gates_cuda(gates_inputs(a, b, A_log, dt_bias), beta_scale);
    const auto out = GatesFunction::apply(a, b, A_log, dt_bias, beta_scale);
    return {out[0], out[1]};
  }
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
