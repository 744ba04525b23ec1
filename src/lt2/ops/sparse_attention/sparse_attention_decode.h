// Sparse attention of one decode token over selected cache rows (DSA's top-k tokens, NSA's
// selected blocks): the entry point sparse_attention_decode, which takes the fused CUDA kernel
// (kernels/sparse_attention_decode.h) where it applies and the libtorch reference otherwise; the
// kernel entry point and the reference. The kernel entry point checks its inputs, launches on the
// current CUDA stream and takes its output and workspaces from the caching allocator; nothing
// synchronises or reads device memory on the host, so a CUDA graph can capture it. Without CUDA
// kernels in the build (LT2_CUDA=OFF) it throws and sparse_attention_decode_supported is false.
#pragma once
#include <torch/torch.h>

namespace lt2::ops {

using torch::Tensor;

// The math below: sparse_attention_decode_fused where the fused kernels are on
// (fused_decode_enabled), no gradient is recorded and the kernel takes the tensors
// (sparse_attention_decode_supported, with `absorb` sparse_attention_absorb_supported);
// sparse_attention_decode_reference on the caches cast to q's dtype otherwise.
Tensor sparse_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& indices, const Tensor& counts, double scale,
                               const Tensor& absorb = {}, const Tensor& gate = {});

// The kernel. q [B, Hq, Dk] (one new token per sequence), k_cache [B, Hkv, L, Dk], v_cache
// [B, Hkv, L, Dv] (Hq a multiple of Hkv; query head h reads kv head h / (Hq / Hkv)), indices [B, n] int64: the
// selected cache rows of sequence b, shared by its kv heads, counts [B] int64: only the first
// counts[b] entries of row b are used (1 <= counts[b] <= n; the used entries lie in [0, L)):
//   out[b, h] = sum_{j < counts[b]} softmax_j(scale q[b, h] . k[b, kv, r_j]) v[b, kv, r_j],
//   r_j = indices[b, j], kv = h / (Hq / Hkv)
// Returns [B, Hq, Dv] in q's dtype. v_cache may be a view of k_cache's first Dv dims (the MLA
// latent form, v = k.narrow(-1, 0, Dv)): each row is then read once.
//
// Fused kernel: CUDA tensors of one dtype (float32, bfloat16, float16), (Dk, Dv) in (64, 64),
// (128, 128), (256, 256), (576, 512), at most 16 query heads per kv head, cache rows contiguous
// and 16-byte aligned (any batch, head and row strides); indices and counts on q's device. The
// split count depends on the shapes only, so a captured graph replays with new counts, indices
// and queries.
//
// With `absorb` (DSA's latent form: W_uv transposed, [Hq, Dy, Dv]) the output absorption and the
// gate are folded into the splits' combine, and it returns y [B, Hq, Dy] in q's dtype:
//   y[b, h] = (out[b, h] absorb[h]^T) * sigmoid(gate[b, h])   (gate [B, Hq, Dy], or no gate)
// out in fp32, never rounded; y rounded once. Only where sparse_attention_absorb_supported.
Tensor sparse_attention_decode_fused(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                     const Tensor& indices, const Tensor& counts, double scale,
                                     const Tensor& absorb = {}, const Tensor& gate = {});
// Whether sparse_attention_decode_fused takes these tensors (the CUDA kernels are built, device,
// dtypes, head dims, groups, cache alignment).
bool sparse_attention_decode_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache);
// Whether it also folds in `absorb` (and `gate`): [Hq, Dy, Dv] contiguous and 16-byte aligned, gate
// [B, Hq, Dy] with a contiguous last dim, both in q's dtype on its device; at most
// kernels::kSparseAbsorbMaxRows sequences, Dv a multiple of 64 up to 512, Dy <= kSparseAbsorbMaxDim.
bool sparse_attention_absorb_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                       const Tensor& absorb, const Tensor& gate = {});

// The same math in libtorch ops on any device and floating dtype: gather the selected rows, masked
// softmax and both products in fp32 (float64 for float64 inputs), then (with `absorb`) the
// absorption and the gate, output in q's dtype. Entries past counts[b] are never gathered.
Tensor sparse_attention_decode_reference(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                         const Tensor& indices, const Tensor& counts, double scale,
                                         const Tensor& absorb = {}, const Tensor& gate = {});

}  // namespace lt2::ops
