// Attention's decode prologue (decode.h: rope_cache_write): RoPE of the new token's q and k at
// per-sequence positions and the k, v rows written into the caches.
//
// A few KB per sequence: launch-bound. Grid (H + 2 H_kv, B), one block of kThreads per head row:
// blocks 0 .. H-1 rotate query head h into q_out, H .. H+H_kv-1 rotate key head j into its cache
// row, the last H_kv copy value head j into its cache row.
#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 64;

template <typename T>
__global__ void __launch_bounds__(kThreads) rope_cache_kernel(const RopeCacheParams p) {
  dependent_kernel_start();
  const int b = blockIdx.y, unit = blockIdx.x, D = p.head_dim;
  const int64_t pos = p.positions[b];
  if (unit < p.heads) {
    const T* in = static_cast<const T*>(p.q) + b * p.q_in_stride + static_cast<int64_t>(unit) * D;
    T* out = static_cast<T*>(p.q_out) + (static_cast<int64_t>(b) * p.heads + unit) * D;
    rope_rotate(in, out, D, p.interleaved, pos, p.theta);
    return;
  }
  if (pos < 0 || pos >= p.max_len) return;  // block-uniform
  const bool is_key = unit < p.heads + p.kv_heads;
  const int j = unit - p.heads - (is_key ? 0 : p.kv_heads);
  if (is_key) {
    const T* in = static_cast<const T*>(p.k) + b * p.k_in_stride + static_cast<int64_t>(j) * D;
    T* out = static_cast<T*>(p.k_cache) + b * p.k_batch_stride + j * p.k_head_stride + pos * p.k_row_stride;
    rope_rotate(in, out, D, p.interleaved, pos, p.theta);
  } else {
    const T* in = static_cast<const T*>(p.v) + b * p.v_in_stride + static_cast<int64_t>(j) * D;
    T* out = static_cast<T*>(p.v_cache) + b * p.v_batch_stride + j * p.v_head_stride + pos * p.v_row_stride;
    for (int i = threadIdx.x; i < D; i += kThreads) out[i] = in[i];
  }
}

}  // namespace

bool rope_cache_write_supported(int batch, int heads, int kv_heads, int head_dim) {
  return batch >= 1 && batch <= 65535 && heads >= 1 && kv_heads >= 1 && heads + 2 * kv_heads <= 65535 &&
         head_dim >= 2 && head_dim % 2 == 0 && head_dim <= kRopeCacheMaxHeadDim;
}

void rope_cache_write(const RopeCacheParams& p, void* stream) {
  LT2_CHECK(rope_cache_write_supported(p.batch, p.heads, p.kv_heads, p.head_dim), "rope_cache_write: batch ",
            p.batch, ", ", p.heads, " query and ", p.kv_heads, " kv heads of head dim ", p.head_dim,
            " (even, at most ", kRopeCacheMaxHeadDim, ")");
  const dim3 grid(static_cast<unsigned>(p.heads + 2 * p.kv_heads), static_cast<unsigned>(p.batch));
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    launch_dependent(p.pdl, "rope_cache_write", rope_cache_kernel<T>, grid, dim3(kThreads), 0,
                     static_cast<cudaStream_t>(stream), {}, p);
  });
}

}  // namespace lt2::kernels
