#include "lt2/ops/delta_rule/decode.h"

#include <ATen/autocast_mode.h>

#include <string>

#include "lt2/ops/decode_options.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace lt2::ops {

using namespace detail;

namespace {

std::string recurrent_problem(const Tensor& q, const Tensor& v, const Tensor& state) {
  for (const auto& p : {activation_problem(q, "q"), activation_problem(v, "v"), state_problem(state, v)})
    if (!p.empty()) return p;
  if (q.dim() != 3 || q.size(2) > kernels::kMaxRecurrentHeadK)
    return cat("q must be [B, H, K] with K <= ", kernels::kMaxRecurrentHeadK, ", found ", q.sizes());
  return "";
}

}  // namespace

Tensor recurrent_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                      double scale, Tensor& state) {
  if (fused_decode_enabled() && recurrent_step_fused_supported(q, v, state))
    return recurrent_step_fused(q, k, v, beta, g, scale, state);
  return beta.defined() ? delta_rule_step(q, k, v, beta, g, scale, state) : gated_linear_step(q, k, v, g, scale, state);
}

bool recurrent_step_fused_supported(const Tensor& q, const Tensor& v, const Tensor& state) {
  return fused_decode_available() && recurrent_problem(q, v, state).empty();
}

Tensor recurrent_step_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                            const Tensor& g, double scale, Tensor& state) {
  const char* op = "recurrent_step_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = recurrent_problem(q, v, state);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  LT2_CHECK(k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == B && v.size(1) == H, op,
            ": q, k must be [B, H, K] and v [B, H, V], found q ", q.sizes(), ", k ", k.sizes(), ", v ",
            v.sizes());
  LT2_CHECK(activation_problem(k, "k").empty(), op, ": ", activation_problem(k, "k"));
  LT2_CHECK(state.sizes() == torch::IntArrayRef({B, H, K, V}), op, ": state must be [B, H, K, V] = [",
            B, ", ", H, ", ", K, ", ", V, "], found ", state.sizes());
  LT2_CHECK(!beta.defined() || beta.sizes() == torch::IntArrayRef({B, H}), op,
            ": beta must be [B, H] or undefined, found ", beta.sizes());
  LT2_CHECK(!g.defined() || g.sizes() == torch::IntArrayRef({B, H}) ||
                g.sizes() == torch::IntArrayRef({B, H, K}),
            op, ": g must be undefined, [B, H] or [B, H, K], found ", g.sizes());
  for (const Tensor* t : {&q, &k, &beta, &g})
    LT2_CHECK(!t->defined() || t->device() == state.device(), op, ": every input must be on ", state.device());
#ifdef LT2_WITH_CUDA
  // One dtype for q, k, v in the kernel: theirs when they agree, fp32 (exact) when they do not.
  const auto dt = (q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type())
                      ? v.scalar_type() : torch::kFloat32;
  const auto qc = with_contiguous_rows(q, dt), kc = with_contiguous_rows(k, dt), vc = with_contiguous_rows(v, dt);
  const auto beta_c = beta.defined() ? beta.to(torch::kFloat32).contiguous() : Tensor();
  const auto g_c = g.defined() ? g.to(torch::kFloat32).contiguous() : Tensor();
  c10::cuda::CUDAGuard guard(state.device());
  auto o = torch::empty({B, H, V}, vc.options());

  kernels::RecurrentStepParams p{};
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.q_batch_stride = qc.stride(0), p.q_head_stride = qc.stride(1);
  p.k_batch_stride = kc.stride(0), p.k_head_stride = kc.stride(1);
  p.v_batch_stride = vc.stride(0), p.v_head_stride = vc.stride(1);
  p.beta = beta_c.defined() ? beta_c.data_ptr<float>() : nullptr;
  p.g = g_c.defined() ? g_c.data_ptr<float>() : nullptr;
  p.decay_kind = !g_c.defined()     ? kernels::DecayKind::None
                 : g_c.dim() == 2 ? kernels::DecayKind::PerHead
                                  : kernels::DecayKind::PerChannel;
  p.state = state.data_ptr<float>();
  p.o = o.data_ptr();
  p.batch = B, p.heads = H, p.head_k = K, p.head_v = V;
  p.scale = static_cast<float>(scale);
  p.dtype = kernel_dtype(dt);
  kernels::recurrent_step(p, current_stream(state));
  return o.to(v.scalar_type());
#else
  no_cuda(op);
#endif
}

bool gdn_decode_applies(const Tensor& x, const Tensor& state, const Tensor& conv_window, const Tensor& A_log,
                        int64_t head_k_dim) {
  return fused_decode_enabled() && !at::autocast::is_autocast_enabled(at::kCUDA) &&
         activation_problem(x, "x").empty() && A_log.scalar_type() == x.scalar_type() &&
         conv_window.scalar_type() == x.scalar_type() && state_problem(state, x).empty() &&
         head_k_dim <= kernels::kMaxRecurrentHeadK;
}

Tensor gdn_decode_fused(const GdnDecodeArgs& a, Tensor& state, Tensor& q_window, Tensor& k_window,
                        Tensor& v_window) {
  const char* op = "gdn_decode_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto act = activation_problem(a.q, "q");
  LT2_CHECK(act.empty(), op, ": ", act);
  const auto st = state_problem(state, a.q);
  LT2_CHECK(st.empty(), op, ": ", st);
  const int64_t B = a.q.size(0), H = a.num_heads, K = a.head_k_dim, V = a.head_v_dim;
  LT2_CHECK(H >= 1 && K >= 1 && K <= kernels::kMaxRecurrentHeadK && V >= 1, op, ": heads ", H,
            ", head dims K ", K, " (at most ", kernels::kMaxRecurrentHeadK, "), V ", V);
  const auto dt = a.q.scalar_type();
  // Every non-state tensor: the given shape, q's dtype and device, a contiguous last dim (fully
  // contiguous when `whole`).
  auto check = [&](const Tensor& t, torch::IntArrayRef shape, const char* name, bool whole) {
    LT2_CHECK(t.defined() && t.sizes() == shape, op, ": ", name, " must be ", shape, ", found ",
              t.defined() ? t.sizes() : torch::IntArrayRef{});
    LT2_CHECK(t.scalar_type() == dt && t.device() == a.q.device(), op, ": ", name, " must be ", dt,
              " on ", a.q.device(), " like q, found ", t.scalar_type(), " on ", t.device());
    LT2_CHECK(whole ? t.is_contiguous() : t.stride(-1) == 1, op, ": ", name, " must be ",
              whole ? "contiguous" : "contiguous in its last dim");
  };
  check(a.q, {B, H * K}, "q", false);
  check(a.k, {B, H * K}, "k", false);
  check(a.v, {B, H * V}, "v", false);
  check(a.a, {B, H}, "a", false);
  check(a.b, {B, H}, "b", false);
  if (a.gate.defined()) check(a.gate, {B, H * V}, "gate", false);
  LT2_CHECK(a.q_conv_weight.defined() && a.q_conv_weight.dim() == 3, op,
            ": q_conv_weight must be [C, 1, W] (nn.Conv1d layout)");
  const int64_t W = a.q_conv_weight.size(-1);
  check(a.q_conv_weight, {H * K, 1, W}, "q_conv_weight", true);
  check(a.k_conv_weight, {H * K, 1, W}, "k_conv_weight", true);
  check(a.v_conv_weight, {H * V, 1, W}, "v_conv_weight", true);
  check(q_window, {B, W - 1, H * K}, "q conv window", true);
  check(k_window, {B, W - 1, H * K}, "k conv window", true);
  check(v_window, {B, W - 1, H * V}, "v conv window", true);
  check(a.A_log, {H}, "A_log", true);
  check(a.dt_bias, {H}, "dt_bias", true);
  check(a.norm_weight, {V}, "norm_weight", true);
  LT2_CHECK(state.sizes() == torch::IntArrayRef({B, H, K, V}), op, ": state must be [B, H, K, V] = [",
            B, ", ", H, ", ", K, ", ", V, "], found ", state.sizes());
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(state.device());
  auto y = torch::empty({B, H * V}, a.q.options());
  kernels::GdnDecodeParams p{};
  p.q_raw = a.q.data_ptr(), p.k_raw = a.k.data_ptr(), p.v_raw = a.v.data_ptr();
  p.a_raw = a.a.data_ptr(), p.b_raw = a.b.data_ptr();
  p.gate = a.gate.defined() ? a.gate.data_ptr() : nullptr;
  p.q_stride = a.q.stride(0), p.k_stride = a.k.stride(0), p.v_stride = a.v.stride(0);
  p.a_stride = a.a.stride(0), p.b_stride = a.b.stride(0);
  p.gate_stride = a.gate.defined() ? a.gate.stride(0) : 0;
  p.q_conv_weight = a.q_conv_weight.data_ptr();
  p.k_conv_weight = a.k_conv_weight.data_ptr();
  p.v_conv_weight = a.v_conv_weight.data_ptr();
  p.q_conv_window = q_window.data_ptr();
  p.k_conv_window = k_window.data_ptr();
  p.v_conv_window = v_window.data_ptr();
  p.A_log = a.A_log.data_ptr(), p.dt_bias = a.dt_bias.data_ptr();
  p.norm_weight = a.norm_weight.data_ptr();
  p.state = state.data_ptr<float>();
  p.y = y.data_ptr();
  p.batch = B, p.heads = H, p.head_k = K, p.head_v = V, p.conv_size = W;
  p.scale = static_cast<float>(a.scale), p.norm_eps = static_cast<float>(a.norm_eps);
  p.allow_neg_eigval = a.allow_neg_eigval;
  p.dtype = kernel_dtype(dt);
  p.form = a.form;
  p.state_settled = a.state_settled && decode_options().gdn_early_state;
  p.pdl = decode_options().pdl_for("gdn_decode");
  kernels::gdn_decode(p, current_stream(state));
  return y;
#else
  no_cuda(op);
#endif
}

}  // namespace lt2::ops
