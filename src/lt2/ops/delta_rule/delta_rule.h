// The gated delta rule family (DeltaNet, Gated DeltaNet and KDA: the WY/UT chunked form), state S [B, H, K, V]:
//   S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t
// with the log-gate g_t (<= 0):
//   undefined     DeltaNet (no decay)
//   [B, T, H]     Gated DeltaNet (one decay per head)
//   [B, T, H, K]  KDA (one decay per key channel)
// Layout [B, T, H, D] as in flash-linear-attention; q/k/v share the head count (the mixer expands
// grouped value heads before calling). Everything runs in fp32 (fp64 for fp64 inputs); the
// output has v's dtype, the final state the compute dtype.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "lt2/ops/chunking.h"

namespace lt2::ops {

using torch::Tensor;

struct RecurrenceResult {
  Tensor o;            // [B, T, H, V]
  Tensor final_state;  // [B, H, K, V]
};

// Naive token-by-token recurrence: the reference. initial_state [B, H, K, V] or undefined (zeros).
RecurrenceResult delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& beta, const Tensor& g, double scale,
                                      const Tensor& initial_state);

// Chunked parallel form (UT/WY transform): within a chunk of C tokens, with G the chunk-local
// cumulative log-gate and S the state at the chunk start,
//   L = StrictTril(diag(beta) (K K^T decayed by exp(G_i - G_j)))
//   [U | W] = (I + L)^{-1} [diag(beta) V | diag(beta) (K * exp(G))]      (unit_lower_inverse)
//   V_new = U - W S
//   O = scale * ((Q * exp(G)) S + Tril(Q K^T decayed) V_new)
//   S <- exp(G_C) S + (K * exp(G_C - G))^T V_new
// Any T (the tail chunk is padded internally). Differentiable. Everything but the recurrence over
// the chunks is batched over all chunks at once; the recurrence is chunk_state_scan (one kernel
// launch on CUDA), and under autograd its backward is the same scan in reverse, so neither pass
// loops over the chunks on the host. On CUDA with fp32 compute, the chunk preparation (L, its
// inverse, U, W, the decayed queries and keys) is one kernel launch from the raw rows, and its
// backward one more (delta_rule_prepare_serves); with one decay per key channel (KDA) the scores
// come from decayed_scores first.
RecurrenceResult delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& beta, const Tensor& g, double scale,
                                    const Tensor& initial_state, int64_t chunk_size);

// Whether delta_rule_chunked prepares its chunks with the CUDA kernels (kernels/prefill.h:
// delta_rule_prepare and its backward) for these inputs: chunk_prepare_kernel_serves and
// DecodeOptions::delta_rule_prepare on.
bool delta_rule_prepare_serves(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                               const Tensor& g, int64_t chunk_size);

// The gates of the gated delta rule from their raw projections (GDN: cols = heads; KDA: one decay
// per key channel, cols = heads * K):
//   g    = -exp(A_log[head of the column]) * softplus(a + dt_bias)   [B, T, cols]
//   beta = beta_scale * sigmoid(b)                                    [B, T, H_b]
// both in the compute dtype (fp32; fp64 for fp64 inputs). a and b may be column slices of one
// packed projection. Differentiable. On CUDA (DecodeOptions::delta_rule_gates on) one kernel launch
// reading them in place, and under autograd one more for the backward (kernels/prefill.h:
// delta_rule_gates_backward); otherwise the libtorch form.
struct DeltaRuleGates {
  Tensor g, beta;
};
DeltaRuleGates delta_rule_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                double beta_scale);

// (I + StrictTril(L))^{-1} for L [..., C, C] (the UT transform's inverse; L's diagonal and upper
// part are not read). Differentiable: dL = -StrictTril(T^T dT T^T). On CUDA in float32 with
// C <= 64 one kernel launch (forward substitution, kernels/prefill.h: unit_lower_inverse);
// otherwise a triangular solve against the identity.
Tensor unit_lower_inverse(const Tensor& L);

// The recurrence over the chunks of the chunked form, S [B, H, K, V]:
//   for n = 0 .. N-1 (N-1 .. 0 when reverse):
//     S = reset_states[resets[n]] where resets[n] >= 0 (packed documents)
//     S_n = S;   V_n = U_n - W_n S;   S = carry_n * S + Kt_n V_n (+ Y_n)
// All tensors of one floating dtype on one device, any strides (resets int32). The gated linear
// family runs it without W (V_n = U_n), its adjoint without Kt.
struct ChunkScanInputs {
  Tensor w;              // [B, H, N, C, K], or undefined: V_n = U_n (the result's v is u itself)
  Tensor u;              // [B, H, N, C, V]
  Tensor kt;             // [B, H, N, K, C], or undefined: no write (w must be given then)
  Tensor carry;          // [B, H, N, 1, 1] per head, or [B, H, N, K, 1] per key channel
  Tensor initial_state;  // [B, H, K, V], or undefined for zeros
  Tensor addend;         // [B, H, N, K, V] Y_n, or undefined for none
  bool reverse = false;
  Tensor resets;         // [N] int32 (B 1): >= 0 restarts S at chunk n, -1 continues; or undefined
  Tensor reset_states;   // [D, H, K, V] the states resets[n] names, or undefined for zeros
};
struct ChunkScanResult {
  Tensor states;       // [B, H, N, K, V]: S_n, the state entering chunk n
  Tensor v;            // [B, H, N, C, V]: V_n
  Tensor final_state;  // [B, H, K, V]: S after the last chunk processed, a new tensor
};
// Not differentiable. One kernel launch (chunk_state_scan_cuda) for float32 CUDA inputs with dims
// the kernel serves, unless DecodeOptions::delta_rule_scan is off; otherwise a loop of libtorch
// ops over the chunks (the reference).
ChunkScanResult chunk_state_scan(const ChunkScanInputs& in);
// sum over the last dim of x * y, [..., V] -> [..., 1]: one CUDA kernel reading each once (fp32 CUDA
// tensors of one shape, V a multiple of 4), else a product and a sum. Not differentiable (the
// scan's backward uses it for the decay gradient).
Tensor last_dim_dots(const Tensor& x, const Tensor& y);
// The forward scan (no addend, chunk order) for autograd: the backward runs the adjoint
// recurrence, G_N = dS_final and for n = N-1 .. 0
//   dV_n = dV_n(out) + Kt_n^T G_{n+1};   G_n = dS_n(out) + carry_n G_{n+1} - W_n^T dV_n
// as chunk_state_scan in reverse (w := -Kt^T, kt := -W^T, addend := dS_n(out)), then
//   dU_n = dV_n,  dW_n = -dV_n S_n^T,  dKt_n = G_{n+1} V_n^T,  dcarry_n = sum(G_{n+1} * S_n),
//   d(initial_state) = G_0,
// all chunks at once. The states S_n and V_n are kept from the forward pass (the outputs need
// them anyway), so the backward does not rerun the forward scan.
// Packed documents (B 1): doc_starts [D] int64 (ascending, doc_starts[0] = 0) are the chunks where
// documents start; S restarts there from doc_states [D, H, K, V] (undefined: zeros) and the
// initial_state is unused. The backward restarts its state gradient at zero after each
// document's last chunk but the row's last (which takes final_state's gradient), and gives
// d(doc_states[d]) = dS_n(out) + carry_n G_{n+1} - W_n^T dV_n at the document's first chunk n.
// w undefined (the gated linear family): V_n = U_n, and the adjoint runs without its Kt.
ChunkScanResult chunk_state_scan_differentiable(const Tensor& w, const Tensor& u, const Tensor& kt,
                                                const Tensor& carry, const Tensor& initial_state,
                                                const Tensor& doc_starts = {}, const Tensor& doc_states = {});
// The kernel behind chunk_state_scan: float32 CUDA tensors on one device (packed copies are made
// where needed). value_block: value columns per block (8, 16, 32), 0 for the launcher's choice.
// Throws on dims chunk_state_scan_supported refuses.
ChunkScanResult chunk_state_scan_cuda(const ChunkScanInputs& in, int value_block = 0);
// Whether the kernel serves head dims K, V and chunk size C on `device` (false on CPU or without
// CUDA kernels): K and C multiples of 4 with K <= 256, C <= 64, V a multiple of 8, and its shared
// memory within the device's limit.
bool chunk_state_scan_supported(int64_t K, int64_t V, int64_t C, const torch::Device& device);

// The chunked form over documents packed into one row (flash-linear-attention's cu_seqlens):
// q, k [1, T, H, K], v [1, T, H, V], beta [1, T, H], g as for delta_rule_chunked over the same T;
// document d holds tokens cu_seqlens[d] .. cu_seqlens[d + 1] - 1 (cu_seqlens[0] = 0, ascending,
// the last = T; empty documents allowed). Each document is chunked on its own and no state crosses
// a boundary: the result equals running each document alone. initial_states [D, H, K, V] or
// undefined (zeros). Returns o [1, T, H, V] and final_state [D, H, K, V] (each document's).
// Differentiable.
RecurrenceResult delta_rule_chunked_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& beta, const Tensor& g, double scale,
                                           const Tensor& initial_states,
                                           const std::vector<int64_t>& cu_seqlens, int64_t chunk_size);

// What the chunked form computes per chunk before the recurrence over the chunks
// (chunk_state_scan), in the compute dtype, chunk layout [B, H, N, ...]: the delta rule's UT
// transform, or for the gated linear family (gated_linear.h) no W (undefined) and U = V, so that
// V_n = V.
struct ChunkPrep {
  Tensor w, u;     // [B, H, N, C, K], [B, H, N, C, V]
  Tensor kt;       // [B, H, N, K, C]: how each chunk writes S
  Tensor carry;    // [B, H, N, 1 or K, 1]: the chunk's decay of S
  Tensor q_start;  // [B, H, N, C, K]: reads S_n
  Tensor a_qk;     // [B, H, N, C, C]: reads V_n
};

// The parts of a ChunkPrep both families share, from chunks Q, Kc [B, H, N, C, K] and G the
// chunk-local cumulative log-gate [B, H, N, C, 1 or K] (w and u left undefined):
//   kt = (K * exp(G_C - G))^T,  carry = exp(G_C),  q_start = scale Q * exp(G),
//   a_qk = scale Tril(Q K^T decayed by exp(G_i - G_j)).
// Differentiable.
ChunkPrep chunk_reads_and_writes(const Tensor& Q, const Tensor& Kc, const Tensor& G, double scale);

// Whether the chunk preparation kernels take these inputs: CUDA, q/k/v fp32 or bf16 with fp32
// compute, g undefined, [B, T, H] or (with DecodeOptions::channel_gate_prepare) [B, T, H, K], chunk
// size 64, K and V multiples of 16 with K <= 128, and DecodeOptions::delta_rule_scan on (the scan
// kernel serving K, V, C).
bool chunk_prepare_kernel_serves(const Tensor& q, const Tensor& v, const Tensor& g, int64_t chunk_size);
// The chunk preparation by those kernels from the raw rows q, k [B, T, H, K], v [B, T, H, V],
// beta [B, T, H], g undefined, [B, T, H] or [B, T, H, K]: the delta rule's ChunkPrep, or with beta
// undefined the gated linear family's (the additive preparation: u = V in fp32, w undefined). One
// decay per key channel takes G (chunk_cumulative_gate) and the intra-chunk scores from
// decayed_scores, whose backward gives their share of the gradients. With `docs` the
// rows are documents packed into one row (B 1), prepared in docs' chunk layout. Differentiable;
// call where chunk_prepare_kernel_serves holds.
ChunkPrep prepare_chunks_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                                double scale, int64_t chunk_size, const DocumentChunks* docs = nullptr);

// O = Q_start S_n + A_qk V_n (chunk_outputs) in the token layout [B, T, H, V] of `dtype`, from
// q_start [B, H, N, C, K], states [B, H, N, K, V], a_qk [B, H, N, C, C] (causal) and v_new
// [B, H, N, C, V]: one CUDA kernel where it serves (fp32 inputs, fp32 or bf16 out, C 64, K and V
// multiples of 16 up to 256, DecodeOptions::delta_rule_output), else chunk_outputs and from_chunks;
// the kernel's backward is one more kernel where K <= 128 (DecodeOptions::delta_rule_output_backward).
// Differentiable.
Tensor chunk_outputs_in_tokens(const Tensor& q_start, const Tensor& states, const Tensor& a_qk, const Tensor& v_new,
                               int64_t T, torch::ScalarType dtype);

// The chunked form from its preparation (chunk layout of to_chunks over T tokens): the recurrence
// over the chunks (chunk_state_scan, one kernel launch on CUDA) from initial_state [B, H, K, V]
// (undefined: zeros), then O = Q_start S_n + A_qk V_n. Returns o [B, T, H, V] in out_dtype and the
// final state. Differentiable.
RecurrenceResult run_chunked_form(const ChunkPrep& prep, const Tensor& initial_state, int64_t T,
                                  torch::ScalarType out_dtype);

// The chunked form over packed documents laid out by `docs`, from their preparation (`prepare`,
// called only when some document is non-empty, returns the ChunkPrep of docs' chunks): the
// recurrence restarts at each document's first chunk from initial_states [D, H, K, V] (undefined:
// zeros). q [1, T, H, K] and v [1, T, H, V] give the shapes and dtypes. Returns o [1, T, H, V] in
// v's dtype and each document's final state [D, H, K, V] (an empty one keeps its initial state).
// Differentiable.
RecurrenceResult chunked_form_varlen(const DocumentChunks& docs, const Tensor& q, const Tensor& v,
                                     const Tensor& initial_states, const std::function<ChunkPrep()>& prepare);

// One decode token: q, k [B, H, K], v [B, H, V], beta [B, H], g undefined / [B, H] / [B, H, K].
// Updates `state` ([B, H, K, V]) in place and returns o [B, H, V] in v's dtype.
Tensor delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                       const Tensor& g, double scale, Tensor& state);

}  // namespace lt2::ops
