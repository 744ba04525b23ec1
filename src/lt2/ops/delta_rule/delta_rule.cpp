#include "lt2/ops/delta_rule/delta_rule.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "lt2/ops/chunking.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                  const Tensor& g) {
  check_recurrence_inputs(q, k, v, g, "delta rule");
  LT2_CHECK(beta.sizes() == q.sizes().slice(0, 3), "delta rule: beta must be [B, T, H], found ",
            beta.sizes());
}

// One token of the recurrence, functional (differentiable). q, k [B, H, K], v [B, H, V],
// beta [B, H], decay [B, H, 1 or K, 1] log-gate or undefined; S [B, H, K, V]. Returns {o, S'}.
std::pair<Tensor, Tensor> delta_token(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& beta, const Tensor& decay, double scale,
                                      Tensor S) {
  if (decay.defined()) S = S * decay.exp();                       // decay first
  auto pred = torch::matmul(k.unsqueeze(-2), S).squeeze(-2);       // [B, H, V] = S^T k
  auto u = beta.unsqueeze(-1) * (v - pred);                        // [B, H, V]
  S = S + k.unsqueeze(-1) * u.unsqueeze(-2);                       // [B, H, K, V]
  auto o = torch::matmul(q.unsqueeze(-2), S).squeeze(-2) * scale;  // [B, H, V] = scale S^T q
  return {o, S};
}

std::string shape_of(const Tensor& t) { return t.defined() ? cat(t.sizes()) : std::string("undefined"); }

// The scan's inputs have consistent shapes, one dtype and one device. Returns {B, H, N, C, K, V}.
std::array<int64_t, 6> check_scan_inputs(const ChunkScanInputs& in, const char* op) {
  LT2_CHECK(in.w.defined() && in.w.dim() == 5 && in.u.defined() && in.u.dim() == 5, op,
            ": w must be [B, H, N, C, K] and u [B, H, N, C, V], found ", shape_of(in.w), " and ", shape_of(in.u));
  const int64_t B = in.w.size(0), H = in.w.size(1), N = in.w.size(2), C = in.w.size(3), K = in.w.size(4),
                V = in.u.size(4);
  const auto dtype = in.w.scalar_type();
  const auto device = in.w.device();
  auto check = [&](const Tensor& t, std::vector<int64_t> expected, const char* name) {
    LT2_CHECK(t.defined() && t.sizes() == torch::IntArrayRef(expected), op, ": ", name, " must be ",
              torch::IntArrayRef(expected), ", found ", shape_of(t));
    LT2_CHECK(t.scalar_type() == dtype && t.device() == device, op, ": ", name, " must be ", dtype, " on ", device,
              " like w, found ", t.scalar_type(), " on ", t.device());
  };
  check(in.u, {B, H, N, C, V}, "u");
  check(in.kt, {B, H, N, K, C}, "kt");
  const bool per_channel = in.carry.defined() && in.carry.dim() == 5 && in.carry.size(3) == K && K != 1;
  check(in.carry, {B, H, N, per_channel ? K : 1, 1}, "carry (per head [B, H, N, 1, 1] or per key channel)");
  if (in.initial_state.defined()) check(in.initial_state, {B, H, K, V}, "initial_state");
  if (in.addend.defined()) check(in.addend, {B, H, N, K, V}, "addend");
  return {B, H, N, C, K, V};
}

// chunk_state_scan as a loop of libtorch ops over the chunks.
ChunkScanResult chunk_state_scan_loop(const ChunkScanInputs& in) {
  const auto [B, H, N, C, K, V] = check_scan_inputs(in, "chunk_state_scan");
  auto S = in.initial_state.defined() ? in.initial_state.clone()
                                      : torch::zeros({B, H, K, V}, in.w.options());
  std::vector<Tensor> states(N), vs(N);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t n = in.reverse ? N - 1 - i : i;
    states[n] = S;
    vs[n] = in.u.select(2, n) - torch::matmul(in.w.select(2, n), S);
    S = in.carry.select(2, n) * S + torch::matmul(in.kt.select(2, n), vs[n]);
    if (in.addend.defined()) S = S + in.addend.select(2, n);
  }
  if (N == 0) return {torch::empty({B, H, 0, K, V}, in.w.options()), torch::empty({B, H, 0, C, V}, in.w.options()), S};
  return {torch::stack(states, 2), torch::stack(vs, 2), S};
}

// Autograd for the forward scan; the formulas are in delta_rule.h (chunk_state_scan_differentiable).
struct ChunkStateScanFunction : public torch::autograd::Function<ChunkStateScanFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& w,
                                                const Tensor& u, const Tensor& kt, const Tensor& carry,
                                                const Tensor& initial_state) {
    auto r = chunk_state_scan({w, u, kt, carry, initial_state, Tensor(), false});
    ctx->save_for_backward({w, kt, carry, r.states, r.v});
    ctx->saved_data["has_initial_state"] = initial_state.defined();
    return {r.states, r.v, r.final_state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &w = saved[0], &kt = saved[1], &carry = saved[2], &states = saved[3], &v = saved[4];
    const Tensor d_states = grads[0], d_final = grads[2];
    const Tensor d_v = grads[1].defined() ? grads[1] : torch::zeros_like(v);
    const auto adjoint = chunk_state_scan({-kt.transpose(-1, -2), d_v, -w.transpose(-1, -2), carry, d_final,
                                           d_states, /*reverse=*/true});
    const Tensor& g_next = adjoint.states;  // G_{n+1}: the gradient of the state leaving chunk n
    auto d_carry = (g_next * states).sum(-1, /*keepdim=*/true);  // [B, H, N, K, 1]
    if (carry.size(3) == 1) d_carry = d_carry.sum(-2, /*keepdim=*/true);
    return {-torch::matmul(adjoint.v, states.transpose(-1, -2)),  // dW
            adjoint.v,                                           // dU
            torch::matmul(g_next, v.transpose(-1, -2)),          // dKt
            d_carry,
            ctx->saved_data["has_initial_state"].toBool() ? adjoint.final_state : Tensor()};
  }
};

}  // namespace

bool chunk_state_scan_supported(int64_t K, int64_t V, int64_t C, const torch::Device& device) {
#ifdef LT2_WITH_CUDA
  if (!device.is_cuda() || K > INT32_MAX || V > INT32_MAX || C > INT32_MAX) return false;  // the kernel checks the rest
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  return kernels::delta_rule_scan_supported(static_cast<int>(K), static_cast<int>(V), static_cast<int>(C), index);
#else
  return false;
#endif
}

ChunkScanResult chunk_state_scan_cuda(const ChunkScanInputs& in, int value_block) {
  const char* op = "chunk_state_scan_cuda";
#ifdef LT2_WITH_CUDA
  const auto [B, H, N, C, K, V] = check_scan_inputs(in, op);
  const auto device = in.w.device();
  LT2_CHECK(device.is_cuda() && in.w.scalar_type() == torch::kFloat32, op,
            ": the inputs must be float32 CUDA tensors, found ", in.w.scalar_type(), " on ", device);
  LT2_CHECK(chunk_state_scan_supported(K, V, C, device), op, ": no kernel for K ", K, ", V ", V, ", C ", C, " on ",
            device, " (needs K and C multiples of 4, K <= ", kernels::kMaxScanHeadK, ", C <= ",
            kernels::kMaxScanChunk, ", V a multiple of 8)");
  LT2_CHECK(N <= INT32_MAX, op, ": ", N, " chunks (at most ", INT32_MAX, ")");
  // Packed, 16-byte aligned copies where the inputs are not (a contiguous view may start anywhere).
  auto packed = [](const Tensor& t) {
    if (!t.defined()) return t;
    auto c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const auto w = packed(in.w), u = packed(in.u), kt = packed(in.kt), carry = packed(in.carry);
  const auto s0 = packed(in.initial_state), addend = packed(in.addend);
  c10::cuda::CUDAGuard guard(device);
  ChunkScanResult r{torch::empty({B, H, N, K, V}, w.options()), torch::empty({B, H, N, C, V}, w.options()),
                    torch::empty({B, H, K, V}, w.options())};
  kernels::DeltaRuleScanParams p{};
  p.w = w.data_ptr<float>();
  p.u = u.data_ptr<float>();
  p.kt = kt.data_ptr<float>();
  p.carry = carry.data_ptr<float>();
  p.addend = addend.defined() ? addend.data_ptr<float>() : nullptr;
  p.initial_state = s0.defined() ? s0.data_ptr<float>() : nullptr;
  p.states = r.states.data_ptr<float>();
  p.v_new = r.v.data_ptr<float>();
  p.final_state = r.final_state.data_ptr<float>();
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(H), p.chunks = static_cast<int>(N);
  p.chunk_size = static_cast<int>(C), p.head_k = static_cast<int>(K), p.head_v = static_cast<int>(V);
  p.per_channel_carry = carry.size(3) == K && K != 1;
  p.reverse = in.reverse;
  p.value_block = value_block;
  kernels::delta_rule_scan(p, detail::current_stream(w));
  return r;
#else
  detail::no_cuda(op);
#endif
}

ChunkScanResult chunk_state_scan(const ChunkScanInputs& in) {
  const auto [B, H, N, C, K, V] = check_scan_inputs(in, "chunk_state_scan");
  if (decode_options().delta_rule_scan && in.w.is_cuda() && in.w.scalar_type() == torch::kFloat32 &&
      chunk_state_scan_supported(K, V, C, in.w.device()))
    return chunk_state_scan_cuda(in);
  return chunk_state_scan_loop(in);
}

ChunkScanResult chunk_state_scan_differentiable(const Tensor& w, const Tensor& u, const Tensor& kt,
                                                const Tensor& carry, const Tensor& initial_state) {
  bool needs_grad = false;
  if (torch::GradMode::is_enabled())
    for (const Tensor* t : {&w, &u, &kt, &carry, &initial_state})
      needs_grad = needs_grad || (t->defined() && t->requires_grad());
  if (!needs_grad) return chunk_state_scan({w, u, kt, carry, initial_state, Tensor(), false});
  auto out = ChunkStateScanFunction::apply(w, u, kt, carry, initial_state);
  return {out[0], out[1], out[2]};
}

RecurrenceResult delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& beta, const Tensor& g, double scale,
                                      const Tensor& initial_state) {
  check_inputs(q, k, v, beta, g);
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  auto S = initial_or_zero_state(initial_state, B, H, K, V, dt, v.device());
  auto qc = q.to(dt), kc = k.to(dt), vc = v.to(dt), bc = beta.to(dt);
  std::vector<Tensor> outs;
  outs.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    Tensor decay = g.defined() ? state_decay(g.select(1, t), dt) : Tensor();
    auto [o, S_next] = delta_token(qc.select(1, t), kc.select(1, t), vc.select(1, t),
                                   bc.select(1, t), decay, scale, S);
    outs.push_back(o);
    S = S_next;
  }
  return {torch::stack(outs, 1).to(v.scalar_type()), S};
}

RecurrenceResult delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& beta, const Tensor& g, double scale,
                                    const Tensor& initial_state, int64_t chunk_size) {
  check_inputs(q, k, v, beta, g);
  Fp32Scope fp32;
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  const int64_t C = chunk_size;
  auto Q = to_chunks(q, C, dt);                                  // [B, H, N, C, K]
  auto Kc = to_chunks(k, C, dt);                                 // [B, H, N, C, K]
  auto Vc = to_chunks(v, C, dt);                                 // [B, H, N, C, V]
  auto b = to_chunks(beta.unsqueeze(-1), C, dt);                 // [B, H, N, C, 1]
  auto G = chunk_cumulative_gate(g, B, T, H, C, dt, v.device());  // [B, H, N, C, 1 or K]
  auto G_last = G.narrow(-2, C - 1, 1);                          // [B, H, N, 1, 1 or K]

  // UT transform: solve (I + L) [U | W] = [diag(beta) V | diag(beta) (K * exp(G))] per chunk.
  auto L = decayed_scores(b * Kc, Kc, G, /*inclusive=*/false);   // [B, H, N, C, C]
  auto rhs = torch::cat({b * Vc, b * Kc * G.exp()}, -1);         // [B, H, N, C, V + K]
  auto UW = torch::linalg_solve_triangular(L, rhs, /*upper=*/false, /*left=*/true,
                                           /*unitriangular=*/true);  // diagonal read as 1
  auto U = UW.narrow(-1, 0, V);                                  // [B, H, N, C, V]
  auto W = UW.narrow(-1, V, K);                                  // [B, H, N, C, K]

  auto Aqk = decayed_scores(Q, Kc, G, /*inclusive=*/true) * scale;  // [B, H, N, C, C]
  auto Q_start = Q * G.exp() * scale;                            // [B, H, N, C, K] reads S
  auto K_end = Kc * (G_last - G).exp();                          // [B, H, N, C, K] writes S
  auto state_carry = G_last.exp().transpose(-1, -2);             // [B, H, N, 1 or K, 1]

  auto s0 = initial_state.defined() ? initial_state.to(dt) : Tensor();
  auto scan = chunk_state_scan_differentiable(W, U, K_end.transpose(-1, -2), state_carry, s0);
  auto O = torch::matmul(Q_start, scan.states) + torch::matmul(Aqk, scan.v);  // [B, H, N, C, V]
  return {from_chunks(O, T).to(v.scalar_type()), scan.final_state};
}

Tensor delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                       const Tensor& g, double scale, Tensor& state) {
  const auto dt = state.scalar_type();
  Tensor decay = g.defined() ? state_decay(g, dt) : Tensor();
  auto [o, S] = delta_token(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), decay, scale, state);
  state.copy_(S);
  return o.to(v.scalar_type());
}

}  // namespace lt2::ops
