// Fused CUDA kernels for the decode hot path (one new token per sequence), flash-attention style:
// a params struct per kernel, a launcher that picks the template instance from the dtype and the
// head dims, plain kernels in kernels/cuda/. No libtorch here (ops/fused_decode.h wraps these for
// tensors). Pointers are device pointers; strides count elements; the last dim of every tensor is
// contiguous. Accumulation, gates and recurrent states are fp32 whatever the activation dtype.
// The launchers enqueue on `stream` (a cudaStream_t) and never synchronise, allocate or read
// device memory on the host, so a CUDA graph can capture them.
#pragma once
#include <cstdint>

namespace lt2::kernels {

enum class DType { Float32, BFloat16, Float16 };

// Largest key head dim the recurrent kernels hold in registers (rows of S per block).
constexpr int kMaxRecurrentHeadK = 512;

// Layout of the log-decay g of a recurrent step.
enum class DecayKind {
  None,        // no decay (DeltaNet, linear attention)
  PerHead,     // g [B, H]: one decay per head (GDN, Mamba2, RetNet)
  PerChannel,  // g [B, H, K]: one decay per key channel (KDA, GLA, HGRN2)
};

// One decode token of the linear-recurrence family on already projected inputs, S [B, H, K, V]:
//   S <- exp(g) S                                  (per head or per key channel)
//   delta rule (beta given):  S <- S + k (beta (v - S^T k))^T
//   additive   (beta null):   S <- S + k v^T
//   o = scale S^T q
// Same math as ops::delta_rule_step / ops::gated_linear_step.
struct RecurrentStepParams {
  const void* q;  // [B, H, K] in dtype
  const void* k;  // [B, H, K] in dtype
  const void* v;  // [B, H, V] in dtype
  int64_t q_batch_stride, q_head_stride;
  int64_t k_batch_stride, k_head_stride;
  int64_t v_batch_stride, v_head_stride;
  const float* beta;     // [B, H] contiguous, or nullptr for the additive update
  const float* g;        // log decay, contiguous: [B, H] or [B, H, K] per decay_kind; nullptr for None
  DecayKind decay_kind;
  float* state;          // [B, H, K, V] contiguous, updated in place
  void* o;               // [B, H, V] contiguous, in dtype
  int batch, heads, head_k, head_v;
  float scale;
  DType dtype;
};
void recurrent_step(const RecurrentStepParams& p, void* stream);

// Gated DeltaNet's whole decode step after its input projections, one block per (sequence, head)
// (num_v_heads == num_heads: the block owns its heads' conv channels, so the window shifts do not
// race):
//   q, k, v = SiLU(ShortConv(q_raw | k_raw | v_raw))      conv windows advanced in place
//   q, k    = x * rsqrt(sum(x^2) + 1e-6)                   (L2 norm over K)
//   beta    = sigmoid(b_raw) (x2 with allow_neg_eigval),   g = -exp(A_log) softplus(a_raw + dt_bias)
//   S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = scale S^T q
//   y = o * rsqrt(mean(o^2) + eps) * norm_weight * silu(gate)   (no gate factor when gate is null)
struct GdnDecodeParams {
  const void* q_raw;  // [B, H*K] (batch stride q_stride)
  const void* k_raw;  // [B, H*K]
  const void* v_raw;  // [B, H*V]
  const void* a_raw;  // [B, H]
  const void* b_raw;  // [B, H]
  const void* gate;   // [B, H*V], or nullptr without the output gate
  int64_t q_stride, k_stride, v_stride, a_stride, b_stride, gate_stride;
  const void* q_conv_weight;  // [H*K, W] contiguous
  const void* k_conv_weight;  // [H*K, W]
  const void* v_conv_weight;  // [H*V, W]
  void* q_conv_window;        // [B, W-1, H*K] contiguous: the W-1 previous inputs, oldest first
  void* k_conv_window;        // [B, W-1, H*K]
  void* v_conv_window;        // [B, W-1, H*V]
  const void* A_log;          // [H]
  const void* dt_bias;        // [H]
  const void* norm_weight;    // [V]
  float* state;               // [B, H, K, V] contiguous, updated in place
  void* y;                    // [B, H*V] contiguous
  int batch, heads, head_k, head_v, conv_size;
  float scale, norm_eps;
  bool allow_neg_eigval;
  DType dtype;  // of every non-state tensor above
};
void gdn_decode(const GdnDecodeParams& p, void* stream);

// Flash-decoding: one query token per sequence against its KV cache. Grid = splits x Hkv x B; a
// block takes its sequence's keys [split * c, (split + 1) * c) with c = ceil(len / splits) for all
// G = Hq / Hkv query heads of its kv head (query head i reads kv head i / G), so K and V are read
// once; a combine kernel merges the splits' (max, sum, acc) partials. The split count depends only
// on the shapes (attention_decode_num_splits), never on the lengths, so a captured graph replays
// with new lengths.
constexpr int kAttentionMaxGroups = 8;  // query heads per kv head
constexpr int kAttentionMaxSplits = 128;
struct AttentionDecodeParams {
  const void* q;  // [B, Hq, D]
  int64_t q_batch_stride, q_head_stride;
  const void* k_cache;  // [B, Hkv, Lmax, D], rows 16-byte aligned
  const void* v_cache;  // [B, Hkv, Lmax, D]
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  const int64_t* seq_lens;  // [B]: keys 0..len-1 of sequence b are attended (len in [1, Lmax])
  void* out;                // [B, Hq, D] contiguous
  float* partial_out;       // [B, Hq, splits, D] workspace (unused with one split)
  float* partial_lse;       // [B, Hq, splits] workspace, base-2 log-sum-exp of each split
  int batch, q_heads, kv_heads, head_dim, max_len, num_splits;
  float scale;
  DType dtype;  // of q, the caches and out
};
// Head dims with a kernel instance.
bool attention_decode_head_dim_supported(int head_dim);
// Splits for these shapes on CUDA device `device`: enough blocks to fill the GPU, a few dozen keys
// of cache capacity per split at least, at most kAttentionMaxSplits.
int attention_decode_num_splits(int batch, int kv_heads, int max_len, int device);
void attention_decode(const AttentionDecodeParams& p, void* stream);

}  // namespace lt2::kernels
