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
//   [U | W] = (I + L)^{-1} [diag(beta) V | diag(beta) (K * exp(G))]      (triangular solve)
//   V_new = U - W S
//   O = scale * ((Q * exp(G)) S + Tril(Q K^T decayed) V_new)
//   S <- exp(G_C) S + (K * exp(G_C - G))^T V_new
// Any T (the tail chunk is padded internally). Differentiable through autograd. On CUDA in fp32
// with nothing to differentiate (grad mode off, or no input requiring grad) and dims the kernel
// serves, the loop over the chunks is one kernel launch (delta_rule_chunk_scan_cuda);
// DecodeOptions::delta_rule_scan off keeps the libtorch loop (A/B).
RecurrenceResult delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& beta, const Tensor& g, double scale,
                                    const Tensor& initial_state, int64_t chunk_size);

// The loop of delta_rule_chunked over the chunks on CUDA, for n = 0 .. N-1:
//   V_new = U_n - W_n S;   O_n = Q_n S + A_n V_new;   S <- carry_n * S + Kt_n V_new
// as one kernel launch for the recurrence (kernels/prefill.h: delta_rule_scan, which stores each
// chunk's starting S and V_new) and two batched GEMMs for every O_n.
// q_start, w [B, H, N, C, K], u [B, H, N, C, V], a [B, H, N, C, C], kt [B, H, N, K, C],
// carry [B, H, N, 1 or K, 1] (per head or per key channel), initial_state [B, H, K, V] or
// undefined (zeros): float32 CUDA tensors on one device, any strides (packed copies are made
// where needed). value_block: value columns per block (8, 16, 32), 0 for the launcher's choice.
// Needs dims delta_rule_chunk_scan_supported accepts; throws otherwise. Not differentiable.
struct ChunkScanResult {
  Tensor o;            // [B, H, N, C, V]
  Tensor final_state;  // [B, H, K, V] float32, a new tensor
};
ChunkScanResult delta_rule_chunk_scan_cuda(const Tensor& q_start, const Tensor& w, const Tensor& u,
                                           const Tensor& a, const Tensor& kt, const Tensor& carry,
                                           const Tensor& initial_state, int value_block = 0);
// Whether the kernel serves head dims K, V and chunk size C on `device` (false on CPU or without
// CUDA kernels): K and C multiples of 4 with K <= 256, C <= 64, V a multiple of 8, and its shared
// memory within the device's limit.
bool delta_rule_chunk_scan_supported(int64_t K, int64_t V, int64_t C, const torch::Device& device);

// One decode token: q, k [B, H, K], v [B, H, V], beta [B, H], g undefined / [B, H] / [B, H, K].
// Updates `state` ([B, H, K, V]) in place and returns o [B, H, V] in v's dtype.
Tensor delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                       const Tensor& g, double scale, Tensor& state);

}  // namespace lt2::ops
