// Softmax attention of one decode token per sequence over a KV cache, and attention's decode
// prologue (RoPE and the cache write). attention_decode is the entry point the mixers call: the
// flash-decoding CUDA kernel (kernels/decode.h) where it applies, its libtorch reference
// otherwise. The kernel entry points check their inputs, launch on the current CUDA stream and
// take their outputs from the caching allocator; nothing synchronises or reads device memory on
// the host, so a CUDA graph can capture them. Without CUDA kernels in the build (LT2_CUDA=OFF)
// they throw.
#pragma once
#include <torch/torch.h>

namespace lt2::ops {

using torch::Tensor;

// Attention of q [B, Hq, Dk] (one new token per sequence) over the first seq_lens[b] keys of
// sequence b: k_cache [B, Hkv, L, Dk], v_cache [B, Hkv, L, Dv] (Hq a multiple of Hkv, query head h
// reads kv head h / (Hq / Hkv)), seq_lens [B] int64 on q's device in [1, L]. Returns [B, Hq, Dv]
// in q's dtype: attention_decode_fused where fused_decode_enabled() and attention_decode_supported,
// attention_decode_reference otherwise.
Tensor attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& seq_lens,
                        double scale);
// The same as masked SDPA over the whole cache in libtorch ops (keys at or past a sequence's length
// masked out; the caches cast to q's dtype), on any device and floating dtype.
Tensor attention_decode_reference(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                  const Tensor& seq_lens, double scale);

// Flash-decoding: q [B, Hq, D], k_cache / v_cache [B, Hkv, L, D] in q's dtype (Hq a multiple of
// Hkv; last dim contiguous, rows 16-byte aligned), seq_lens [B] int64 on q's device (keys 0..len-1
// of sequence b are attended, 1 <= len <= L). Returns [B, Hq, D]. The number of key splits depends
// only on the shapes, so a captured graph replays with new lengths.
Tensor attention_decode_fused(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& seq_lens, double scale);
// Whether attention_decode_fused takes these inputs (CUDA, dtype, head dim 64/128/256, at most 8
// query heads per kv head, aligned cache rows).
bool attention_decode_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache);

// Attention's decode prologue in one launch (kernels::rope_cache_write has the math): q [B, H, D]
// and k, v [B, H_kv, D] of the new token (views with contiguous rows, e.g. of a packed projection),
// RoPE'd at positions seq_pos [B] (int64, on their device); k and v go into k_cache / v_cache
// [B, H_kv, L, D] (last dim contiguous) at row seq_pos[b]. Returns the rotated q [B, H, D].
// Every tensor but seq_pos in one kernel dtype on one CUDA device.
Tensor rope_cache_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& seq_pos, double theta, bool interleaved);
// Whether rope_cache_write takes these tensors (what the comment above asks).
bool rope_cache_write_supported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& seq_pos);

// Attention's whole decode step on the kernels: rope_cache_write, then attention_decode_fused of
// the rotated q over the first seq_lens[b] keys. Returns o [B, H, D], or undefined, having run
// nothing, where it does not apply (rope_cache_attention_applies): the caller then runs its
// unfused step.
Tensor rope_cache_attention_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& seq_pos, const Tensor& seq_lens,
                                  double theta, bool interleaved, double scale);
// Whether rope_cache_attention_fused takes these tensors: the fused kernels are on
// (fused_decode_enabled), no gradient is recorded, and both kernels take them.
bool rope_cache_attention_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& seq_pos);

}  // namespace lt2::ops
