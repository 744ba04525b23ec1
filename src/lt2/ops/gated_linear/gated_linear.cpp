#include "lt2/ops/gated_linear/gated_linear.h"

#include <vector>

#include "lt2/ops/chunking.h"
#include "lt2/util/error.h"

namespace lt2::ops {

namespace {

// One token, functional: q, k [B, H, K], v [B, H, V], decay [B, H, 1 or K, 1] log-gate or
// undefined; S [B, H, K, V]. Returns {o, S'}.
std::pair<Tensor, Tensor> additive_token(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& decay, double scale, Tensor S) {
  if (decay.defined()) S = S * decay.exp();
  S = S + k.unsqueeze(-1) * v.unsqueeze(-2);                       // [B, H, K, V]
  auto o = torch::matmul(q.unsqueeze(-2), S).squeeze(-2) * scale;  // [B, H, V]
  return {o, S};
}

}  // namespace

RecurrenceResult gated_linear_recurrent(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& g, double scale, const Tensor& initial_state) {
  check_recurrence_inputs(q, k, v, g, "gated linear");
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  auto S = initial_or_zero_state(initial_state, B, H, K, V, dt, v.device());
  auto qc = q.to(dt), kc = k.to(dt), vc = v.to(dt);
  std::vector<Tensor> outs;
  outs.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    Tensor decay = g.defined() ? state_decay(g.select(1, t), dt) : Tensor();
    auto [o, S_next] = additive_token(qc.select(1, t), kc.select(1, t), vc.select(1, t), decay, scale, S);
    outs.push_back(o);
    S = S_next;
  }
  return {torch::stack(outs, 1).to(v.scalar_type()), S};
}

RecurrenceResult gated_linear_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& g, double scale, const Tensor& initial_state,
                                      int64_t chunk_size) {
  check_recurrence_inputs(q, k, v, g, "gated linear");
  Fp32Scope fp32;
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  const int64_t C = chunk_size;
  auto Q = to_chunks(q, C, dt);                                   // [B, H, N, C, K]
  auto Kc = to_chunks(k, C, dt);                                  // [B, H, N, C, K]
  auto Vc = to_chunks(v, C, dt);                                  // [B, H, N, C, V]
  auto G = chunk_cumulative_gate(g, B, T, H, C, dt, v.device());  // [B, H, N, C, 1 or K]
  const int64_t N = Q.size(2);
  auto G_last = G.narrow(-2, C - 1, 1);                           // [B, H, N, 1, 1 or K]

  // Intra-chunk (diagonal blocks), parallel over chunks.
  auto O_intra = torch::matmul(decayed_scores(Q, Kc, G, /*inclusive=*/true), Vc) * scale;
  // Inter-chunk: the state at each chunk start, walking the chunks in order.
  auto K_end = Kc * (G_last - G).exp();                           // [B, H, N, C, K]
  auto chunk_writes = torch::matmul(K_end.transpose(-1, -2), Vc);  // [B, H, N, K, V]
  auto state_carry = G_last.exp().transpose(-1, -2);              // [B, H, N, 1 or K, 1]
  auto S = initial_or_zero_state(initial_state, B, H, K, V, dt, v.device());  // [B, H, K, V]
  auto carry_n = state_carry.unbind(2), writes_n = chunk_writes.unbind(2);
  std::vector<Tensor> starts;
  starts.reserve(N);
  for (int64_t n = 0; n < N; ++n) {
    starts.push_back(S);
    S = carry_n[n] * S + writes_n[n];
  }
  auto S_start = torch::stack(starts, 2);                         // [B, H, N, K, V]
  auto O = torch::matmul(Q * G.exp(), S_start) * scale + O_intra;  // [B, H, N, C, V]
  return {from_chunks(O, T).to(v.scalar_type()), S};
}

Tensor gated_linear_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         double scale, Tensor& state) {
  const auto dt = state.scalar_type();
  Tensor decay = g.defined() ? state_decay(g, dt) : Tensor();
  auto [o, S] = additive_token(q.to(dt), k.to(dt), v.to(dt), decay, scale, state);
  state.copy_(S);
  return o.to(v.scalar_type());
}

}  // namespace lt2::ops
