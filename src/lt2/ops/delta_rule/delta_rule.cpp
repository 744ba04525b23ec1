#include "lt2/ops/delta_rule/delta_rule.h"

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

// Whether delta_rule_chunked runs its loop over the chunks as the CUDA kernel: fp32 on CUDA,
// nothing for autograd to record (the kernel has no backward, so training keeps the loop), dims
// the kernel serves, and DecodeOptions::delta_rule_scan on.
bool use_chunk_scan_kernel(const Tensor& v, torch::ScalarType dt, int64_t K, int64_t V, int64_t C,
                           std::initializer_list<const Tensor*> inputs) {
  if (!decode_options().delta_rule_scan || !v.is_cuda() || dt != torch::kFloat32) return false;
  if (torch::GradMode::is_enabled())
    for (const Tensor* t : inputs)
      if (t->defined() && t->requires_grad()) return false;
  return delta_rule_chunk_scan_supported(K, V, C, v.device());
}

}  // namespace

bool delta_rule_chunk_scan_supported(int64_t K, int64_t V, int64_t C, const torch::Device& device) {
#ifdef LT2_WITH_CUDA
  if (!device.is_cuda() || K > INT32_MAX || V > INT32_MAX || C > INT32_MAX) return false;  // the kernel checks the rest
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  return kernels::delta_rule_scan_supported(static_cast<int>(K), static_cast<int>(V), static_cast<int>(C), index);
#else
  return false;
#endif
}

ChunkScanResult delta_rule_chunk_scan_cuda(const Tensor& q_start, const Tensor& w, const Tensor& u,
                                           const Tensor& a, const Tensor& kt, const Tensor& carry,
                                           const Tensor& initial_state, int value_block) {
  const char* op = "delta_rule_chunk_scan_cuda";
#ifdef LT2_WITH_CUDA
  auto shape = [](const Tensor& t) { return t.defined() ? cat(t.sizes()) : std::string("undefined"); };
  LT2_CHECK(q_start.defined() && q_start.dim() == 5 && u.defined() && u.dim() == 5, op,
            ": q_start must be [B, H, N, C, K] and u [B, H, N, C, V], found ", shape(q_start), " and ",
            shape(u));
  const int64_t B = q_start.size(0), H = q_start.size(1), N = q_start.size(2), C = q_start.size(3),
                K = q_start.size(4), V = u.size(4);
  const auto device = q_start.device();
  LT2_CHECK(device.is_cuda(), op, ": the inputs must be CUDA tensors, found q_start on ", device);
  // t: defined, the given shape, float32 on q_start's device.
  auto check = [&](const Tensor& t, std::vector<int64_t> expected, const char* name) {
    LT2_CHECK(t.defined() && t.sizes() == torch::IntArrayRef(expected), op, ": ", name, " must be ",
              torch::IntArrayRef(expected), ", found ", shape(t));
    LT2_CHECK(t.scalar_type() == torch::kFloat32 && t.device() == device, op, ": ", name,
              " must be float32 on ", device, ", found ", t.scalar_type(), " on ", t.device());
  };
  check(q_start, {B, H, N, C, K}, "q_start");
  check(w, {B, H, N, C, K}, "w");
  check(u, {B, H, N, C, V}, "u");
  check(a, {B, H, N, C, C}, "a");
  check(kt, {B, H, N, K, C}, "kt");
  const bool per_channel = carry.defined() && carry.dim() == 5 && carry.size(3) == K && K != 1;
  check(carry, {B, H, N, per_channel ? K : 1, 1}, "carry (per head [B, H, N, 1, 1] or per key channel)");
  if (initial_state.defined()) check(initial_state, {B, H, K, V}, "initial_state");
  LT2_CHECK(delta_rule_chunk_scan_supported(K, V, C, device), op, ": no kernel for K ", K, ", V ", V, ", C ", C,
            " on ", device, " (needs K and C multiples of 4, K <= ", kernels::kMaxScanHeadK, ", C <= ",
            kernels::kMaxScanChunk, ", V a multiple of 8)");

  // Packed, 16-byte aligned copies where the inputs are not (a contiguous view may start anywhere).
  auto packed = [](const Tensor& t) {
    auto c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const auto wc = packed(w), uc = packed(u), ktc = packed(kt), cc = packed(carry);
  const auto s0 = initial_state.defined() ? packed(initial_state) : Tensor();
  c10::cuda::CUDAGuard guard(device);
  auto states = torch::empty({B, H, N, K, V}, wc.options());  // S_n, the state at chunk n's start
  auto v_new = torch::empty({B, H, N, C, V}, wc.options());
  auto S = torch::empty({B, H, K, V}, wc.options());

  kernels::DeltaRuleScanParams p{};
  p.w = wc.data_ptr<float>();
  p.u = uc.data_ptr<float>();
  p.kt = ktc.data_ptr<float>();
  p.carry = cc.data_ptr<float>();
  p.initial_state = s0.defined() ? s0.data_ptr<float>() : nullptr;
  p.states = states.data_ptr<float>();
  p.v_new = v_new.data_ptr<float>();
  p.final_state = S.data_ptr<float>();
  LT2_CHECK(N <= INT32_MAX, op, ": ", N, " chunks (at most ", INT32_MAX, ")");
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(H), p.chunks = static_cast<int>(N);
  p.chunk_size = static_cast<int>(C), p.head_k = static_cast<int>(K), p.head_v = static_cast<int>(V);
  p.per_channel_carry = per_channel;
  p.value_block = value_block;
  kernels::delta_rule_scan(p, detail::current_stream(wc));
  // O_n = Q_n S_n + A_n V_new for every chunk at once (nothing in the recurrence depends on them).
  auto o = torch::matmul(q_start, states).add_(torch::matmul(a, v_new));  // [B, H, N, C, V]
  return {o, S};
#else
  detail::no_cuda(op);
#endif
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
  const int64_t N = Q.size(2);
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

  auto S = initial_or_zero_state(initial_state, B, H, K, V, dt, v.device());  // [B, H, K, V]
  if (use_chunk_scan_kernel(v, dt, K, V, C, {&q, &k, &v, &beta, &g, &initial_state})) {
    auto r = delta_rule_chunk_scan_cuda(Q_start, W, U, Aqk, K_end.transpose(-1, -2), state_carry,
                                        initial_state.defined() ? S : Tensor());
    return {from_chunks(r.o, T).to(v.scalar_type()), r.final_state};
  }
  // unbind, not select: one backward node per tensor instead of a full-size zero fill per chunk.
  auto U_n = U.unbind(2), W_n = W.unbind(2), Q_n = Q_start.unbind(2), A_n = Aqk.unbind(2);
  auto Kt_n = K_end.transpose(-1, -2).unbind(2), carry_n = state_carry.unbind(2);
  std::vector<Tensor> outs;
  outs.reserve(N);
  for (int64_t n = 0; n < N; ++n) {
    auto V_new = U_n[n] - torch::matmul(W_n[n], S);                               // [B, H, C, V]
    outs.push_back(torch::matmul(Q_n[n], S) + torch::matmul(A_n[n], V_new));       // [B, H, C, V]
    S = carry_n[n] * S + torch::matmul(Kt_n[n], V_new);                            // [B, H, K, V]
  }
  auto O = torch::stack(outs, 2);                                // [B, H, N, C, V]
  return {from_chunks(O, T).to(v.scalar_type()), S};
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
