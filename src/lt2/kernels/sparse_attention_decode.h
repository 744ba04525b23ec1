// Sparse flash-decoding: one new query token per sequence attends to a LIST of selected rows of
// its KV cache (DeepSeek Sparse Attention's top-k tokens, NSA's selected blocks and window). Same
// conventions as decode.h: a params struct, a launcher that picks the
// template instance, plain kernels in kernels/cuda/sparse_attention_decode.cu; device pointers,
// strides in elements, the last dim of every tensor contiguous, fp32 accumulation. The launcher
// enqueues on `stream` (a cudaStream_t) and never synchronises, allocates or reads device memory
// on the host; its grid depends only on the shapes, so a captured graph replays with new counts
// and indices. No libtorch here (ops/sparse_attention/sparse_attention_decode.h wraps it for tensors).
#pragma once
#include <cstdint>

#include "lt2/kernels/decode.h"  // DType

namespace lt2::kernels {

constexpr int kSparseAttentionMaxGroups = 16;  // query heads per kv head
constexpr int kSparseAttentionMaxSplits = 128;

// For every sequence b and query head h (kv head hkv = h / G, G = Hq / Hkv):
//   out[b, h] = sum_{j < counts[b]} softmax_j(scale * q[b, h] . k[b, hkv, r_j]) v[b, hkv, r_j],
//   r_j = indices[b, j]
// Grid = splits x Hkv x B: a block takes a slice of whole tiles (16 keys; 32 in the latent
// preset's tensor-core form) of its sequence's index list for all G query heads of its kv head,
// so each selected row is read once per kv head; a combine kernel merges the splits' (max, sum,
// acc) partials.
//
// The values may be the keys themselves (MLA's latent form, DSA's preset): v_cache == k_cache
// with equal strides and head_dim_v <= head_dim_k makes the value of a row its first head_dim_v
// dims, read with the key (one load per row).
struct SparseAttentionDecodeParams {
  const void* q;  // [B, Hq, Dk], rows 16-byte aligned
  int64_t q_batch_stride, q_head_stride;
  const void* k_cache;  // [B, Hkv, Lmax, Dk], rows 16-byte aligned
  const void* v_cache;  // [B, Hkv, Lmax, Dv], rows 16-byte aligned; may alias k_cache (above)
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  // [B, n] contiguous: the selected cache rows of sequence b, the same for every kv head. Only
  // the first counts[b] entries are read; they must lie in [0, Lmax) (out-of-range entries are
  // clamped into it, which keeps the reads in bounds but is not a meaningful selection).
  const int64_t* indices;
  const int64_t* counts;  // [B]: entries used per sequence, in [1, n] (clamped to [0, n]; 0: zeros)
  void* out;              // [B, Hq, Dv] contiguous
  float* partial_out;     // [B, Hq, splits, Dv] workspace (unused with one split)
  float* partial_lse;     // [B, Hq, splits] workspace, base-2 log-sum-exp of each split
  int batch, q_heads, kv_heads, head_dim_k, head_dim_v, max_len, n, num_splits;
  float scale;
  DType dtype;  // of q, the caches, out, absorb_w, gate and y
  // The latent form's output absorption folded into the combine (absorb_w set; out unused):
  //   y[b, h, :] = (out[b, h, :] absorb_w[h]^T) * sigmoid(gate[b, h, :])   (no sigmoid without gate)
  // from the splits' fp32 partials, out never rounded, y rounded once. The splits then leave
  // partials even when there is one, so the workspace holds at least one split.
  const void* absorb_w = nullptr;  // [Hq, Dy, Dv] contiguous, 16-byte aligned (W_uv transposed)
  const void* gate = nullptr;      // [B, Hq, Dy] with a contiguous last dim, or nullptr
  int64_t gate_batch_stride = 0, gate_head_stride = 0;
  void* y = nullptr;               // [B, Hq, Dy] contiguous
  int absorb_dim = 0;              // Dy
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
};

// (Dk, Dv) pairs with a kernel instance: (64, 64), (128, 128), (256, 256) and the latent
// (576, 512); 1..kSparseAttentionMaxGroups query heads per kv head. No device code, so it links
// in a build without CUDA.
inline bool sparse_attention_decode_supported(int head_dim_k, int head_dim_v, int groups) {
  const bool dims = (head_dim_k == head_dim_v &&
                     (head_dim_k == 64 || head_dim_k == 128 || head_dim_k == 256)) ||
                    (head_dim_k == 576 && head_dim_v == 512);
  return dims && groups >= 1 && groups <= kSparseAttentionMaxGroups;
}

// Whether the combine can fold the output absorption in: at most kSparseAbsorbMaxRows sequences,
// Dv a multiple of 64 of at most 512 (a cluster of Dv / 64 blocks per head, each contracting 64 of
// o's dims), 1 <= Dy <= kSparseAbsorbMaxDim (a thread per output dim).
constexpr int kSparseAbsorbMaxRows = 32;
constexpr int kSparseAbsorbMaxDim = 128;
constexpr bool sparse_attention_absorb_supported(int batch, int head_dim_v, int absorb_dim) {
  return batch >= 1 && batch <= kSparseAbsorbMaxRows && head_dim_v % 64 == 0 && head_dim_v >= 64 &&
         head_dim_v <= 512 && absorb_dim >= 1 && absorb_dim <= kSparseAbsorbMaxDim;
}

// Splits of the index list for these shapes on CUDA device `device` (n = indices' row length,
// groups = Hq / Hkv): enough blocks to fill the GPU, at least one 16-key tile per split, at most
// kSparseAttentionMaxSplits. Depends on the shapes only, never on counts.
// Callers size the workspace with it and pass it as num_splits.
int sparse_attention_decode_num_splits(int batch, int kv_heads, int groups, int n, int device);

// The splits the launcher actually runs for p on the current device: p.num_splits, or fewer
// (never more) for the tensor-core form of DSA's latent preset (bf16 / fp16, Dk 576, Dv 512 aliased
// in the keys, 16 query heads per kv head), whose longer splits keep the partials and the combine
// small. Its partials fill the first batch x q_heads x used x head_dim_v (and batch x q_heads x
// used) floats of the workspace, laid out as [B, Hq, used, Dv]. Depends on the shapes only.
int sparse_attention_decode_splits_used(const SparseAttentionDecodeParams& p);

void sparse_attention_decode(const SparseAttentionDecodeParams& p, void* stream);

}  // namespace lt2::kernels
