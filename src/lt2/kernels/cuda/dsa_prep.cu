// DSA latent decode prep (dsa_decode.h: dsa_latent_prep): everything between the packed input
// projection and the attention of a decode step, one launch instead of ~40 small libtorch kernels
// (cos/sin tables from the positions, narrow/cat, the two norms, the cache scatters, the scale)
// and, with absorb_w, the q absorption q_nope W_uk (a batched GEMV's launch otherwise).
//
// Work is a few KB per sequence, so the kernel is launch-bound: a 1-D grid of blocks of 128
// threads, first the absorption's units (the longest, placed first), then (H + H_I + 2) units
// per sequence b:
//   absorption unit u         head u / ceil(d_c / 64), 64 latent columns of it for every sequence:
//                             each weight element is read once a step
//   unit 0 .. H-1             q head h: RoPE of its rope dims into q
//   unit H .. H+H_I-1         index head j: RoPE_half of its first r dims, the rest copied;
//                             unit H also writes the sequence's scaled index weights
//   unit H+H_I                latent key: RMSNorm (a block sum), RoPE, the cache row; the lengths
//   unit H+H_I+1              index key: LayerNorm (two block sums), RoPE_half, the cache row
#include <cuda_pipeline.h>

#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/dsa_decode.h"

namespace lt2::kernels {
namespace {

constexpr int kPrepThreads = 128;
// The q absorption: a unit's 64 columns (latent dims) x two halves of the head dim D, one thread
// each; the two halves' sums meet in shared memory for kAbsorbPassRows sequences at a time.
constexpr int kAbsorbCols = kPrepThreads / 2;
constexpr int kAbsorbPassRows = 8;


int absorb_units(const DsaLatentPrepParams& p) {
  return p.absorb_w ? p.heads * ceil_div(p.latent_dim, kAbsorbCols) : 0;
}

// Shared memory of the absorption: the unit's weights [64][D + pad] in T (rows 16 bytes longer
// than D, so the 8 rows a quarter-warp reads start in distinct banks), q_nope of its head in fp32
// [B][D], the second halves' sums [kAbsorbPassRows][64].
__host__ __device__ int absorb_pitch(const DsaLatentPrepParams& p, int element_bytes) {
  return p.head_dim + 16 / element_bytes;
}
size_t absorb_smem_bytes(const DsaLatentPrepParams& p, int element_bytes) {
  if (!p.absorb_w) return 0;
  return static_cast<size_t>(kAbsorbCols) * absorb_pitch(p, element_bytes) * element_bytes +
         sizeof(float) * (static_cast<size_t>(p.batch) * p.head_dim + kAbsorbPassRows * kAbsorbCols);
}

// Absorption unit `unit`: q[b, h, n] = q_raw[b, h, :D] . absorb_w[h, n, :] for every sequence b and
// the unit's 64 columns n, fp32, rounded once. The weights are no kernel's output: their copies
// into shared memory start before the dependency wait, overlapping the end of the kernel before.
// Thread (column tid % 64, half tid / 64) then sums over its half of D's 16-byte chunks.
template <typename T>
__device__ void absorb_q(const DsaLatentPrepParams& p, int unit, unsigned char* smem) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  const int tid = threadIdx.x, col = tid % kAbsorbCols, half = tid / kAbsorbCols;
  const int H = p.heads, D = p.head_dim, dc = p.latent_dim, B = p.batch, pitch = absorb_pitch(p, sizeof(T));
  const int col_blocks = ceil_div(dc, kAbsorbCols), h = unit / col_blocks, n0 = unit % col_blocks * kAbsorbCols;
  const int chunks = D / VEC, cols = min(kAbsorbCols, dc - n0);
  T* s_w = reinterpret_cast<T*>(smem);                                          // [64][pitch]
  float* s_x = reinterpret_cast<float*>(smem + sizeof(T) * kAbsorbCols * pitch);  // [B][D]
  float* s_part = s_x + B * D;                                                  // [kAbsorbPassRows][64]
  const T* w = static_cast<const T*>(p.absorb_w) + (static_cast<int64_t>(h) * dc + n0) * D;
  for (int i = tid; i < cols * chunks; i += kPrepThreads)
    __pipeline_memcpy_async(s_w + (i / chunks) * pitch + (i % chunks) * VEC, w + i * VEC, 16);
  cp_async_commit();
  dependent_kernel_start();

  const T* q_raw = static_cast<const T*>(p.q_raw) + static_cast<int64_t>(h) * (D + p.rope_dim);
  for (int i = tid; i < B * D; i += kPrepThreads) s_x[i] = to_float(q_raw[(i / D) * p.q_raw_stride + i % D]);
  cp_async_wait<0>();
  __syncthreads();  // the weights and q_nope are in place
  const int span = ceil_div(chunks, 2), c0 = half * span;
  const int mine = col < cols ? min(span, chunks - c0) : 0;  // this thread's chunks
  const T* w_row = s_w + col * pitch + c0 * VEC;
  T* q = static_cast<T*>(p.q) + static_cast<int64_t>(h) * (dc + p.rope_dim) + n0 + col;
  for (int b0 = 0; b0 < B; b0 += kAbsorbPassRows) {
    const int rows = min(kAbsorbPassRows, B - b0);
    float acc[kAbsorbPassRows] = {};
#pragma unroll 2
    for (int i = 0; i < mine; ++i) {
      float wf[VEC];
      unpack16<T>(*reinterpret_cast<const uint4*>(w_row + i * VEC), wf);
#pragma unroll
      for (int r = 0; r < kAbsorbPassRows; ++r) {
        if (r >= rows) continue;
        const float* x = s_x + (b0 + r) * D + (c0 + i) * VEC;  // one address per warp: a broadcast
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
          const float4 v = *reinterpret_cast<const float4*>(x + e);
          acc[r] = fmaf(wf[e + 3], v.w, fmaf(wf[e + 2], v.z, fmaf(wf[e + 1], v.y, fmaf(wf[e], v.x, acc[r]))));
        }
      }
    }
    if (half == 1) {
#pragma unroll
      for (int r = 0; r < kAbsorbPassRows; ++r)
        if (r < rows) s_part[r * kAbsorbCols + col] = acc[r];
    }
    __syncthreads();
    if (half == 0 && col < cols) {
#pragma unroll
      for (int r = 0; r < kAbsorbPassRows; ++r)
        if (r < rows)
          q[static_cast<int64_t>(b0 + r) * H * (dc + p.rope_dim)] = from_float<T>(acc[r] + s_part[r * kAbsorbCols + col]);
    }
    __syncthreads();  // s_part is free for the next pass
  }
}

template <typename T>
__global__ void __launch_bounds__(kPrepThreads)
    dsa_latent_prep_kernel(const DsaLatentPrepParams p, const int absorb_units) {
  extern __shared__ __align__(16) unsigned char s_absorb[];
  if (static_cast<int>(blockIdx.x) < absorb_units) return absorb_q<T>(p, blockIdx.x, s_absorb);
  dependent_kernel_start();
  __shared__ float scratch[32];
  __shared__ float s_key[kDsaIndexMaxHeadDim];  // the index key after its LayerNorm
  const int H = p.heads, HI = p.index_heads, dc = p.latent_dim, dr = p.rope_dim, dI = p.index_head_dim;
  const int units = H + HI + 2, b = (blockIdx.x - absorb_units) / units, unit = (blockIdx.x - absorb_units) % units;
  const int tid = threadIdx.x;
  const int64_t pos = p.seq_pos[b];
  const bool in_cache = pos >= 0 && pos < p.max_len;

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
  const int element_bytes = p.dtype == DType::Float32 ? 4 : 2;
  LT2_CHECK(!p.absorb_w || dsa_latent_prep_absorb_supported(p.batch, p.head_dim, element_bytes),
            "dsa_latent_prep: the q absorption takes 1..", kDsaAbsorbMaxRows, " sequences and head dims of at most ",
            kDsaAbsorbMaxDim, " filling whole 16-byte vectors, found batch ", p.batch, ", head dim ", p.head_dim);
  const int absorbing = absorb_units(p);
  const dim3 grid(static_cast<unsigned>(absorbing + (p.heads + p.index_heads + 2) * p.batch));
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const size_t smem = absorb_smem_bytes(p, sizeof(T));
    reserve_shared<dsa_latent_prep_kernel<T>>(smem, "dsa_latent_prep");
    launch_dependent_on_small_grid(p.pdl, "dsa_latent_prep", dsa_latent_prep_kernel<T>, grid, dim3(kPrepThreads), smem,
                                   static_cast<cudaStream_t>(stream), {}, p, absorbing);
  });
}

}  // namespace lt2::kernels
