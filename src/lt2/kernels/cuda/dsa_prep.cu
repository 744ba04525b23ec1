// DSA latent decode prep (dsa_decode.h: dsa_latent_prep): everything between the packed input
// projection and the attention of a decode step, one launch instead of ~40 small libtorch kernels
// (cos/sin tables from the positions, narrow/cat, the two norms, the cache scatters, the scale).
//
// Work is a few KB per sequence, so the kernel is launch-bound: grid (H + H_I + 2) x B, a block of
// 128 threads per unit of work of one sequence:
//   blocks 0 .. H-1           q head h: RoPE of its rope dims into q
//   blocks H .. H+H_I-1       index head j: RoPE_half of its first r dims, the rest copied;
//                             block H also writes the sequence's scaled index weights
//   block H+H_I               latent key: RMSNorm (a block sum), RoPE, the cache row; the lengths
//   block H+H_I+1             index key: LayerNorm (two block sums), RoPE_half, the cache row
#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/dsa_decode.h"

namespace lt2::kernels {
namespace {

constexpr int kPrepThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kPrepThreads) dsa_latent_prep_kernel(const DsaLatentPrepParams p) {
  dependent_kernel_start();
  __shared__ float scratch[32];
  __shared__ float s_key[kDsaIndexMaxHeadDim];  // the index key after its LayerNorm
  const int b = blockIdx.y, unit = blockIdx.x, tid = threadIdx.x;
  const int64_t pos = p.seq_pos[b];
  const bool in_cache = pos >= 0 && pos < p.max_len;
  const int H = p.heads, HI = p.index_heads, dc = p.latent_dim, dr = p.rope_dim, dI = p.index_head_dim;

  if (unit < H) {
    const T* in = static_cast<const T*>(p.q_raw) + b * p.q_raw_stride + unit * (p.head_dim + dr) + p.head_dim;
    T* out = static_cast<T*>(p.q) + (static_cast<int64_t>(b) * H + unit) * (dc + dr) + dc;
    rope_rotate(in, out, dr, p.interleaved, pos, p.rope_theta);
  } else if (unit < H + HI) {
    const int j = unit - H;
    const T* in = static_cast<const T*>(p.index_q_raw) + b * p.index_q_raw_stride + static_cast<int64_t>(j) * dI;
    T* out = static_cast<T*>(p.index_q) + (static_cast<int64_t>(b) * HI + j) * dI;
    rope_rotate(in, out, p.index_rope_dim, false, pos, p.rope_theta);
    for (int i = p.index_rope_dim + tid; i < dI; i += kPrepThreads) out[i] = in[i];
    if (j == 0) {
      const T* w = static_cast<const T*>(p.index_w_raw) + b * p.index_w_raw_stride;
      for (int i = tid; i < HI; i += kPrepThreads)
        p.index_w[static_cast<int64_t>(b) * HI + i] = to_float(w[i]) * p.index_weight_scale;
    }
  } else if (unit == H + HI) {
    if (tid == 0) p.seq_lens[b] = pos + 1, p.counts[b] = min(pos + 1, p.topk);
    if (!in_cache) return;  // block-uniform
    const T* in = static_cast<const T*>(p.kv_raw) + b * p.kv_raw_stride;
    T* out = static_cast<T*>(p.k_cache) + b * p.k_batch_stride + pos * p.k_row_stride;
    float sum_sq = 0.f;
    for (int i = tid; i < dc; i += kPrepThreads) sum_sq = fmaf(to_float(in[i]), to_float(in[i]), sum_sq);
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / dc + p.kv_norm_eps);
    const T* g = static_cast<const T*>(p.kv_norm_weight);
    for (int i = tid; i < dc; i += kPrepThreads) out[i] = from_float<T>(to_float(in[i]) * inv_rms * to_float(g[i]));
    rope_rotate(in + dc, out + dc, dr, p.interleaved, pos, p.rope_theta);
  } else {
    if (!in_cache) return;
    const T* in = static_cast<const T*>(p.index_k_raw) + b * p.index_k_raw_stride;
    T* out = static_cast<T*>(p.index_keys) + b * p.index_keys_batch_stride + pos * p.index_keys_row_stride;
    float sum = 0.f;
    for (int i = tid; i < dI; i += kPrepThreads) sum += to_float(in[i]);
    const float mean = block_sum(sum, scratch) / dI;
    float sum_sq = 0.f;
    for (int i = tid; i < dI; i += kPrepThreads) {
      const float d = to_float(in[i]) - mean;
      sum_sq = fmaf(d, d, sum_sq);
    }
    const float inv_std = rsqrtf(block_sum(sum_sq, scratch) / dI + p.index_norm_eps);
    const T* g = static_cast<const T*>(p.index_norm_weight);
    const T* beta = static_cast<const T*>(p.index_norm_bias);
    for (int i = tid; i < dI; i += kPrepThreads)
      s_key[i] = (to_float(in[i]) - mean) * inv_std * to_float(g[i]) + to_float(beta[i]);
    __syncthreads();  // RoPE pairs cross threads
    rope_rotate(s_key, out, p.index_rope_dim, false, pos, p.rope_theta);
    for (int i = p.index_rope_dim + tid; i < dI; i += kPrepThreads) out[i] = from_float<T>(s_key[i]);
  }
}

}  // namespace

void dsa_latent_prep(const DsaLatentPrepParams& p, void* stream) {
  LT2_CHECK(dsa_latent_prep_supported(p.batch, p.rope_dim, p.index_head_dim, p.index_rope_dim) && p.heads >= 1 &&
                p.index_heads >= 1 && p.latent_dim >= 1,
            "dsa_latent_prep: batch ", p.batch, " (1..65535), ", p.heads, " heads, ", p.index_heads,
            " index heads (>= 1), rope dims ", p.rope_dim, " and ", p.index_rope_dim, " (even; the index one <= d_I = ",
            p.index_head_dim, " <= ", kDsaIndexMaxHeadDim, ")");
  const dim3 grid(static_cast<unsigned>(p.heads + p.index_heads + 2), static_cast<unsigned>(p.batch));
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    launch_dependent("dsa_latent_prep", dsa_latent_prep_kernel<T>, grid, dim3(kPrepThreads), 0,
                     static_cast<cudaStream_t>(stream), {}, p);
  });
}

}  // namespace lt2::kernels
