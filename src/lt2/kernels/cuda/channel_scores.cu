// Per-channel decayed scores of the chunked gated forms, forward and backward (kernels/prefill.h
// has the formulas): GLA's and HGRN2's A_qk, KDA's A_qk and the L of its UT transform.
//
// Floor. Per [C, K] triple the forward reads a, b and G (3 C K floats) and writes C^2 scores; it
// takes C (C + 1) / 2 * K exponentials. At GLA's 1.3B shape (8 x 4096 tokens, 4 heads, K 256,
// C 64: 2,048 triples) that is 0.40 GB read, 34 MB written (~0.09 ms at ~4.8 TB/s) and 1.09 G
// exponentials: ~0.29 ms at the H200's 16 per SM per clock (132 SMs, ~1.8 GHz), the bound. The
// backward takes each exponential twice (da and db): ~0.6 ms. The libtorch form builds [C, c, K] and
// [S, S, c, K] fp32 intermediates per chunk (c = 16, S = C / c) and their autograd backward.
//
// Design. One block per triple, 256 threads, K in tiles of 32 channels through shared memory
// (rows padded to 33 floats: the tiles' column reads are conflict-free). Forward: thread t owns row
// i = t / 4 and columns j = t % 4 + 4 r (r < C / 4) of the scores, accumulated in registers over
// the tiles. Backward: thread t owns channel d = t % 32 of rows t / 32 + 8 r; for each of its rows it
// sums da over the row's kept columns and db over the column's kept rows (C terms a row in all, so
// the work is even), and dG = a da - b db needs nothing else.
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32;             // channels a tile
constexpr int kPitch = kTile + 1;     // shared row pitch
constexpr int kMaxC = kMaxChannelScoresChunk;

struct Tiles {
  float a[kMaxC][kPitch], b[kMaxC][kPitch], g[kMaxC][kPitch];
};

// Channels [d0, d0 + 32) of the triple's rows into the tiles (zeros past K).
__device__ __forceinline__ void load_tiles(Tiles& s, const float* a, const float* b, const float* g, int C, int K,
                                           int d0) {
  for (int e = threadIdx.x; e < C * kTile; e += kThreads) {
    const int row = e / kTile, d = d0 + e % kTile;
    const bool in = d < K;
    const int64_t at = static_cast<int64_t>(row) * K + d;
    s.a[row][e % kTile] = in ? a[at] : 0.f;
    s.b[row][e % kTile] = in ? b[at] : 0.f;
    s.g[row][e % kTile] = in ? g[at] : 0.f;
  }
}

__device__ __forceinline__ bool kept(int i, int j, bool inclusive) { return inclusive ? j <= i : j < i; }

__global__ void __launch_bounds__(kThreads) channel_scores_forward_kernel(const ChannelScoresParams p) {
  __shared__ Tiles s;
  const int C = p.chunk, K = p.dim;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C * K;
  const int i = threadIdx.x / 4, j0 = threadIdx.x % 4;
  constexpr int kCols = kMaxC / 4;
  float acc[kCols];
#pragma unroll
  for (int r = 0; r < kCols; ++r) acc[r] = 0.f;
  for (int d0 = 0; d0 < K; d0 += kTile) {
    __syncthreads();
    load_tiles(s, p.a + base, p.b + base, p.g + base, C, K, d0);
    __syncthreads();
    if (i >= C) continue;
#pragma unroll 4
    for (int d = 0; d < kTile; ++d) {
      const float ai = s.a[i][d], gi = s.g[i][d];
#pragma unroll
      for (int r = 0; r < kCols; ++r) {
        const int j = j0 + 4 * r;
        if (j < C && kept(i, j, p.inclusive)) acc[r] = fmaf(ai * s.b[j][d], __expf(gi - s.g[j][d]), acc[r]);
      }
    }
  }
  if (i >= C) return;
  float* out = p.scores + static_cast<int64_t>(blockIdx.x) * C * C + static_cast<int64_t>(i) * C;
#pragma unroll
  for (int r = 0; r < kCols; ++r) {
    const int j = j0 + 4 * r;
    if (j < C) out[j] = acc[r];  // zero where not kept
  }
}

__global__ void __launch_bounds__(kThreads) channel_scores_backward_kernel(const ChannelScoresBackwardParams bp) {
  const ChannelScoresParams& p = bp.forward;
  __shared__ Tiles s;
  __shared__ float dA[kMaxC][kMaxC + 1];
  const int C = p.chunk, K = p.dim;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C * K;
  const float* dS = bp.d_scores + static_cast<int64_t>(blockIdx.x) * C * C;
  for (int e = threadIdx.x; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    dA[i][j] = kept(i, j, p.inclusive) ? dS[e] : 0.f;
  }
  const int d = threadIdx.x % kTile, row0 = threadIdx.x / kTile;
  constexpr int kRowStep = kThreads / kTile;
  for (int d0 = 0; d0 < K; d0 += kTile) {
    __syncthreads();
    load_tiles(s, p.a + base, p.b + base, p.g + base, C, K, d0);
    __syncthreads();
    if (d0 + d >= K) continue;
    for (int m = row0; m < C; m += kRowStep) {
      const float am = s.a[m][d], bm = s.b[m][d], gm = s.g[m][d];
      float da = 0.f, db = 0.f;
      for (int j = 0; j <= m; ++j) da = fmaf(dA[m][j] * s.b[j][d], __expf(gm - s.g[j][d]), da);  // row m
      for (int i = m; i < C; ++i) db = fmaf(dA[i][m] * s.a[i][d], __expf(s.g[i][d] - gm), db);    // column m
      const int64_t at = base + static_cast<int64_t>(m) * K + d0 + d;
      bp.da[at] = da;
      bp.db[at] = db;
      bp.dg[at] = am * da - bm * db;
    }
  }
}

void check_params(const ChannelScoresParams& p, const char* op) {
  LT2_CHECK(p.a && p.b && p.g, op, ": a, b and g must be given");
  LT2_CHECK(p.chunk >= 1 && p.chunk <= kMaxC && p.dim >= 1 && p.count >= 0 && p.count <= INT32_MAX, op,
            ": chunk must be in [1, ", kMaxC, "], dim >= 1 and count in [0, 2^31), found chunk ", p.chunk,
            ", dim ", p.dim, ", count ", p.count);
}

}  // namespace

void channel_scores_forward(const ChannelScoresParams& p, void* stream) {
  check_params(p, "channel_scores_forward");
  LT2_CHECK(p.scores, "channel_scores_forward: scores must be given");
  if (p.count == 0) return;
  channel_scores_forward_kernel<<<static_cast<unsigned>(p.count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("channel_scores_forward");
}

void channel_scores_backward(const ChannelScoresBackwardParams& bp, void* stream) {
  check_params(bp.forward, "channel_scores_backward");
  LT2_CHECK(bp.d_scores && bp.da && bp.db && bp.dg, "channel_scores_backward: d_scores, da, db and dg must be given");
  if (bp.forward.count == 0) return;
  channel_scores_backward_kernel<<<static_cast<unsigned>(bp.forward.count), kThreads, 0,
                                   static_cast<cudaStream_t>(stream)>>>(bp);
  check_launch("channel_scores_backward");
}

}  // namespace lt2::kernels
