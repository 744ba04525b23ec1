// Decode projections (decode.h: gemv): y [M, N] = x [M, K] W^T for M <= kGemvMaxRows rows.
//
// Floor: every weight is read once, N K elements; x (M K) and y (M N) are small and stay in L2.
// At decode a step is a chain of such products, so this is most of a step's bytes.
//
// A block of kThreads threads computes kRowsPerBlock outputs columns (weight rows) for all M rows:
// thread t takes the 16-byte vectors t, t + kThreads, ... of those weight rows (two per trip, so
// 2 kRowsPerBlock loads are in flight per thread) and the matching vectors of x (read through L1:
// every block reads the same x), accumulates in fp32, and the block sums its threads' partials.
// Weights are read with streaming loads: they are touched once per step and would only evict x.
#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kRowsPerBlock = 4;

template <typename T, int M>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const GemvParams p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int R = kRowsPerBlock, WARPS = kThreads / 32;
  __shared__ float partial[WARPS][R * M];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * R;
  const int n_vec = p.k / VEC;
  const uint4* w[R];
#pragma unroll
  for (int r = 0; r < R; ++r)  // rows past N read row N-1 (in bounds) and are not written
    w[r] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + min(n0 + r, p.n - 1) * p.k);
  const T* x = static_cast<const T*>(p.x);

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  auto fma_vec = [&](int v, const uint4 (&wr)[R]) {
    float wf[R][VEC];
#pragma unroll
    for (int r = 0; r < R; ++r) unpack16<T>(wr[r], wf[r]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[VEC];
      unpack16<T>(__ldg(reinterpret_cast<const uint4*>(x + m * p.x_row_stride) + v), xf);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][m] = fmaf(wf[r][e], xf[e], acc[r][m]);
    }
  };
  int v = threadIdx.x;
  for (; v + kThreads < n_vec; v += 2 * kThreads) {
    uint4 a[R], b[R];
#pragma unroll
    for (int r = 0; r < R; ++r) a[r] = __ldcs(w[r] + v), b[r] = __ldcs(w[r] + v + kThreads);
    fma_vec(v, a);
    fma_vec(v + kThreads, b);
  }
  if (v < n_vec) {
    uint4 a[R];
#pragma unroll
    for (int r = 0; r < R; ++r) a[r] = __ldcs(w[r] + v);
    fma_vec(v, a);
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float s = warp_sum(acc[r][m]);
      if (lane == 0) partial[warp][r * M + m] = s;
    }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += partial[i][threadIdx.x];
    if (n0 + r < p.n) static_cast<T*>(p.y)[m * p.y_row_stride + n0 + r] = from_float<T>(s);
  }
}

template <typename T, int M>
void launch_rows(const GemvParams& p, cudaStream_t stream) {
  if (p.rows == M) {
    const auto blocks = static_cast<unsigned>((p.n + kRowsPerBlock - 1) / kRowsPerBlock);
    gemv_kernel<T, M><<<blocks, kThreads, 0, stream>>>(p);
  } else if constexpr (M > 1) {
    launch_rows<T, M - 1>(p, stream);
  }
}

}  // namespace

bool gemv_supported(int64_t rows, int64_t k, DType dtype) {
  const int64_t vec = dtype == DType::Float32 ? 4 : 8;
  return rows >= 1 && rows <= kGemvMaxRows && k >= vec && k % vec == 0 && k <= INT32_MAX;
}

void gemv(const GemvParams& p, void* stream) {
  LT2_CHECK(gemv_supported(p.rows, p.k, p.dtype) && p.n >= 1, "gemv: ", p.rows, " rows (1..", kGemvMaxRows,
            ") of K = ", p.k, " (a multiple of one 16-byte vector) into N = ", p.n);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    launch_rows<T, kGemvMaxRows>(p, static_cast<cudaStream_t>(stream));
  });
  check_launch("gemv");
}

}  // namespace lt2::kernels
