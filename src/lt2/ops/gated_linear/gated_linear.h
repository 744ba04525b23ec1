// The additive (gated linear attention) family, state S [B, H, K, V]:
//   S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T,   o_t = scale * S_t^T q_t
// with the log-gate g_t (<= 0):
//   undefined     linear attention (no decay)
//   [B, T, H]     one decay per head: Mamba2/SSD (q = C, k = B, v = dt x, g = dt A, scale 1),
//                 RetNet (g = log gamma_h, constant), simple GLA
//   [B, T, H, K]  one decay per key channel: GLA, HGRN2 (k = 1 - exp(g))
// Layout [B, T, H, D] as in flash-linear-attention; q/k/v share the head count (the mixer
// broadcasts shared or grouped heads before calling). Computes in fp32 (fp64 for fp64 inputs);
// the output has v's dtype, the final state the compute dtype.
#pragma once
#include <optional>

#include "lt2/ops/delta_rule/delta_rule.h"  // RecurrenceResult

namespace lt2::ops {

// The per-channel log-decay of GLA and HGRN2 from raw logits x [B, T, C] (columns packed, rows strided
// as a slice of a packed projection is):
//   g = log_sigmoid(x) / normalizer   in dtype `dt` (the accumulation dtype)
// and with complement_dtype also k = 1 - exp(g) in that dtype (HGRN2's input gate). Differentiable. On
// CUDA in fp32 (DecodeOptions::log_sigmoid_gate on) one kernel each way, reading x in place; otherwise
// the libtorch form.
struct LogSigmoidGates {
  Tensor g;           // [B, T, C]
  Tensor complement;  // [B, T, C], or undefined without complement_dtype
};
LogSigmoidGates log_sigmoid_gates(const Tensor& x, double normalizer, torch::ScalarType dt,
                                  std::optional<torch::ScalarType> complement_dtype);

// x [B, T, H, P] scaled per head by s [B, T, H] (Mamba2's values v = dt x): x * s[..., None] in x's dtype,
// the product in fp32 and rounded once. Differentiable in x and s (s's gradient in s's dtype). On CUDA
// with s in fp32 (DecodeOptions::scale_heads on) one kernel each way, reading x in place where a token's
// values are packed (a column slice of a projection); otherwise the libtorch form.
Tensor scale_heads(const Tensor& x, const Tensor& s);

// Naive token-by-token recurrence: the reference. initial_state [B, H, K, V] or undefined (zeros).
RecurrenceResult gated_linear_recurrent(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& g, double scale, const Tensor& initial_state);

// Chunked form (SSD block decomposition / gated chunk form): within a chunk of C tokens, with G
// the chunk-local cumulative log-gate and S the state at the chunk start,
//   O = scale * ((Q * exp(G)) S + Tril(Q K^T decayed by exp(G_i - G_j)) V)
//   S <- exp(G_C) S + (K * exp(G_C - G))^T V
// Where gated_linear_prepare_serves holds, the chunk preparation kernel in its additive mode (one
// launch forward, one backward), the chunk scan without W and the chunk outputs kernel. Otherwise
// the preparation in libtorch ops, and the states at the chunk starts: up to
// DecodeOptions::gated_prefix_chunks chunks (by default 128 on the CPU, any number on CUDA), one
// decay-weighted prefix sum over the chunks' writes (a [N + 1, N] product per head or key channel:
// no loop over the chunks in either pass, but N^2 work and memory); beyond, the delta rule's chunk
// scan without W (linear in N, one kernel launch on CUDA; delta_rule.h: run_chunked_form).
RecurrenceResult gated_linear_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& g, double scale, const Tensor& initial_state,
                                      int64_t chunk_size);

// Whether the gated linear family's chunked forms prepare their chunks with the CUDA kernels
// (delta_rule.h: prepare_chunks_kernel without beta): chunk_prepare_kernel_serves (one decay per
// head or none, C 64, K and V multiples of 16 with K <= 128, ...) and
// DecodeOptions::gated_linear_prepare on.
bool gated_linear_prepare_serves(const Tensor& q, const Tensor& v, const Tensor& g, int64_t chunk_size);

// The chunked form over documents packed into one row (flash-linear-attention's cu_seqlens), as
// delta_rule_chunked_varlen: q, k [1, T, H, K], v [1, T, H, V], g undefined, [1, T, H] or
// [1, T, H, K]; document d holds tokens cu_seqlens[d] .. cu_seqlens[d + 1] - 1; each is chunked on
// its own and no state crosses a boundary. The recurrence over the chunks is the delta rule's
// chunk_state_scan without W (one kernel launch on CUDA), whose resets start each document; the
// preparation the kernel's additive mode over the documents' padded rows where
// gated_linear_prepare_serves holds.
// initial_states [D, H, K, V] or undefined (zeros). Returns o [1, T, H, V] and each document's
// final state [D, H, K, V]. Differentiable.
RecurrenceResult gated_linear_chunked_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                             double scale, const Tensor& initial_states,
                                             const std::vector<int64_t>& cu_seqlens, int64_t chunk_size);

// One decode token: q, k [B, H, K], v [B, H, V], g undefined / [B, H] / [B, H, K]. Updates
// `state` ([B, H, K, V]) in place and returns o [B, H, V] in v's dtype.
Tensor gated_linear_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         double scale, Tensor& state);

}  // namespace lt2::ops
