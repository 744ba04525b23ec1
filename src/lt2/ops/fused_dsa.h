// Fused CUDA kernels of DeepSeek Sparse Attention's decode-step selection (kernels/dsa_decode.h)
// for tensors: checks, launch on the current CUDA stream, outputs from the caching allocator.
// Nothing here synchronises or reads device memory on the host, and the kernels' grids depend only
// on the shapes, so a CUDA graph captures every entry point and replays it with new lengths.
// Without CUDA kernels in the build the entry points throw. Callers gate on fused_decode_enabled()
// (ops/fused_decode.h) and dsa_index_topk_supported.
#pragma once
#include <torch/torch.h>

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

// Indices [B, k] int64 of the k largest entries of each row of scores [B, L] (float32, may hold
// -inf; 1 <= k <= L): exactly the set topk_indices (ops/sparse_attention.h) returns for fp32
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

}  // namespace lt2::ops
