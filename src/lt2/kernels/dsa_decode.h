// Fused CUDA kernels for the decode step of DeepSeek Sparse Attention's selection: the lightning
// indexer's scores of one new token per sequence against its index-key cache, and the top-k
// selection over them. Same conventions as decode.h: a params struct per kernel, a
// launcher that picks the template instance, plain kernels in kernels/cuda/dsa_index.cu; device
// pointers, strides in elements, the last dim of every tensor contiguous. The launchers enqueue on
// `stream` (a cudaStream_t) and never synchronise, allocate or read device memory on the host, and
// their grids depend only on the shapes, never on the lengths: a CUDA graph captures them and
// replays them with new lengths. No libtorch here (ops/sparse_attention/dsa_decode.h wraps these for tensors).
#pragma once
#include <cstdint>

#include "lt2/kernels/decode.h"  // DType

namespace lt2::kernels {

constexpr int kDsaIndexMaxHeads = 128;    // indexer heads H_I
constexpr int kDsaIndexMaxHeadDim = 256;  // indexer head dim d_I
constexpr int kDsaMaxLength = 1 << 30;    // cache length / scores per row

// Lightning-indexer scores of the new token of every sequence (or of rows in groups that share
// their keys, below), accumulated in fp32:
//   scores[b, j] = sum_h w[b, h] * max(0, q[b, h, :] . keys[b, j, :])   for j < seq_lens[b]
//   scores[b, j] = -inf                                                 for seq_lens[b] <= j < max_len
// Keys at or past a sequence's length are never read.
struct DsaIndexScoresParams {
  const void* q;  // [B, H, D] in dtype
  int64_t q_batch_stride, q_head_stride;
  const float* w;     // [B, H] fp32 contiguous: head weights (scales folded in)
  const void* keys;   // [B, max_len, D] in dtype: the index-key cache
  int64_t k_batch_stride, k_row_stride;
  const int64_t* seq_lens;  // [B]: keys 0..len-1 of sequence b are valid (len in [1, max_len])
  float* scores;            // [B, max_len] fp32 contiguous; every element is written
  int batch, heads, head_dim, max_len;
  DType dtype;  // of q and keys
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
  // Groups of rows sharing their keys (a sequence's query rows in a whole-sequence call): row b is
  // row i = b % rows_per_group of group g = b / rows_per_group, its q at q + g q_group_stride +
  // i q_batch_stride, its keys those of g (k_batch_stride apart). 1: each row its own keys and
  // q_group_stride unused.
  int rows_per_group = 1;
  int64_t q_group_stride = 0;
};
// Whether dsa_index_scores takes these shapes (1..kDsaIndexMaxHeads heads, head dim
// 1..kDsaIndexMaxHeadDim). bf16/fp16 with heads and head dim multiples of 16 and 16-byte aligned
// q and key rows run on tensor cores; everything else on the plain-FMA kernel.
constexpr bool dsa_index_scores_supported(int heads, int head_dim) {
  return heads >= 1 && heads <= kDsaIndexMaxHeads && head_dim >= 1 && head_dim <= kDsaIndexMaxHeadDim;
}
void dsa_index_scores(const DsaIndexScoresParams& p, void* stream);

// The lightning indexer's backward in whole-sequence training calls (ops::indexer_loss_blocked).
// Query row r of sequence b sits at position query_start + r and sees keys j < len_r =
// min(L, query_start + r + 1); with a_h[r, j] = q[b, r, h, :] . keys[b, j, :] and
// g_h[r, j] = d_scores[b, r, j] * w[b, r, h] * (a_h[r, j] > 0) for j < len_r (0 beyond):
//   dq[b, r, h, :] = sum_j g_h[r, j] keys[b, j, :]
//   dw[b, r, h]    = sum_{j < len_r} d_scores[b, r, j] * relu(a_h[r, j])
//   dkeys[b, j, :] = sum_{r, h} g_h[r, j] q[b, r, h, :]
// The products run on tensor cores from bf16 operands (g rounded to bf16, as FlashAttention's
// backward rounds its dS) with fp32 accumulation; every output element is written once (no
// atomics).
struct DsaIndexBackwardParams {
  const void* q;  // [B, rows, H, D] bf16, rows of heads packed (head stride D), 16-byte aligned rows
  int64_t q_batch_stride, q_row_stride;
  const float* w;         // [B, rows, H] fp32 contiguous
  const void* keys;       // [B, L, D] bf16, 16-byte aligned rows
  int64_t k_batch_stride, k_row_stride;
  const float* d_scores;  // [B, rows, L] fp32 contiguous
  void* dq;               // [B, rows, H, D] bf16, heads packed (head stride D), 4-byte aligned
  int64_t dq_batch_stride, dq_row_stride;
  float* dw;              // [B, rows, H] contiguous
  float* dkeys;           // [row_splits, B, L, D] contiguous: one partial sum per split, summed by the caller
  int batch, rows, heads, head_dim, length;
  int64_t query_start;
  int row_splits;         // blocks a key tile's rows are divided among (dsa_index_backward_row_splits)
};
// How many blocks dsa_index_backward divides each key tile's rows among, so that its dkeys grid
// (key tiles x batch x splits) fills the device several times over: at least 1, at most one per
// 32 rows.
int dsa_index_backward_row_splits(int batch, int rows, int length);
// Whether dsa_index_backward takes these dims (its template instances): 16, 32, 64 or 128 heads of
// dim 64 or 128 (a warp's fp32 accumulators of 16 rows x D stay in registers).
constexpr bool dsa_index_backward_supported(int heads, int head_dim) {
  return (heads == 16 || heads == 32 || heads == 64 || heads == 128) && (head_dim == 64 || head_dim == 128);
}
void dsa_index_backward(const DsaIndexBackwardParams& p, void* stream);

// The indexer loss's target in whole-sequence training calls (ops::indexer_loss_blocked): the main
// attention's probabilities on each row's support, summed over the heads and L1-normalised. For row
// r of sequence b with support S = {j : support[b, r, j]} (the same for every head):
//   probs[b, r, j] = (1 / H) sum_h exp(s_h[j] - m_h) / sum_{i in S} exp(s_h[i] - m_h)   for j in S
//   probs[b, r, j] = 0                                                                 otherwise
// with s_h = scores[b, h, r, :] (the scaled products q k^T, fp32 arithmetic on the stored values)
// and m_h their maximum over S; a row with an empty support is all 0. Each head's softmax sums to 1
// on S, so dividing by H is the L1 normalisation. One block per row.
struct DsaHeadProbsParams {
  const void* scores;  // [B, H, rows, keys] in dtype, last dim contiguous
  int64_t s_batch_stride, s_head_stride, s_row_stride;
  const bool* support;  // [B, rows, keys], last dim contiguous (a zero batch stride shares one mask)
  int64_t m_batch_stride, m_row_stride;
  float* probs;  // [B, rows, keys] fp32 contiguous; every element is written
  int batch, heads, rows, keys;
  DType dtype;  // of the scores
};
constexpr int kDsaHeadProbsMaxHeads = 1024;
void dsa_head_probs(const DsaHeadProbsParams& p, void* stream);

// The indices of the k largest scores of every row, ordered by (score descending, lower index
// first): exactly the set lt2::topk_indices (ops/sparse_attention/sparse_attention.h) returns for fp32 scores
// (-0 == +0; -inf entries rank among themselves by lower index). With seq_lens, entries j >= len
// are taken to be -inf without being read (as dsa_index_scores writes them). Order within a row of
// `indices` (deterministic, not sorted by score): the entries whose key's high digits, as far as
// the radix passes examined them, exceed those of the k-th largest, in ascending index; then the
// selected entries sharing its digits (its ties, when all 32 bits were examined), in ascending
// index; then (seq_lens given, k > len) len, len + 1, ..., k - 1. So the first min(len, k)
// indices are the row's valid entries. One thread-block cluster per row: needs sm_90.
struct TopkSelectParams {
  const float* scores;      // [B, length] fp32 contiguous (may hold -inf)
  const int64_t* seq_lens;  // [B], or nullptr: every entry of a row takes part
  int64_t* indices;         // [B, k] contiguous
  int batch, length, k;     // 1 <= k <= length
  int max_blocks = 0;       // cap on the cluster's blocks; 0: the largest the device places
  bool pdl = true;          // a programmatic dependent launch where the grid is small
};
void topk_select(const TopkSelectParams& p, void* stream);

// The latent form's decode step between its packed input projection and its attention (mixers/
// dsa.h), in one launch. For sequence b at position t = seq_pos[b]:
//   q[b, h, d_c:]         = RoPE(q_raw[b, h, D:])                    (per head h; q[b, h, :d_c] is
//                                                                     left for the absorbed q_nope W_uk)
//   k_cache[b, t, :]      = [RMSNorm(kv_raw[b, :d_c]) | RoPE(kv_raw[b, d_c:])]
//   index_q[b, j, :]      = [RoPE_half(index_q_raw[b, j, :r]) | index_q_raw[b, j, r:]]     (r = index_rope_dim)
//   index_w[b, j]         = index_w_raw[b, j] * index_weight_scale                         (fp32)
//   index_keys[b, t, :]   = RoPE_half on the first r dims of LayerNorm(index_k_raw[b])
//   seq_lens[b] = t + 1,  counts[b] = min(t + 1, topk)      (what the index top-k and the attention take)
// and, with absorb_w (the q absorption, else a separate batched GEMV's), for every head h:
//   q[b, h, :d_c]         = q_raw[b, h, :D] absorb_w[h]^T       (absorb_w [H, d_c, D]: W_uk transposed)
// RMSNorm: x rsqrt(mean(x^2) + eps) * kv_norm_weight; LayerNorm: (x - mean) rsqrt(var + eps) *
// weight + bias (biased variance), both in fp32. RoPE (model/rope.h) on n dims at position t:
// pair i (i < n/2) rotates by t * theta^(-2i/n), the angle and its cos/sin in float64; pairs are
// (2i, 2i + 1) with `interleaved`, else (i, i + n/2) (RoPE_half always). One rounding per output.
// Positions are read on the device (no host sync: a captured graph replays with new ones); a
// position outside [0, max_len) writes no cache row.
struct DsaLatentPrepParams {
  const void* q_raw;        // [B, H, D + d_r], heads D + d_r apart: wq's output
  const void* kv_raw;       // [B, d_c + d_r]: wkv_a's
  const void* index_q_raw;  // [B, H_I, d_I], heads d_I apart: index_wq's
  const void* index_k_raw;  // [B, d_I]: index_wk's
  const void* index_w_raw;  // [B, H_I]: index_ww's
  int64_t q_raw_stride, kv_raw_stride, index_q_raw_stride, index_k_raw_stride, index_w_raw_stride;  // per sequence
  const int64_t* seq_pos;             // [B]
  const void* kv_norm_weight;         // [d_c]
  const void* index_norm_weight;      // [d_I]
  const void* index_norm_bias;        // [d_I]
  const void* absorb_w;               // [H, d_c, D] contiguous, 16-byte aligned, or nullptr (q[:, :, :d_c] unwritten)
  void* q;                            // [B, H, d_c + d_r] contiguous
  void* k_cache;                      // [B, max_len, d_c + d_r], rows k_row_stride apart
  int64_t k_batch_stride, k_row_stride;
  void* index_q;                      // [B, H_I, d_I] contiguous
  float* index_w;                     // [B, H_I] contiguous
  void* index_keys;                   // [B, max_len, d_I], rows index_keys_row_stride apart
  int64_t index_keys_batch_stride, index_keys_row_stride;
  int64_t* seq_lens;                  // [B]
  int64_t* counts;                    // [B]
  int64_t topk;
  int batch, heads, head_dim, latent_dim, rope_dim;     // B, H, D, d_c, d_r
  int index_heads, index_head_dim, index_rope_dim;      // H_I, d_I, r
  int max_len;
  double rope_theta;
  bool interleaved;  // the RoPE layout of q's and the latent key's rope dims
  float kv_norm_eps, index_norm_eps, index_weight_scale;
  DType dtype;  // of every tensor above but seq_pos and index_w
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
};
// Whether dsa_latent_prep takes these dims (even rope dims, r <= d_I <= kDsaIndexMaxHeadDim, a
// batch of at most 65535).
constexpr bool dsa_latent_prep_supported(int batch, int rope_dim, int index_head_dim, int index_rope_dim) {
  return batch >= 1 && batch <= 65535 && rope_dim % 2 == 0 && index_rope_dim % 2 == 0 && index_rope_dim >= 0 &&
         index_rope_dim <= index_head_dim && index_head_dim <= kDsaIndexMaxHeadDim;
}
// The q absorption's limits: at most kDsaAbsorbMaxRows sequences, head dims D of at most
// kDsaAbsorbMaxDim that fill whole 16-byte vectors (a work unit holds its 64 weight rows and every
// sequence's q_nope in shared memory).
constexpr int kDsaAbsorbMaxRows = 32;
constexpr int kDsaAbsorbMaxDim = 128;
constexpr bool dsa_latent_prep_absorb_supported(int batch, int head_dim, int element_bytes) {
  return batch >= 1 && batch <= kDsaAbsorbMaxRows && head_dim >= 1 && head_dim <= kDsaAbsorbMaxDim &&
         head_dim * element_bytes % 16 == 0;
}
void dsa_latent_prep(const DsaLatentPrepParams& p, void* stream);

}  // namespace lt2::kernels
