// Decode projections (decode.h: gemv): y [M, N] = prologue(x) [M, K] W^T (+ residual), M <= 8.
//
// Floor: every weight is read once (N K elements); x, y and the residual are a few KB and stay in
// L2. At decode a step is a chain of such products, so their bytes are most of a step's bytes.
// Folding the block's RMSNorms, SwiGLU's silu * mul, attention's output gate and the residual
// adds into them removes the elementwise launches between the products (each a few us of latency
// for a few KB of work).
//
// Two kernels, one prologue/epilogue:
//   mma (bf16/fp16, K % 32 == 0): a block of 8 warps computes 16 weight rows for all M <= 8 rows
//     of x with tensor-core m16n8k16 products: W is the 16 x 16 A operand, x^T the 16 x 8 B
//     operand (its rows past M are zero). The k order inside a product is free (a dot product
//     does not depend on it), so each thread feeds the mma with 16-byte loads: lanes (g, q)
//     (g = lane / 4, q = lane % 4) load W rows g and g + 8 and x row g at k = 32c + 8q .. + 7,
//     which fill the A and B registers of two products. Warps split K; the block sums them.
//     Compute is negligible, so it runs at the weights' read rate whatever M is.
//     Split K: a block's loads are a few trips to memory of 32 KB each; with N = 2048 (128 blocks,
//     one per SM) and K = 5632 that is 6 dependent trips per SM and HBM idles between them. So the
//     blocks of a thread-block cluster share the 16 rows, each reading one slice of K, and rank 0
//     adds up their partial sums through distributed shared memory (no global workspace, no
//     second launch). On an H200 (bench/results/gemv_splits_h200.txt) 2 splits take 2048 x 5632
//     from 12.9 to 11.0 us and 2048 x 3072 from 8.0 to 7.2 us, while every shape with 2+ blocks
//     per SM loses by splitting (cluster scheduling); so gemv_k_splits splits only under-filled
//     grids.
//   fma (fp32, or K off 32): a block of 128 threads computes 4 weight rows with fp32 FMAs,
//     threads striding over 16-byte vectors of K.
// RmsNorm's statistic needs all of x's row: each thread adds up the squares of the x values it
// reads, and the block sums them with the partial products (x is read whole by every block).
#include <cooperative_groups.h>

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kMaxRows = kGemvMaxRows;

// The VEC prologue-applied values of x row m at 16-byte vector v, as floats; RmsNorm adds the
// squares of the raw values to sumsq (its rsqrt is applied to the sums at the end).
template <typename T, GemvPrologue PRO>
__device__ __forceinline__ void load_x(const GemvParams& p, int m, int v, float* out, float& sumsq) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  const T* row = static_cast<const T*>(p.x) + blockIdx.z * p.x_batch_stride + m * p.x_row_stride;
  unpack16<T>(__ldg(reinterpret_cast<const uint4*>(row) + v), out);
  if constexpr (PRO == GemvPrologue::RmsNorm) {
    float g[VEC];
    unpack16<T>(__ldg(reinterpret_cast<const uint4*>(p.norm_weight) + v), g);
#pragma unroll
    for (int e = 0; e < VEC; ++e) sumsq = fmaf(out[e], out[e], sumsq), out[e] *= g[e];
  } else if constexpr (PRO == GemvPrologue::SiluMul) {
    float b[VEC];
    unpack16<T>(__ldg(reinterpret_cast<const uint4*>(row + p.k) + v), b);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = silu(out[e]) * b[e];
  } else if constexpr (PRO == GemvPrologue::SigmoidGate) {
    float gate[VEC];
    const T* gate_row = static_cast<const T*>(p.x_gate) + m * p.x_gate_row_stride;
    unpack16<T>(__ldg(reinterpret_cast<const uint4*>(gate_row) + v), gate);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] *= sigmoid(gate[e]);
  }
}

// y[m, n] = rsqrt(mean(x_m^2) + eps) acc (RmsNorm) or acc, times sigmoid(y_gate), plus the
// residual, rounded once (product blockIdx.z of a batched call).
template <typename T, GemvPrologue PRO>
__device__ __forceinline__ void store_y(const GemvParams& p, int m, int64_t n, float acc, float sumsq) {
  if constexpr (PRO == GemvPrologue::RmsNorm) acc *= rsqrtf(sumsq / static_cast<float>(p.k) + p.norm_eps);
  if (p.y_gate) {
    const T* gate = static_cast<const T*>(p.y_gate) + blockIdx.z * p.y_gate_batch_stride + m * p.y_gate_row_stride;
    acc *= sigmoid(to_float(gate[n]));
  }
  if (p.residual) acc += to_float(static_cast<const T*>(p.residual)[m * p.residual_row_stride + n]);
  static_cast<T*>(p.y)[blockIdx.z * p.y_batch_stride + m * p.y_row_stride + n] = from_float<T>(acc);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel.

constexpr int kMmaWarps = 8;
constexpr int kMmaRows = 16;    // weight rows per block (the mma's M)
constexpr int kMmaChunk = 32;   // k per warp trip: 4 lanes x 8 elements
// Chunks whose loads are in flight together per warp trip: 4. Fewer gain nothing in the engine,
// more are slower (likely the registers they take), and so is staging the loads through a
// cp.async ring in shared memory (bench/notes/gemv_chain.md, the GEMV kernel).
constexpr int kMmaUnroll = 4;

// Grid (row blocks x k_splits) in clusters of (k_splits, 1, 1): cluster r computes weight rows
// 16 r .. 16 r + 15, its block of rank s over chunks [s, s + 1) * chunks_per_split of K.
template <typename T, GemvPrologue PRO, bool SPLIT>
__global__ void __launch_bounds__(kMmaWarps * 32) gemv_mma_kernel(const GemvParams p, int chunks_per_split) {
  dependent_kernel_start();
  __shared__ float s_c[kMmaWarps][kMmaRows][kMaxRows];
  __shared__ float s_sumsq[kMmaWarps][kMaxRows];
  __shared__ float s_block[kMmaRows * kMaxRows + kMaxRows];  // SPLIT: this block's sums, then x's squares
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int split = SPLIT ? static_cast<int>(blockIdx.x % p.k_splits) : 0;
  const int64_t n0 = static_cast<int64_t>(SPLIT ? blockIdx.x / p.k_splits : blockIdx.x) * kMmaRows;
  // Rows past N read row N - 1 (in bounds); their outputs are not written.
  const T* w_base = static_cast<const T*>(p.w) + blockIdx.z * p.w_batch_stride;  // product blockIdx.z's W
  const uint4* w_lo = reinterpret_cast<const uint4*>(w_base + min(n0 + g, p.n - 1) * p.k);
  const uint4* w_hi = reinterpret_cast<const uint4*>(w_base + min(n0 + g + 8, p.n - 1) * p.k);
  const bool has_x = g < p.rows;  // lane group g feeds x row g (the B operand's column g)
  const int first = split * chunks_per_split, end = min(p.k / kMmaChunk, first + chunks_per_split);

  float c[4] = {0.f, 0.f, 0.f, 0.f}, sumsq = 0.f;
  for (int c0 = first + warp; c0 < end; c0 += kMmaWarps * kMmaUnroll) {
    uint4 lo[kMmaUnroll], hi[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int chunk = c0 + u * kMmaWarps;
      if (chunk < end) {
        const int v = chunk * (kMmaChunk / 8) + q;  // 16-byte vector index along K
        lo[u] = __ldcs(w_lo + v), hi[u] = __ldcs(w_hi + v);
      }
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int chunk = c0 + u * kMmaWarps;
      if (chunk >= end) break;  // warp-uniform
      uint32_t b[4] = {0u, 0u, 0u, 0u};
      if (has_x) {
        float xf[8];
        load_x<T, PRO>(p, g, chunk * (kMmaChunk / 8) + q, xf, sumsq);
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = pack2<T>(xf[2 * i], xf[2 * i + 1]);
      }
      // Elements 0-3 of each lane's 8 form one product, 4-7 the other (A: rows g, g + 8).
      mma_16816<T>(c, lo[u].x, hi[u].x, lo[u].y, hi[u].y, b[0], b[1]);
      mma_16816<T>(c, lo[u].z, hi[u].z, lo[u].w, hi[u].w, b[2], b[3]);
    }
  }
  // C fragment: c0, c1 = C[g][2q], C[g][2q + 1]; c2, c3 = C[g + 8][2q], C[g + 8][2q + 1]
  // (C rows: weight rows, columns: x rows).
  s_c[warp][g][2 * q] = c[0];
  s_c[warp][g][2 * q + 1] = c[1];
  s_c[warp][g + 8][2 * q] = c[2];
  s_c[warp][g + 8][2 * q + 1] = c[3];
  if constexpr (PRO == GemvPrologue::RmsNorm) {
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 1);
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 2);
    if (q == 0) s_sumsq[warp][g] = sumsq;
  }
  __syncthreads();
  const int out = threadIdx.x, row = out / kMaxRows, m = out % kMaxRows;  // 128 (row, m) outputs
  const bool is_out = row < kMmaRows;
  float acc = 0.f, ss = 0.f;
  if (is_out) {
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) {
      acc += s_c[w][row][m];
      if constexpr (PRO == GemvPrologue::RmsNorm) ss += s_sumsq[w][m];
    }
  }
  if constexpr (SPLIT) {
    cg::cluster_group cluster = cg::this_cluster();
    if (is_out) s_block[out] = acc;
    if (row == 0) s_block[kMmaRows * kMaxRows + m] = ss;
    cluster.sync();  // every block's sums are written
    if (split == 0 && is_out)
      for (int r = 1; r < p.k_splits; ++r) {
        const float* other = cluster.map_shared_rank(s_block, r);
        acc += other[out];
        if constexpr (PRO == GemvPrologue::RmsNorm) ss += other[kMmaRows * kMaxRows + m];
      }
    cluster.sync();  // no block exits (freeing s_block) while rank 0 may still read it
    if (split != 0) return;
  }
  if (is_out && m < p.rows && n0 + row < p.n) store_y<T, PRO>(p, m, n0 + row, acc, ss);
}

// ---------------------------------------------------------------------------------------------
// FMA kernel.

constexpr int kFmaThreads = 128;
constexpr int kFmaRows = 4;  // weight rows per block

template <typename T, int M, GemvPrologue PRO>
__global__ void __launch_bounds__(kFmaThreads) gemv_fma_kernel(const GemvParams p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int R = kFmaRows, WARPS = kFmaThreads / 32;
  __shared__ float partial[WARPS][R * M + M];  // the products, then the squares of x per row
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * R;
  const int n_vec = p.k / VEC;
  const uint4* w[R];
#pragma unroll
  for (int r = 0; r < R; ++r)  // rows past N read row N - 1 (in bounds) and are not written
    w[r] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + blockIdx.z * p.w_batch_stride +
                                          min(n0 + r, p.n - 1) * p.k);

  float acc[R][M], sumsq[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    sumsq[m] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][m] = 0.f;
  }
  for (int v = threadIdx.x; v < n_vec; v += kFmaThreads) {
    float wf[R][VEC];
#pragma unroll
    for (int r = 0; r < R; ++r) unpack16<T>(__ldcs(w[r] + v), wf[r]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[VEC];
      load_x<T, PRO>(p, m, v, xf, sumsq[m]);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][m] = fmaf(wf[r][e], xf[e], acc[r][m]);
    }
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[r][m]);
      if (lane == 0) partial[warp][r * M + m] = s;
    }
    if constexpr (PRO == GemvPrologue::RmsNorm) {
      const float s = warp_sum(sumsq[m]);
      if (lane == 0) partial[warp][R * M + m] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float s = 0.f, ss = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      s += partial[i][threadIdx.x];
      if constexpr (PRO == GemvPrologue::RmsNorm) ss += partial[i][R * M + m];
    }
    if (n0 + r < p.n) store_y<T, PRO>(p, m, n0 + r, s, ss);
  }
}

template <typename T, int M, GemvPrologue PRO>
void launch_fma(const GemvParams& p, cudaStream_t stream) {
  if (p.rows == M) {
    const auto blocks = static_cast<unsigned>((p.n + kFmaRows - 1) / kFmaRows);
    gemv_fma_kernel<T, M, PRO><<<dim3(blocks, 1, static_cast<unsigned>(p.batch)), kFmaThreads, 0, stream>>>(p);
  } else if constexpr (M > 1) {
    launch_fma<T, M - 1, PRO>(p, stream);
  }
}

bool mma_serves(int k, DType dtype) { return dtype != DType::Float32 && k % kMmaChunk == 0; }

template <typename T, GemvPrologue PRO>
void launch_mma(const GemvParams& p, cudaStream_t stream) {
  const int64_t row_blocks = (p.n + kMmaRows - 1) / kMmaRows;
  const int chunks = p.k / kMmaChunk, chunks_per_split = (chunks + p.k_splits - 1) / p.k_splits;
  LT2_CHECK(row_blocks * p.k_splits <= INT32_MAX, "gemv: N = ", p.n, " is too many rows");
  const dim3 grid(static_cast<unsigned>(row_blocks * p.k_splits), 1, static_cast<unsigned>(p.batch));
  // The kernel does nothing before its grid-dependency wait, so like the other such decode kernels
  // it launches as a programmatic dependent only on a grid that leaves most SMs idle.
  if (p.k_splits == 1)
    launch_dependent_on_small_grid(p.pdl, "gemv", gemv_mma_kernel<T, PRO, false>, grid, dim3(kMmaWarps * 32), 0, stream, {},
                                   p, chunks);
  else
    launch_dependent_on_small_grid(p.pdl, "gemv (K splits)", gemv_mma_kernel<T, PRO, true>, grid, dim3(kMmaWarps * 32), 0,
                                   stream, {cluster_launch(static_cast<unsigned>(p.k_splits))}, p, chunks_per_split);
}

template <typename T, GemvPrologue PRO>
void launch(const GemvParams& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (mma_serves(p.k, p.dtype)) return launch_mma<T, PRO>(p, stream);
  }
  launch_fma<T, kMaxRows, PRO>(p, stream);
}

}  // namespace

int gemv_k_splits(int64_t n, int k, DType dtype, int device) {
  if (!mma_serves(k, dtype) || device_attribute(cudaDevAttrComputeCapabilityMajor, device, "gemv") < 9) return 1;
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, device, "gemv");
  const int64_t row_blocks = (n + kMmaRows - 1) / kMmaRows, chunks = k / kMmaChunk;
  // Double the splits while each block keeps at least one full trip of loads (every warp all
  // kMmaUnroll chunks in flight) and the grid stays within kTargetBlocksPerSm blocks per SM.
  constexpr int64_t kTargetBlocksPerSm = 2, kTrip = kMmaWarps * kMmaUnroll;
  int splits = 1;
  while (2 * splits <= kGemvMaxKSplits && chunks >= 2 * splits * kTrip &&
         row_blocks * 2 * splits <= kTargetBlocksPerSm * sms)
    splits *= 2;
  return splits;
}

bool gemv_supported(int64_t rows, int64_t k, DType dtype) {
  const int64_t vec = dtype == DType::Float32 ? 4 : 8;
  return rows >= 1 && rows <= kGemvMaxRows && k >= vec && k % vec == 0 && k <= INT32_MAX / 2;
}

void gemv(const GemvParams& p, void* stream) {
  LT2_CHECK(gemv_supported(p.rows, p.k, p.dtype) && p.n >= 1, "gemv: ", p.rows, " rows (1..", kGemvMaxRows,
            ") of K = ", p.k, " (a multiple of one 16-byte vector) into N = ", p.n);
  LT2_CHECK(p.prologue != GemvPrologue::RmsNorm || p.norm_weight, "gemv: the RmsNorm prologue needs its weight");
  LT2_CHECK(p.prologue != GemvPrologue::SigmoidGate || (p.x_gate && p.batch == 1),
            "gemv: the SigmoidGate prologue needs x_gate (and one product)");
  LT2_CHECK(p.batch >= 1 && p.batch <= 65535 && (p.batch == 1 || !p.residual), "gemv: batch ", p.batch,
            " (1..65535; a residual only with batch 1)");
  LT2_CHECK(!p.silu_mul_out, "gemv: the SiLU·mul epilogue is gemv_chain's");
  LT2_CHECK(p.k_splits >= 0 && p.k_splits <= kGemvMaxKSplits, "gemv: k_splits ", p.k_splits, " (0 to pick, or 1..",
            kGemvMaxKSplits, ")");
  GemvParams q = p;
  if (!mma_serves(p.k, p.dtype)) {
    q.k_splits = 1;  // the FMA kernel does not split
  } else if (q.k_splits == 0) {
    int device = 0;
    cudaGetDevice(&device);
    q.k_splits = gemv_k_splits(p.n, p.k, p.dtype, device);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    switch (q.prologue) {
      case GemvPrologue::None: launch<T, GemvPrologue::None>(q, s); break;
      case GemvPrologue::RmsNorm: launch<T, GemvPrologue::RmsNorm>(q, s); break;
      case GemvPrologue::SiluMul: launch<T, GemvPrologue::SiluMul>(q, s); break;
      case GemvPrologue::SigmoidGate: launch<T, GemvPrologue::SigmoidGate>(q, s); break;
    }
  });
  check_launch("gemv");
}

}  // namespace lt2::kernels
