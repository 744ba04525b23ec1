// Fused CUDA kernels of DeepSeek Sparse Attention's decode-step selection (kernels/dsa_decode.h)
// for tensors: checks, launch on the current CUDA stream, outputs from the caching allocator.
// Nothing here synchronises or reads device memory on the host, and the kernels' grids depend only
// on the shapes, so a CUDA graph captures every entry point and replays it with new lengths.
// Without CUDA kernels in the build the entry points throw. dsa_topk_attention_fused runs the
// selection and the attention over it where the kernels apply, and nothing otherwise.
#pragma once
#include <torch/torch.h>

#include "lt2/config/model_config.h"  // RopeStyle

namespace lt2::ops {

using torch::Tensor;

// Lightning-indexer scores of one new token per sequence against its index-key cache, in fp32:
//   scores[b, j] = sum_h w[b, h] * relu(q[b, h, :] . index_keys[b, j, :])  for j < seq_lens[b],
//   -inf for seq_lens[b] <= j < L (those keys are not read).
// q [B, H_I, d_I] (float32, bfloat16 or float16), w [B, H_I] (any floating dtype, taken in fp32),
// index_keys [B, L, d_I] in q's dtype with a contiguous last dim, seq_lens [B] int64 on q's device
// (1 <= len <= L). H_I <= 128, d_I <= 256; bf16/fp16 with H_I and d_I multiples of 16 and 16-byte
// aligned key rows run on tensor cores. Returns [B, L] fp32; into `out` ([B, L] fp32 contiguous on
// q's device) when it is defined.
Tensor dsa_index_scores(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& seq_lens,
                        const Tensor& out = {});

// dsa_index_scores of G groups of n query rows, a group's rows against that group's index keys (a
// sequence's rows in a whole-sequence call), in one launch: q [G, n, H_I, d_I] (any strides with
// a contiguous last dim), w [G, n, H_I], index_keys [G, L, d_I], seq_lens [G n] int64 (row i of
// group g: entry g n + i). G n <= 65535. Returns [G, n, L] fp32.
Tensor dsa_index_scores_grouped(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& seq_lens);

// Indices [B, k] int64 of the k largest entries of each row of scores [B, L] (float32, may hold
// -inf; 1 <= k <= L): exactly the set topk_indices (ops/sparse_attention/sparse_attention.h) returns for fp32
// scores, ties to the lower index. With seq_lens ([B] int64 on the scores' device), entries
// j >= len count as -inf without being read, and the first min(len, k) indices of a row are its
// entries below len. Order within a row: the entries above the k-th largest key, then those tied
// with it, each in ascending index, then len, len + 1, ... (kernels/dsa_decode.h). Into `out`
// ([B, k] int64 contiguous) when it is defined.
Tensor topk_select(const Tensor& scores, int64_t k, const Tensor& seq_lens = {}, const Tensor& out = {});

// dsa_index_scores then topk_select with seq_lens: the k index-cache slots each sequence's new token
// attends to, [B, k] int64, its valid slots first (the first min(len, k) indices are below len).
Tensor dsa_index_topk(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& seq_lens,
                      int64_t k);
// Whether dsa_index_topk takes these inputs: a build with the CUDA kernels, q [B, H_I, d_I] and
// index_keys [B, L, d_I] CUDA tensors of one kernel dtype and device (H_I <= 128, d_I <= 256, the
// keys' last dim contiguous), 1 <= k <= L.
bool dsa_index_topk_supported(const Tensor& q, const Tensor& index_keys, int64_t k);

// The lightning indexer's backward in whole-sequence training calls (kernels::dsa_index_backward
// has the math): for q [B, n, H_I, d_I] (query row r at position query_start + r, seeing keys
// j <= query_start + r), w [B, n, H_I], index_keys [B, L, d_I] and the loss's gradient d_scores
// [B, n, L] with respect to scores[b, r, j] = sum_h w[b, r, h] relu(q[b, r, h, :] . index_keys[b, j, :]),
// the gradients {dq [B, n, H_I, d_I] bf16, dw [B, n, H_I] fp32, d_keys [B, L, d_I] fp32}. q and
// index_keys bf16 on one CUDA device; w and d_scores any floating dtype (taken in fp32). dq_out, where
// given, is where dq is written (and returned): a bf16 [B, n, H_I, d_I] on q's device with its heads
// packed (strides [., ., d_I, 1]), such as a narrow of the caller's gradient of all the rows.
struct IndexBackward {
  Tensor dq, dw, d_keys;
};
IndexBackward dsa_index_backward(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& d_scores,
                                 int64_t query_start, const Tensor& dq_out = Tensor());
// Whether dsa_index_backward takes q and index_keys: a build with the CUDA kernels, bf16 on one CUDA
// device, 16, 32, 64 or 128 heads of dim 64 or 128 (kernels::dsa_index_backward_supported).
bool dsa_index_backward_supported(const Tensor& q, const Tensor& index_keys);

// The indexer loss's target in whole-sequence training calls on the kernel (kernels::dsa_head_probs
// has the math): from the main attention's scaled scores [B, H, n, keys] and each row's support
// [B, n, keys] bool (shared by the heads; a zero batch stride shares one mask), the head-summed
// attention probabilities on the support, L1-normalised, [B, n, keys] fp32 (0 off the support and on
// rows whose support is empty). What lt2::indexer_kl_loss's target is, without the fp32
// probabilities [B, H, n, keys].
Tensor dsa_head_probs(const Tensor& scores, const Tensor& support);
// Whether dsa_head_probs takes them: a build with the CUDA kernels, scores of a kernel dtype (fp32,
// bf16, fp16) and a bool support on one CUDA device, both with a contiguous last dim, 1..1024 heads,
// at most 65535 sequences.
bool dsa_head_probs_supported(const Tensor& scores, const Tensor& support);

// DSA's decode attention on the kernels: dsa_index_topk of the index queries q_index [B, H_I, d_I]
// and weights w_index [B, H_I] against index_keys, then sparse_attention_decode_fused of q
// [B, H, D_qk] over those k slots of k_cache / v_cache (counts min(seq_lens, k)). Returns
// [B, H, D_v], or undefined, having run nothing, where the fused kernels are off
// (fused_decode_enabled), a gradient is recorded, or either kernel does not take the tensors: the
// caller then selects and attends in libtorch.
Tensor dsa_topk_attention_fused(const Tensor& q_index, const Tensor& w_index, const Tensor& index_keys,
                                const Tensor& seq_lens, int64_t k, const Tensor& q, const Tensor& k_cache,
                                const Tensor& v_cache, double scale);

// The latent form's decode step between its packed input projection and its attention
// (kernels::dsa_latent_prep has the math), for sequence b at position t = seq_pos[b]: RoPE of q's
// rope dims into q[:, :, d_c:], with `absorb` the absorbed q_nope W_uk into q[:, :, :d_c] (without
// it that part is not written: a separate product fills it),
// the latent key row [RMSNorm(c) | RoPE(k_r)] into k_cache[b, 0, t], the index queries (RoPE_half
// on their first index_rope_dim dims) into index_q, the scaled index weights into index_w, and the
// index key (LayerNorm, then RoPE_half) into index_keys[b, t], and the lengths t + 1 and
// min(t + 1, topk) (dsa_index_topk's and sparse_attention_decode's). The inputs are views of the packed
// projection's output (any batch stride, heads packed, last dim contiguous); dims come from the
// shapes: H, D + d_r from q_raw, d_c from kv_norm_weight, d_r = kv_raw's last dim - d_c.
struct DsaLatentPrepArgs {
  Tensor q_raw;        // [B, H, D + d_r]: wq's output, [q_nope | q_rope] per head
  Tensor kv_raw;       // [B, d_c + d_r]: wkv_a's, [c | k_r]
  Tensor index_q_raw;  // [B, H_I, d_I]: index_wq's
  Tensor index_k_raw;  // [B, d_I]: index_wk's
  Tensor index_w_raw;  // [B, H_I]: index_ww's
  Tensor seq_pos;      // [B] int64
  Tensor kv_norm_weight;                      // [d_c]
  Tensor index_norm_weight, index_norm_bias;  // [d_I]
  // [H, d_c, D] contiguous (W_uk transposed, wk_b_t), or undefined: q[b, h, :d_c] = q_raw[b, h, :D] absorb[h]^T
  Tensor absorb;
  double kv_norm_eps = 1e-5, index_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeStyle rope_style = RopeStyle::Interleaved;  // of q's and the latent key's rope dims
  int64_t index_rope_dim = 0;
  double index_weight_scale = 1.0;
  int64_t topk = 1;
  // Outputs.
  Tensor q;           // [B, H, d_c + d_r] contiguous
  Tensor index_q;     // [B, H_I, d_I] contiguous
  Tensor index_w;     // [B, H_I] fp32 contiguous
  Tensor k_cache;     // [B, 1, L, d_c + d_r], rows contiguous
  Tensor index_keys;  // [B, L, d_I], rows contiguous
  Tensor seq_lens;    // [B] int64: seq_pos + 1
  Tensor counts;      // [B] int64: min(seq_pos + 1, topk)
};
// The fused kernel: CUDA tensors on one device, every non-fp32 output and input in one kernel
// dtype (the norm weights are cast to it), d_I <= kernels::kDsaIndexMaxHeadDim; `absorb` only
// where dsa_latent_prep_absorb_supported. One launch; no host read of seq_pos, so a captured graph
// replays with new positions.
void dsa_latent_prep(const DsaLatentPrepArgs& args);
// Whether the kernel takes `absorb` for q_raw [B, H, D + d_r] (d_c + d_r from q's last dim):
// [H, d_c, D] contiguous, 16-byte aligned, in q_raw's dtype on its CUDA device, at most
// kernels::kDsaAbsorbMaxRows sequences, D <= kernels::kDsaAbsorbMaxDim filling whole 16-byte
// vectors. Where it does not, q[:, :, :d_c] takes a separate product (gemv_batched).
bool dsa_latent_prep_absorb_supported(const Tensor& q_raw, const Tensor& q, const Tensor& absorb);
// The same math written plainly in float64 on the CPU (reads seq_pos on the host), results copied
// into the outputs (any device and floating dtype): q[:, :, :d_c] only with `absorb`.
void dsa_latent_prep_reference(const DsaLatentPrepArgs& args);

}  // namespace lt2::ops
