#include "lt2/ops/fused_decode.h"

#include <atomic>
#include <string>

#include "lt2/kernels/decode.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2 {

bool fused_decode_enabled() { return fused_decode_available() && decode_options().fused; }
bool fused_decode_available() {
#ifdef LT2_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace ops {

using namespace detail;

namespace {

// Why the kernels cannot take a tensor (empty when they can): defined, on CUDA, a kernel dtype.
std::string activation_problem(const Tensor& t, const char* name) {
  if (!t.defined()) return cat(name, " is undefined");
  if (!t.is_cuda()) return cat(name, " is on ", t.device(), ", not CUDA");
  if (!kernel_dtype_ok(t.scalar_type()))
    return cat(name, " is ", t.scalar_type(), " (the kernels take float32, bfloat16, float16)");
  return "";
}

std::string state_problem(const Tensor& state, const Tensor& like) {
  if (!state.defined() || !state.is_cuda() || state.device() != like.device())
    return cat("the state must be a CUDA tensor on ", like.device());
  if (state.scalar_type() != torch::kFloat32 || !state.is_contiguous())
    return cat("the state must be contiguous float32, found ", state.scalar_type(),
               state.is_contiguous() ? "" : " (not contiguous)");
  return "";
}

std::string recurrent_problem(const Tensor& q, const Tensor& v, const Tensor& state) {
  for (const auto& p : {activation_problem(q, "q"), activation_problem(v, "v"), state_problem(state, v)})
    if (!p.empty()) return p;
  if (q.dim() != 3 || q.size(2) > kernels::kMaxRecurrentHeadK)
    return cat("q must be [B, H, K] with K <= ", kernels::kMaxRecurrentHeadK, ", found ", q.sizes());
  return "";
}

std::string attention_problem(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  for (const auto& p : {activation_problem(q, "q"), activation_problem(k_cache, "k_cache"),
                        activation_problem(v_cache, "v_cache")})
    if (!p.empty()) return p;
  if (k_cache.scalar_type() != q.scalar_type() || v_cache.scalar_type() != q.scalar_type())
    return cat("the caches must have q's dtype ", q.scalar_type(), ", found ", k_cache.scalar_type(),
               " and ", v_cache.scalar_type());
  if (q.dim() != 3 || k_cache.dim() != 4 || v_cache.sizes() != k_cache.sizes() ||
      k_cache.size(0) != q.size(0) || k_cache.size(3) != q.size(2))
    return cat("q must be [B, Hq, D] and the caches [B, Hkv, L, D], found q ", q.sizes(), ", k ",
               k_cache.sizes(), ", v ", v_cache.sizes());
  const int64_t Hq = q.size(1), Hkv = k_cache.size(1), D = q.size(2);
  if (!kernels::attention_decode_head_dim_supported(static_cast<int>(D)))
    return cat("head dim ", D, " has no kernel (64, 128, 256)");
  if (Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > kernels::kAttentionMaxGroups)
    return cat(Hq, " query heads over ", Hkv, " kv heads (a multiple, at most ",
               kernels::kAttentionMaxGroups, " per kv head)");
  if (q.device() != k_cache.device() || q.device() != v_cache.device())
    return "q and the caches must be on one device";
  if (!rows_aligned(k_cache) || !rows_aligned(v_cache)) return "cache rows must be contiguous and 16-byte aligned";
  return "";
}

std::string rope_cache_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                               const Tensor& v_cache, const Tensor& seq_pos) {
  for (const auto& p : {activation_problem(q, "q"), activation_problem(k, "k"), activation_problem(v, "v"),
                        activation_problem(k_cache, "k_cache"), activation_problem(v_cache, "v_cache")})
    if (!p.empty()) return p;
  if (q.dim() != 3 || k.dim() != 3 || k_cache.dim() != 4 || v.sizes() != k.sizes() ||
      v_cache.sizes() != k_cache.sizes() || k.size(0) != q.size(0) || k.size(2) != q.size(2) ||
      k_cache.size(0) != q.size(0) || k_cache.size(1) != k.size(1) || k_cache.size(3) != q.size(2))
    return cat("q must be [B, H, D], k and v [B, H_kv, D], the caches [B, H_kv, L, D], found q ", q.sizes(), ", k ",
               k.sizes(), ", v ", v.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  for (const Tensor* t : {&k, &v, &k_cache, &v_cache})
    if (t->scalar_type() != q.scalar_type() || t->device() != q.device())
      return cat("every tensor must be ", q.scalar_type(), " on ", q.device(), " like q");
  for (const Tensor* t : {&q, &k, &v})  // heads of one row D apart: views of a projection's rows
    if (t->stride(2) != 1 || t->stride(1) != t->size(2))
      return "q, k and v must have contiguous [H, D] rows (views of [B, H * D] rows)";
  if (k_cache.stride(3) != 1 || v_cache.stride(3) != 1) return "the caches' last dim must be contiguous";
  if (!seq_pos.defined() || seq_pos.scalar_type() != torch::kInt64 || seq_pos.dim() != 1 ||
      seq_pos.size(0) != q.size(0) || seq_pos.device() != q.device())
    return cat("seq_pos must be [B] = [", q.size(0), "] int64 on ", q.device());
#ifdef LT2_WITH_CUDA
  if (!kernels::rope_cache_write_supported(static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
                                           static_cast<int>(k.size(1)), static_cast<int>(q.size(2))))
    return cat("head dim ", q.size(2), " (even, at most ", kernels::kRopeCacheMaxHeadDim, ") or batch / heads ",
               q.sizes(), " out of range");
#endif
  return "";
}

#ifdef LT2_WITH_CUDA

// t in dtype `dt` with a contiguous last dim (no copy when it already is).
Tensor with_contiguous_rows(const Tensor& t, torch::ScalarType dt) {
  auto c = t.to(dt);
  return c.stride(-1) == 1 ? c : c.contiguous();
}
#endif

}  // namespace

bool recurrent_step_fused_supported(const Tensor& q, const Tensor& v, const Tensor& state) {
  return fused_decode_available() && recurrent_problem(q, v, state).empty();
}

bool gdn_decode_fused_supported(const Tensor& x, const Tensor& state, int64_t head_k_dim) {
  return fused_decode_available() && activation_problem(x, "x").empty() &&
         state_problem(state, x).empty() && head_k_dim <= kernels::kMaxRecurrentHeadK;
}

bool attention_decode_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  return fused_decode_available() && attention_problem(q, k_cache, v_cache).empty();
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

bool fused_elementwise_applies(const std::vector<Tensor>& tensors) {
  if (!fused_decode_enabled() || torch::GradMode::is_enabled() || tensors.empty()) return false;
  const Tensor& first = tensors.front();
  for (const auto& t : tensors)
    if (!activation_problem(t, "t").empty() || t.dim() == 0 || t.stride(-1) != 1 ||
        t.scalar_type() != first.scalar_type() || t.device() != first.device())
      return false;
  return true;
}

namespace {

// x [..., d] with weight [d] of x's dtype on x's device: throws naming `op` otherwise.
void check_norm_inputs(const char* op, const Tensor& x, const Tensor& weight) {
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = activation_problem(x, "x");
  LT2_CHECK(problem.empty(), op, ": ", problem);
  LT2_CHECK(x.dim() >= 1 && x.size(-1) >= 1 && x.size(-1) <= INT32_MAX, op, ": x must be [..., d], found ",
            x.sizes());
  LT2_CHECK(weight.defined() && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
            ": weight must be [", x.size(-1), "], found ", weight.defined() ? weight.sizes() : torch::IntArrayRef{});
  LT2_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(), op,
            ": weight must be ", x.scalar_type(), " on ", x.device(), " like x, found ", weight.scalar_type(),
            " on ", weight.device());
}

#ifdef LT2_WITH_CUDA
// Shared by rms_norm_fused and add_rms_norm_fused (m undefined: no residual add).
AddRmsNormResult launch_rms_norm(const Tensor& x, const Tensor& m, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  const auto dt = x.scalar_type();
  c10::cuda::CUDAGuard guard(x.device());
  const auto x2 = with_contiguous_rows(x.reshape({-1, d}), dt);  // [N, d]
  const auto m2 = m.defined() ? with_contiguous_rows(m.reshape({-1, d}), dt) : Tensor();
  const auto w = weight.contiguous();
  AddRmsNormResult r;
  r.y = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  if (m.defined()) r.h = torch::empty_like(r.y);
  kernels::RmsNormParams p{};
  p.x = x2.data_ptr(), p.x_row_stride = x2.stride(0);
  p.residual = m.defined() ? m2.data_ptr() : nullptr;
  p.residual_row_stride = m.defined() ? m2.stride(0) : 0;
  p.weight = w.data_ptr();
  p.h = m.defined() ? r.h.data_ptr() : nullptr;
  p.y = r.y.data_ptr();
  p.rows = x2.size(0), p.dim = static_cast<int>(d);
  p.eps = static_cast<float>(eps);
  p.dtype = kernel_dtype(dt);
  kernels::rms_norm(p, current_stream(x));
  return r;
}
#endif

}  // namespace

Tensor rms_norm_fused(const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "rms_norm_fused";
  check_norm_inputs(op, x, weight);
#ifdef LT2_WITH_CUDA
  return launch_rms_norm(x, Tensor(), weight, eps).y;
#else
  no_cuda(op);
#endif
}

AddRmsNormResult add_rms_norm_fused(const Tensor& x, const Tensor& m, const Tensor& weight, double eps) {
  const char* op = "add_rms_norm_fused";
  check_norm_inputs(op, x, weight);
  LT2_CHECK(m.defined() && m.sizes() == x.sizes() && m.scalar_type() == x.scalar_type() &&
                m.device() == x.device(),
            op, ": m must be ", x.sizes(), " ", x.scalar_type(), " on ", x.device(), " like x, found ",
            m.defined() ? m.sizes() : torch::IntArrayRef{}, " ", m.defined() ? m.scalar_type() : x.scalar_type(),
            " on ", m.defined() ? m.device() : x.device());
#ifdef LT2_WITH_CUDA
  return launch_rms_norm(x, m, weight, eps);
#else
  no_cuda(op);
#endif
}

Tensor silu_mul_fused(const Tensor& gate_up) {
  const char* op = "silu_mul_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = activation_problem(gate_up, "gate_up");
  LT2_CHECK(problem.empty(), op, ": ", problem);
  LT2_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gate_up.size(-1) >= 2 &&
                gate_up.size(-1) / 2 <= INT32_MAX,
            op, ": gate_up must be [..., 2 hidden], found ", gate_up.sizes());
#ifdef LT2_WITH_CUDA
  const int64_t hidden = gate_up.size(-1) / 2;
  c10::cuda::CUDAGuard guard(gate_up.device());
  const auto in = with_contiguous_rows(gate_up.reshape({-1, 2 * hidden}), gate_up.scalar_type());  // [N, 2H]
  auto sizes = gate_up.sizes().vec();
  sizes.back() = hidden;
  auto out = torch::empty(sizes, gate_up.options().memory_format(torch::MemoryFormat::Contiguous));
  kernels::SiluMulParams p{};
  p.gate_up = in.data_ptr(), p.row_stride = in.stride(0);
  p.out = out.data_ptr();
  p.rows = in.size(0), p.hidden = static_cast<int>(hidden);
  p.dtype = kernel_dtype(gate_up.scalar_type());
  kernels::silu_mul(p, current_stream(gate_up));
  return out;
#else
  no_cuda(op);
#endif
}

bool rope_cache_write_supported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& seq_pos) {
  return fused_decode_available() && rope_cache_problem(q, k, v, k_cache, v_cache, seq_pos).empty();
}

Tensor rope_cache_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& seq_pos, double theta, bool interleaved) {
  const char* op = "rope_cache_write";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = rope_cache_problem(q, k, v, k_cache, v_cache, seq_pos);
  LT2_CHECK(problem.empty(), op, ": ", problem);
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  auto q_out = torch::empty(q.sizes(), q.options().memory_format(torch::MemoryFormat::Contiguous));
  const auto pos = seq_pos.contiguous();
  kernels::RopeCacheParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.q_in_stride = q.stride(0), p.k_in_stride = k.stride(0), p.v_in_stride = v.stride(0);
  p.q_out = q_out.data_ptr();
  p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_head_stride = k_cache.stride(1), p.k_row_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_head_stride = v_cache.stride(1), p.v_row_stride = v_cache.stride(2);
  p.positions = pos.data_ptr<int64_t>();
  p.batch = static_cast<int>(q.size(0)), p.heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1)), p.head_dim = static_cast<int>(q.size(2));
  p.max_len = k_cache.size(2);
  p.theta = theta, p.interleaved = interleaved;
  p.dtype = kernel_dtype(q.scalar_type());
  p.pdl = decode_options().pdl_for("rope_cache_write");
  kernels::rope_cache_write(p, current_stream(q));
  return q_out;
#else
  no_cuda(op);
#endif
}

Tensor attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& seq_lens, double scale) {
  const char* op = "attention_decode";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = attention_problem(q, k_cache, v_cache);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), L = k_cache.size(2);
  LT2_CHECK(seq_lens.defined() && seq_lens.scalar_type() == torch::kInt64 &&
                seq_lens.sizes() == torch::IntArrayRef({B}) && seq_lens.device() == q.device(),
            op, ": seq_lens must be [B] = [", B, "] int64 on ", q.device(), ", found ",
            seq_lens.defined() ? seq_lens.sizes() : torch::IntArrayRef{}, " ",
            seq_lens.defined() ? seq_lens.scalar_type() : torch::kInt64);
  LT2_CHECK(L >= 1 && L <= INT32_MAX, op, ": cache length ", L, " out of range");
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  const auto qc = q.stride(2) == 1 ? q : q.contiguous();
  const auto lens = seq_lens.contiguous();
  const int splits = kernels::attention_decode_num_splits(static_cast<int>(B), static_cast<int>(Hkv),
                                                          static_cast<int>(L), q.device().index());
  auto out = torch::empty({B, Hq, D}, q.options());
  const SplitWorkspace partial(B, Hq, splits, D, q.options(), splits > 1);
  kernels::AttentionDecodeParams p{};
  p.q = qc.data_ptr();
  p.q_batch_stride = qc.stride(0), p.q_head_stride = qc.stride(1);
  p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_head_stride = k_cache.stride(1), p.k_row_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_head_stride = v_cache.stride(1), p.v_row_stride = v_cache.stride(2);
  p.seq_lens = lens.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.partial_out = partial.out_ptr(), p.partial_lse = partial.lse_ptr();
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.head_dim = D, p.max_len = L, p.num_splits = splits;
  p.scale = static_cast<float>(scale);
  p.dtype = kernel_dtype(q.scalar_type());
  p.pdl = decode_options().pdl_for("attention_decode");
  kernels::attention_decode(p, current_stream(q));
  return out;
#else
  no_cuda(op);
#endif
}

namespace {

// Why gemv_fused cannot take an x of these sizes, with x_like's dtype and device, and these
// tensors (empty when it can).
std::string gemv_problem(torch::IntArrayRef x_sizes, const Tensor& x_like, const Tensor& w, const GemvFusion& f) {
  for (const auto& p : {activation_problem(x_like, "x"), activation_problem(w, "w")})
    if (!p.empty()) return p;
  if (w.dim() != 2 || !contiguous_aligned(w))
    return cat("w must be a contiguous, 16-byte aligned [N, K], found ", w.sizes());
  const int64_t K = w.size(1), N = w.size(0), x_dim = f.silu_mul ? 2 * K : K;
  if (x_sizes.empty() || x_sizes.back() != x_dim)
    return cat("x must be [..., ", x_dim, "] for w ", w.sizes(), f.silu_mul ? " with silu_mul" : "", ", found ", x_sizes);
  if ((f.silu_mul ? 1 : 0) + (f.norm_weight.defined() ? 1 : 0) + (f.x_gate.defined() ? 1 : 0) > 1)
    return "silu_mul, the RMSNorm prologue and x_gate do not combine";
  if (f.k_splits < 0 || f.k_splits > kernels::kGemvMaxKSplits)
    return cat("k_splits must be 0 (pick) or 1..", kernels::kGemvMaxKSplits, ", found ", f.k_splits);
  std::vector<const Tensor*> all{&w};
  if (f.norm_weight.defined()) {
    if (f.norm_weight.dim() != 1 || f.norm_weight.size(0) != K || !f.norm_weight.is_contiguous())
      return cat("norm_weight must be a contiguous [", K, "], found ", f.norm_weight.sizes());
    all.push_back(&f.norm_weight);
  }
  if (f.x_gate.defined()) {
    if (f.x_gate.sizes() != x_sizes || f.x_gate.stride(-1) != 1)
      return cat("x_gate must be ", x_sizes, " like x with a contiguous last dim, found ", f.x_gate.sizes());
    all.push_back(&f.x_gate);
  }
  if (f.residual.defined()) {
    auto sizes = x_sizes.vec();
    sizes.back() = N;
    if (f.residual.sizes() != torch::IntArrayRef(sizes) || f.residual.stride(-1) != 1)
      return cat("residual must be ", torch::IntArrayRef(sizes), " with a contiguous last dim, found ",
                 f.residual.sizes());
    all.push_back(&f.residual);
  }
  for (const Tensor* t : all)
    if (t->scalar_type() != x_like.scalar_type() || t->device() != x_like.device())
      return cat("every tensor must be ", x_like.scalar_type(), " on ", x_like.device(), " like x");
#ifdef LT2_WITH_CUDA
  const int64_t rows = c10::multiply_integers(x_sizes) / x_dim;
  if (!kernels::gemv_supported(rows, K, kernel_dtype(x_like.scalar_type())))
    return cat(rows, " rows of K = ", K, ": the GEMV takes 1..", kernels::kGemvMaxRows,
               " rows and K a whole number of 16-byte vectors");
#endif
  return "";
}
std::string gemv_problem(const Tensor& x, const Tensor& w, const GemvFusion& f) {
  return x.defined() ? gemv_problem(x.sizes(), x, w, f) : "x is undefined";
}

#ifdef LT2_WITH_CUDA
// f.x_gate as the kernels read it: [M, K] with 16-byte aligned rows (a copy where they are not),
// or undefined.
Tensor aligned_x_gate(const GemvFusion& f, int64_t K) {
  return f.x_gate.defined() ? with_aligned_rows(f.x_gate.reshape({-1, K})) : Tensor();
}

// The kernel parameters of y = f(x) W^T for x2 [M, K or 2K] with aligned rows, the gate g2 of
// aligned_x_gate (kept alive by the caller until the launch) and y [M, N] (or [M, N / 2]: the
// chain's SiLU·mul epilogue).
kernels::GemvParams gemv_params(const Tensor& x2, const Tensor& w, const GemvFusion& f, const Tensor& g2,
                                const Tensor& y) {
  const int64_t K = w.size(1), N = w.size(0);
  const auto r2 = f.residual.defined() ? f.residual.reshape({-1, N}) : Tensor();
  kernels::GemvParams p{};
  p.x = x2.data_ptr(), p.x_row_stride = x2.stride(0);
  p.w = w.data_ptr();
  p.y = y.data_ptr(), p.y_row_stride = y.size(-1);  // N, or N / 2 with the chain's SiLU·mul epilogue
  p.residual = r2.defined() ? r2.data_ptr() : nullptr;
  p.residual_row_stride = r2.defined() ? r2.stride(0) : 0;
  p.norm_weight = f.norm_weight.defined() ? f.norm_weight.data_ptr() : nullptr;
  p.norm_eps = static_cast<float>(f.norm_eps);
  p.x_gate = g2.defined() ? g2.data_ptr() : nullptr;
  p.x_gate_row_stride = g2.defined() ? g2.stride(0) : 0;
  p.prologue = f.norm_weight.defined() ? kernels::GemvPrologue::RmsNorm
               : f.silu_mul            ? kernels::GemvPrologue::SiluMul
               : f.x_gate.defined()    ? kernels::GemvPrologue::SigmoidGate
                                       : kernels::GemvPrologue::None;
  p.rows = x2.size(0), p.n = N, p.k = static_cast<int>(K);
  p.dtype = kernel_dtype(x2.scalar_type());
  p.k_splits = f.k_splits;
  return p;
}
#endif

}  // namespace

bool gemv_fused_applies(const Tensor& x, const Tensor& w, const GemvFusion& fusion) {
  return decode_options().fused_gemv && fused_elementwise_applies({x, w}) && gemv_problem(x, w, fusion).empty();
}

namespace {

// Whether gemv_fused runs y = f(x) W^T as a one-product gemv_chain: persistent blocks streaming W
// by TMA have no ragged last wave of row blocks. Measured on an H200 at the 1.3B shapes (1 / 8
// rows, chain kernel vs the GEMV kernel; bench/results/gemv_chain_h200.txt): 9248 x 2048
// 13.9 / 13.5 vs 14.5 / 15.1 us, 2048 x 3072 6.1 / 8.1 vs 7.8 / 8.4; but the LM head (525 MB)
// 125 vs 124 and w2 with its SiLU·mul prologue at 8 rows 12.6 vs 11.3 (every block stages all
// of x), so not those. (11264 x 2048 alone is 16.3 vs 15.2 at 1 row but 15.8 vs 16.6 at 8; the
// blocks of the 1.3B presets chain it with its neighbours anyway.)
constexpr double kChainedProductMaxBytes = 128e6;
bool runs_as_chain(const Tensor& w, const GemvFusion& f) {
  return !f.silu_mul && f.k_splits == 0 &&
         static_cast<double>(w.numel()) * w.element_size() <= kChainedProductMaxBytes;
}

}  // namespace

Tensor gemv_fused(const Tensor& x, const Tensor& w, const GemvFusion& f) {
  const char* op = "gemv_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = gemv_problem(x, w, f);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  if (runs_as_chain(w, f)) {
    ChainProduct product{w};
    product.fusion = f;
    if (auto out = gemv_chain_fused(x, {product}); !out.empty()) return out[0];
  }
#ifdef LT2_WITH_CUDA
  const int64_t K = w.size(1), N = w.size(0), x_dim = f.silu_mul ? 2 * K : K;
  c10::cuda::CUDAGuard guard(x.device());
  // Rows 16-byte aligned: the kernels read x (and b = x[:, K:]) with 16-byte loads.
  const auto x2 = with_aligned_rows(x.reshape({-1, x_dim}));  // [M, x_dim]
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options().memory_format(torch::MemoryFormat::Contiguous));
  const auto g2 = aligned_x_gate(f, K);
  auto p = gemv_params(x2, w, f, g2, y);
  p.pdl = decode_options().pdl_for("gemv");
  kernels::gemv(p, current_stream(x));
  return y;
#else
  no_cuda(op);
#endif
}

namespace {

// Why gemv_chain_fused cannot take the chain (empty when it can); out_sizes gets each product's
// output sizes.
std::string gemv_chain_problem(const Tensor& x, const std::vector<ChainProduct>& products,
                               std::vector<std::vector<int64_t>>& out_sizes) {
  if (!x.defined()) return "x is undefined";
  if (products.empty() || products.size() > static_cast<size_t>(kernels::kGemvChainMaxProducts))
    return cat("1..", kernels::kGemvChainMaxProducts, " products, found ", products.size());
  std::vector<int64_t> x_sizes = x.sizes().vec();
  for (size_t i = 0; i < products.size(); ++i) {
    const auto& pr = products[i];
    GemvFusion f = pr.fusion;
    const bool earlier = pr.residual_of >= 0;
    if (earlier) {
      if (static_cast<size_t>(pr.residual_of) >= i || f.residual.defined())
        return cat("product ", i, ": residual_of ", pr.residual_of, " must name an earlier product (and no residual tensor)");
      f.residual = Tensor();
    }
    if (auto p = gemv_problem(x_sizes, x, pr.w, f); !p.empty()) return cat("product ", i, ": ", p);
    if (f.k_splits != 0) return cat("product ", i, ": a chain does not split K");
    if (pr.silu_mul_out && (pr.w.size(0) % 2 != 0 || f.residual.defined() || earlier))
      return cat("product ", i, ": the SiLU·mul epilogue needs W's two halves (N even, found ", pr.w.size(0),
                 ") and no residual");
    x_sizes.back() = pr.silu_mul_out ? pr.w.size(0) / 2 : pr.w.size(0);  // this product's output, the next one's x
    if (earlier && out_sizes[pr.residual_of] != x_sizes)
      return cat("product ", i, ": its output ", torch::IntArrayRef(x_sizes), " and product ", pr.residual_of,
                 "'s (its residual) ", torch::IntArrayRef(out_sizes[pr.residual_of]), " differ");
    out_sizes.push_back(x_sizes);
  }
  return "";
}

}  // namespace

std::vector<Tensor> gemv_chain_fused(const Tensor& x, const std::vector<ChainProduct>& products) {
  std::vector<std::vector<int64_t>> out_sizes;
  if (!decode_options().gemv_chain || !fused_elementwise_applies({x}) || !gemv_chain_problem(x, products, out_sizes).empty())
    return {};
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  kernels::GemvChainParams params;
  params.products = static_cast<int>(products.size());
  std::vector<Tensor> outputs, gates;  // gates: aligned x_gates, alive until the launch
  Tensor input = with_aligned_rows(x.reshape({-1, x.size(-1)}));
  for (size_t i = 0; i < products.size(); ++i) {
    const auto& pr = products[i];
    GemvFusion f = pr.fusion;
    if (pr.residual_of >= 0) f.residual = outputs[pr.residual_of];
    outputs.push_back(torch::empty(out_sizes[i], x.options().memory_format(torch::MemoryFormat::Contiguous)));
    gates.push_back(aligned_x_gate(f, pr.w.size(1)));
    params.product[i] = gemv_params(input, pr.w, f, gates.back(), outputs.back());
    params.product[i].silu_mul_out = pr.silu_mul_out;
    input = outputs.back().view({-1, out_sizes[i].back()});
  }
  params.max_slots = decode_options().gemv_chain_slots;
  params.pdl = decode_options().pdl_for("gemv_chain");
  if (!kernels::gemv_chain_problem(params, x.get_device()).empty()) return {};
  kernels::gemv_chain(params, current_stream(x));
  return outputs;
#else
  return {};
#endif
}

namespace {

// Why gemv_batched cannot take x, W and gate (empty when it can); x's layout does not matter.
std::string gemv_batched_problem(const Tensor& x, const Tensor& w, const Tensor& gate) {
  for (const auto& p : {activation_problem(x, "x"), activation_problem(w, "w")})
    if (!p.empty()) return p;
  if (w.dim() != 3 || !contiguous_aligned(w))
    return cat("w must be a contiguous, 16-byte aligned [J, N, K], found ", w.sizes());
  const int64_t J = w.size(0), N = w.size(1), K = w.size(2);
  if (x.dim() != 3 || x.size(1) != J || x.size(2) != K)
    return cat("x must be [M, ", J, ", ", K, "] for w ", w.sizes(), ", found ", x.sizes());
  if (gate.defined() && (gate.sizes() != torch::IntArrayRef({x.size(0), J, N}) || gate.stride(-1) != 1))
    return cat("gate must be [", x.size(0), ", ", J, ", ", N, "] with a contiguous last dim, found ", gate.sizes());
  for (const Tensor* t : {&w, &gate})
    if (t->defined() && (t->scalar_type() != x.scalar_type() || t->device() != x.device()))
      return cat("w and gate must be ", x.scalar_type(), " on ", x.device(), " like x");
  if (J > 65535) return cat(J, " products (at most 65535)");
#ifdef LT2_WITH_CUDA
  if (!kernels::gemv_supported(x.size(0), K, kernel_dtype(x.scalar_type())))
    return cat(x.size(0), " rows of K = ", K, ": the GEMV takes 1..", kernels::kGemvMaxRows,
               " rows and K a whole number of 16-byte vectors");
#endif
  return "";
}

}  // namespace

bool gemv_batched_applies(const Tensor& x, const Tensor& w, const Tensor& gate) {
  return fused_elementwise_applies({x, w}) && gemv_batched_problem(x, w, gate).empty();
}

void gemv_batched(const Tensor& x, const Tensor& w, const Tensor& out, const Tensor& gate) {
  const char* op = "gemv_batched";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = gemv_batched_problem(x, w, gate);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const int64_t M = x.size(0), J = w.size(0), N = w.size(1), K = w.size(2);
  LT2_CHECK(out.defined() && out.sizes() == torch::IntArrayRef({M, J, N}) && out.stride(-1) == 1 &&
                out.scalar_type() == x.scalar_type() && out.device() == x.device(),
            op, ": out must be [", M, ", ", J, ", ", N, "] ", x.scalar_type(), " on ", x.device(),
            " with a contiguous last dim, found ", sizes_of(out));
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  const auto xc = with_aligned_rows(x);  // the kernels read x with 16-byte loads
  kernels::GemvParams p{};
  p.x = xc.data_ptr(), p.x_row_stride = xc.stride(0), p.x_batch_stride = xc.stride(1);
  p.w = w.data_ptr(), p.w_batch_stride = N * K;
  p.y = out.data_ptr(), p.y_row_stride = out.stride(0), p.y_batch_stride = out.stride(1);
  if (gate.defined())
    p.y_gate = gate.data_ptr(), p.y_gate_row_stride = gate.stride(0), p.y_gate_batch_stride = gate.stride(1);
  p.prologue = kernels::GemvPrologue::None;
  p.rows = M, p.n = N, p.k = static_cast<int>(K), p.batch = J;
  p.dtype = kernel_dtype(x.scalar_type());
  p.pdl = decode_options().pdl_for("gemv");
  kernels::gemv(p, current_stream(x));
#endif
}

}  // namespace ops
}  // namespace lt2
