#include "lt2/ops/gated_linear/gated_linear.h"

#include <limits>
#include <utility>
#include <vector>

#include "lt2/ops/chunking.h"
#include "lt2/ops/decode_options.h"
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

namespace {

// The gated linear family's ChunkPrep for the chunk scan (delta_rule.h), from the shared reads and
// writes: no delta-rule correction (w undefined), so the scan's V_n = U_n = V.
ChunkPrep additive_prep(ChunkPrep reads_and_writes, const Tensor& Vc) {
  reads_and_writes.u = Vc;
  return reads_and_writes;
}

}  // namespace

bool gated_linear_prepare_serves(const Tensor& q, const Tensor& v, const Tensor& g, int64_t chunk_size) {
  return decode_options().gated_linear_prepare && chunk_prepare_kernel_serves(q, v, g, chunk_size);
}

RecurrenceResult gated_linear_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& g, double scale, const Tensor& initial_state,
                                      int64_t chunk_size) {
  check_recurrence_inputs(q, k, v, g, "gated linear");
  Fp32Scope fp32;
  const int64_t T = q.size(1);
  if (gated_linear_prepare_serves(q, v, g, chunk_size))
    return run_chunked_form(prepare_chunks_kernel(q, k, v, Tensor(), g, scale, chunk_size), initial_state, T,
                            v.scalar_type());
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), H = q.size(2), K = q.size(3), V = v.size(3);
  const int64_t C = chunk_size;
  auto Q = to_chunks(q, C, dt);                                   // [B, H, N, C, K]
  auto Kc = to_chunks(k, C, dt);                                  // [B, H, N, C, K]
  auto Vc = to_chunks(v, C, dt);                                  // [B, H, N, C, V]
  auto G = chunk_cumulative_gate(g, B, T, H, C, dt, v.device());  // [B, H, N, C, 1 or K]
  const int64_t N = Q.size(2);
  auto prep = chunk_reads_and_writes(Q, Kc, G, scale);
  const int64_t prefix_chunks = decode_options().gated_prefix_chunks;
  if (N > (prefix_chunks >= 0 ? prefix_chunks : v.is_cuda() ? std::numeric_limits<int64_t>::max() : 128))
    return run_chunked_form(additive_prep(std::move(prep), Vc), initial_state, T, v.scalar_type());

  // Inter-chunk: S_n = c_{n-1} S_{n-1} + X_{n-1} with X_m = K_end_m^T V_m and c_m = exp(a_m),
  // a_m = G_last_m, unrolled as one product over the chunks: with P_n = a_0 + .. + a_{n-1},
  //   S_n = exp(P_n) S_0 + sum_{m < n} exp(P_n - P_{m+1}) X_m,      n = 0 .. N (S_N the final state)
  // (a decay-weighted prefix sum; every exponent <= 0, the masked ones -inf).
  auto X = torch::matmul(prep.kt, Vc);                            // [B, H, N, K, V]
  const int64_t Kd = G.size(-1);                                  // 1 (per head) or K (per channel)
  auto a = G.select(-2, C - 1).transpose(-1, -2);                 // [B, H, Kd, N]: G_last
  auto P = torch::constant_pad_nd(a.cumsum(-1), {1, 0});          // [B, H, Kd, N + 1]: P_0 = 0
  auto rel = P.unsqueeze(-1) - P.narrow(-1, 1, N).unsqueeze(-2);  // [B, H, Kd, N + 1, N]: P_n - P_{m+1}
  auto keep = torch::ones({N + 1, N}, torch::TensorOptions().dtype(torch::kBool).device(v.device())).tril(-1);
  auto D = rel.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity()).exp();
  const auto Xs = Kd == 1 ? X.reshape({B, H, N, K * V}) : X.permute({0, 1, 3, 2, 4});  // the products' layout
  // S_n for n in [first, first + count): the chunk starts (0, N) and the final state (N, 1), each
  // packed as the next product reads it.
  auto states = [&](int64_t first, int64_t count) {
    const auto Dn = D.narrow(-2, first, count);
    Tensor S = Kd == 1 ? torch::matmul(Dn.squeeze(2), Xs).view({B, H, count, K, V})
                       : torch::matmul(Dn, Xs).permute({0, 1, 3, 2, 4});  // per channel row
    if (initial_state.defined()) {
      auto from_s0 = P.narrow(-1, first, count).exp().transpose(-1, -2).unsqueeze(-1);  // [B, H, count, Kd, 1]
      S = S + from_s0 * initial_state.to(dt).unsqueeze(2);
    }
    return S.contiguous();
  };
  const auto S_start = states(0, N);                              // [B, H, N, K, V]
  // O = Q_start S_n + A_qk V (the diagonal blocks), as the scan's form computes it.
  auto O = chunk_outputs(prep.q_start, S_start, prep.a_qk, Vc);  // [B, H, N, C, V]
  return {from_chunks(O, T, v.scalar_type()), states(N, 1).squeeze(2)};
}

RecurrenceResult gated_linear_chunked_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                             double scale, const Tensor& initial_states,
                                             const std::vector<int64_t>& cu_seqlens, int64_t chunk_size) {
  const char* op = "gated_linear_chunked_varlen";
  check_recurrence_inputs(q, k, v, g, op);
  Fp32Scope fp32;
  const auto dt = accum_dtype(v);
  const DocumentChunks docs(cu_seqlens, q.size(1), chunk_size, v.device(), op);
  return chunked_form_varlen(docs, q, v, initial_states, [&] {
    if (gated_linear_prepare_serves(q, v, g, chunk_size))
      return prepare_chunks_kernel(q, k, v, Tensor(), g, scale, chunk_size, &docs);
    return additive_prep(chunk_reads_and_writes(docs.to_chunks(q, dt), docs.to_chunks(k, dt),
                                                docs.cumulative_gate(g, q.size(2), dt), scale),
                         docs.to_chunks(v, dt));
  });
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
