// The combine step of flash-decoding, shared by attention_decode and sparse_attention_decode:
// each split of a row's keys left a normalised partial output o_s and its base-2 log-sum-exp
// lse_s; the row's output is their softmax-weighted mean.
#pragma once
#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
// Internal linkage: every .cu (compiled whole-program, each with its own fatbinary) gets its own
// instances instead of two translation units registering one host stub.
namespace {

constexpr int kCombineThreads = 128;

// A block of kCombineThreads per output row r = blockIdx.x and slice blockIdx.y of its dims
// (grid = rows x slices; more slices spread a long row of many splits over more SMs):
//   out[r] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),  M = max_s lse_s,
// reading partial_out [rows, num_splits, dim] and partial_lse [rows, num_splits] (fp32,
// contiguous; lse -inf marks an empty split) and writing out [rows, dim] contiguous. A row whose
// splits are all empty gets zeros. num_splits <= kMaxSplits.
template <typename T, int kMaxSplits>
__global__ void __launch_bounds__(kCombineThreads)
    combine_splits_kernel(const float* partial_out, const float* partial_lse, T* out, int num_splits,
                          int dim) {
  dependent_kernel_start();  // launched through launch_dependent
  __shared__ float s_w[kMaxSplits];
  const int64_t row = blockIdx.x;
  const int S = num_splits, D = dim;
  const float* lse = partial_lse + row * S;
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) M = fmaxf(M, lse[s]);
  for (int s = threadIdx.x; s < S; s += blockDim.x) s_w[s] = M == -INFINITY ? 0.f : exp2f(lse[s] - M);
  __syncthreads();
  float total = 0.f;
  for (int s = 0; s < S; ++s) total += s_w[s];
  const float inv_total = total > 0.f ? 1.f / total : 0.f;  // 0: an empty row gives zeros
  const float* part = partial_out + row * S * D;
  T* dst = out + row * D;
  for (int d = blockIdx.y * blockDim.x + threadIdx.x; d < D; d += gridDim.y * blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += s_w[s] * part[s * D + d];
    dst[d] = from_float<T>(acc * inv_total);
  }
}

}  // namespace
}  // namespace lt2::kernels
