#include "lt2/ops/delta_rule.h"

#include <vector>

#include "lt2/ops/chunking.h"
#include "lt2/util/error.h"

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

}  // namespace

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
