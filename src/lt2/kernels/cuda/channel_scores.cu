// Per-channel decayed scores of the chunked gated forms, forward and backward (kernels/prefill.h
// has the formulas): GLA's and HGRN2's A_qk, KDA's A_qk and the L of its UT transform; and the
// chunk-local cumulative gate those scores and the chunk preparation read (the chunk gate, at the end).
//
// Floor. Per [C, K] triple the forward reads a, b and G (3 C K floats) and writes C^2 scores; it
// takes C (C + 1) / 2 * K exponentials. At GLA's 1.3B shape (8 x 4096 tokens, 4 heads, K 256,
// C 64: 2,048 triples) that is 0.40 GB read, 34 MB written (~0.09 ms at ~4.8 TB/s) and 1.09 G
// exponentials: ~0.29 ms at the H200's 16 per SM per clock (132 SMs, ~1.8 GHz), the bound. The
// backward takes each exponential twice (da and db): ~0.6 ms. The libtorch form builds [C, c, K] and
// [S, S, c, K] fp32 intermediates per chunk (c = 16, S = C / c) and their autograd backward.
// KDA's pair backward at lt-100m/kda's 16 x 2048 tokens (12 heads, K 64: 6,144 triples) reads bf16 q and k
// (0.10 GB), G (0.10) and both dA (0.20), and reads and writes dq, dk (0.20) and dG (0.20): 0.80 GB, ~0.24
// ms at ~3.35 TB/s (an H100), the bound; with the blocked form's ~1,400 exponentials a channel (the two
// diagonals' 1,024, the scaled operands and the row factors), 0.55 G of them, ~0.15 ms. Two accumulating
// passes moved 1.3 GB.
//
// Design. One block per triple, 256 threads, K in tiles of 32 channels through shared memory
// (rows padded to 33 floats: the tiles' column reads are conflict-free). a and b come packed in
// chunks (fp32) or as the token rows the chunked forms hold (fp32 or bf16, rows row_stride elements
// apart: H K, or wider where q and k are column slices of a projection's output; the tail past the
// sequence read as zeros): the tiles take either, so the mixers need no fp32
// chunk-layout copy of q and k, nor a copy of their gradients back (~0.3 GB of copies a call, forward and
// backward, at lt-100m/gla's 16 x 2048 tokens).
// C 64 (the mixers' chunk), on tensor cores: the chunk is four blocks of 16 rows, and for a block
// pair I > J the decay factors through a reference row r between them, exp(G_i - G_j) =
// exp(G_i - G_r) exp(G_r - G_j) with both exponents <= 0 (G is non-increasing), so the pair's
// scores are a product of scaled operands: forward r = 16 I (the first row of I), the 16 x 16
// block Ã_I B̃_I^T with Ã_I = a_i exp(G_i - G_r), B̃_I = b_j exp(G_r - G_j); backward
// da_i = exp(G_i - G_r) (dA B̃_I)_i over the columns left of I, and db_j = exp(G_r' - G_j)
// (dA^T Ã'_J)_j over the rows below J with r' = 16 J + 15 (the last row of J). The products run as
// mma.sync m16n8k8 in 3xTF32 (fp32's accuracy). Only the four diagonal blocks take an exponential a
// pair and channel: 4 x 136 of the C (C + 1) / 2 = 2,080 a channel (plus 144 for the scaled
// operands), ~3x fewer forward, ~5x fewer backward (one exponential serves a pair's da and db).
// Other C: thread t owns row i = t / 4 and columns j = t % 4 + 4 r (r < C / 4) of the scores,
// accumulated in registers over the tiles; backward, thread t owns channel d = t % 32 of rows
// t / 32 + 8 r; for each of its rows it sums da over the row's kept columns and db over the column's
// kept rows (C terms a row in all, so the work is even), and dG = a da - b db needs nothing else.
// KDA's two forward scores (q with k inclusive, k with itself strict) share k, G, B̃_I and every
// diagonal pair's exponential: with self_scores one pass computes both (b's Ã_I beside a's), where
// two would read k and G twice and take the diagonal's exponentials twice. Their backward in one pass
// likewise (d_self_scores): q, k and G read once, B̃_I scaled once, dk and dG read and written once where two
// accumulating passes read and wrote them twice; the self scores' diagonal blocks run on the 128 threads the
// single backward leaves idle there, and the products' shares take the scaled operands' shared memory once
// the products are done (101 KB a block at 128 registers: two an SM; the single backward 70 KB at 80: three).
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

// Where a triple's rows of a and b (and of da and db) lie: row i at first + i * stride, rows from
// `valid` on absent (past the sequence's end in the token layout). G's rows are always packed, at
// gate + i * K.
struct Rows {
  int64_t first, stride, gate;
  int valid;
};
__device__ __forceinline__ Rows rows_of(const ChannelScoresParams& p, int64_t triple) {
  const int64_t C = p.chunk, K = p.dim, gate = triple * C * K;
  if (!p.token_rows) return {gate, K, gate, p.chunk};
  const int64_t chunks = (p.seq + C - 1) / C, n = triple % chunks, h = (triple / chunks) % p.heads,
                b = triple / (chunks * p.heads);
  return {(b * p.seq + n * C) * p.row_stride + h * K, p.row_stride, gate, static_cast<int>(min(C, p.seq - n * C))};
}

// Channels [d0, d0 + 32) of the triple's rows into the tiles (zeros past K and on absent rows).
template <typename T>
__device__ __forceinline__ void load_tiles(Tiles& s, const ChannelScoresParams& p, const Rows& r, int C, int K,
                                           int d0) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  for (int e = threadIdx.x; e < C * kTile; e += kThreads) {
    const int row = e / kTile, d = d0 + e % kTile;
    const bool in = d < K, present = in && row < r.valid;
    const int64_t at = r.first + row * r.stride + d;
    s.a[row][e % kTile] = present ? to_float(a[at]) : 0.f;
    s.b[row][e % kTile] = present ? to_float(b[at]) : 0.f;
    s.g[row][e % kTile] = in ? p.g[r.gate + static_cast<int64_t>(row) * K + d] : 0.f;
  }
}

// What a triple's da, db and dG of row `row`, channel d, hold before the kernel where bp.accumulate adds to
// them (zeros otherwise; db's zero where db is da, whose two shares land in one store). Loaded apart from
// the stores so that a thread's loads of several rows go out together: a load after each row's store
// would wait a memory latency a row (the stores may alias the next row's loads for all the compiler knows).
struct Prior {
  float a, b, g;
};
template <typename T>
__device__ __forceinline__ Prior prior_gradients(const ChannelScoresBackwardParams& bp, const Rows& r, int row, int d) {
  Prior x{0.f, 0.f, 0.f};
  if (!bp.accumulate) return x;
  x.g = bp.dg[r.gate + static_cast<int64_t>(row) * bp.forward.dim + d];
  if (row < r.valid) {
    const int64_t at = r.first + row * r.stride + d;
    x.a = to_float(static_cast<const T*>(bp.da)[at]);
    if (bp.db != bp.da) x.b = to_float(static_cast<const T*>(bp.db)[at]);
  }
  return x;
}

// The triple's da, db and dG of row `row`, channel d, written with what they held added (`prior`): one
// thread owns a (row, channel), so the additions need no atomics. An absent row has no da or db, and its
// dG (zero: its a and b read as zeros) is stored all the same, as the chunk gate's backward sums every row.
template <typename T>
__device__ __forceinline__ void store_gradients(const ChannelScoresBackwardParams& bp, const Rows& r, int row, int d,
                                                float da, float db, float dg, const Prior& prior) {
  bp.dg[r.gate + static_cast<int64_t>(row) * bp.forward.dim + d] = prior.g + dg;
  if (row < r.valid) {
    const int64_t at = r.first + row * r.stride + d;
    T* a = static_cast<T*>(bp.da) + at;
    if (bp.db == bp.da) {
      *a = from_float<T>(prior.a + da + db);
    } else {
      *a = from_float<T>(prior.a + da);
      static_cast<T*>(bp.db)[at] = from_float<T>(prior.b + db);
    }
  }
}

__device__ __forceinline__ bool kept(int i, int j, bool inclusive) { return inclusive ? j <= i : j < i; }

// C 64 on tensor cores: four blocks of kBlk rows.
constexpr int kBlk = 16;
constexpr int kOpPitch = kTile + 4;      // scaled operand rows: A[g][t] and B[t][g] reads in distinct banks
constexpr int kDAPitch = kMaxC + 8;      // dA rows: dA[g][t] and dA[t][g] reads in distinct banks
constexpr int kScaledRows = 96;          // 16 + 32 + 48 rows of either family of scaled operands
// Rows of B̃_I (b rows j < 16 I scaled to row 16 I, I = 1..3) and of Ã'_J (a rows i >= 16 (J + 1)
// scaled to row 16 J + 15, J = 0..2) within their arrays.
__device__ __forceinline__ int left_rows_at(int I) { return kBlk * I * (I - 1) / 2; }      // 0, 16, 48
__device__ __forceinline__ int below_rows_at(int J) { return kBlk * J * (7 - J) / 2; }     // 0, 48, 80

// The forward's shared memory: the raw tiles and the scaled operands (Ã_I of a at rows 16 (I - 1), with
// self_scores b's at 48 + 16 (I - 1); B̃_I).
struct ForwardShared {
  Tiles raw;
  float a_ref[kScaledRows][kOpPitch];
  float b_ref[kScaledRows][kOpPitch];
};
// The backward's, for kScores score matrices (2: a's scores with b and b's self scores): the raw tiles; the
// scaled operands Ã'_J (a's, then b's) and B̃_I, whose space the products' shares of a tile take once the
// products are done (da of each score, then db summed over them); each score's dA.
template <int kScores>
struct BackwardShared {
  Tiles raw;
  union {
    struct {
      float a_ref[kScores * kScaledRows][kOpPitch];
      float b_ref[kScaledRows][kOpPitch];
    } op;
    float off[kScores + 1][kMaxC][kPitch];
  } u;
  float dA[kScores][kMaxC][kDAPitch];
};

// B̃_I for I = 1..3 from the raw tile.
__device__ __forceinline__ void scale_left_rows(const Tiles& raw, float (&b_ref)[kScaledRows][kOpPitch]) {
  for (int e = threadIdx.x; e < kScaledRows * kTile; e += kThreads) {
    const int r = e / kTile, d = e % kTile, I = r < 16 ? 1 : r < 48 ? 2 : 3, j = r - left_rows_at(I);
    b_ref[r][d] = raw.b[j][d] * __expf(raw.g[kBlk * I][d] - raw.g[j][d]);
  }
}

// kSelf: with p.self_scores (a variant of its own, so that the single scores keep their registers).
template <typename T, bool kSelf>
__global__ void __launch_bounds__(kThreads) channel_scores_forward_blocked_kernel(const ChannelScoresParams p) {
  constexpr int C = kMaxC;
  constexpr int kSelfRows = kScaledRows / 2;  // b's Ã_I (self scores) in a_ref from this row
  extern __shared__ __align__(16) unsigned char blocked_smem[];
  ForwardShared& s = *reinterpret_cast<ForwardShared*>(blocked_smem);
  const int K = p.dim, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const Rows rows = rows_of(p, blockIdx.x);
  // The off-diagonal block pairs (I, J), I > J, two n-tiles each: warp w takes units w and w + 8;
  // pair p = I (I - 1) / 2 + J.
  auto pair_rows = [](int pair) { return pair < 1 ? 1 : pair < 3 ? 2 : 3; };
  float acc[2][1][4] = {}, acc_self[2][1][4] = {};  // warp_product's accumulators, one n-tile a unit
  // The diagonal blocks element by element: thread t, block t / 64, row (t % 64) / 4, columns t % 4 + 4 m.
  const int D = tid / 64, di = kBlk * D + (tid % 64) / 4;
  float diag[4] = {}, diag_self[4] = {};
  for (int d0 = 0; d0 < K; d0 += kTile) {
    __syncthreads();
    load_tiles<T>(s.raw, p, rows, C, K, d0);
    __syncthreads();
    for (int e = tid; e < (kSelf ? 2 : 1) * kSelfRows * kTile; e += kThreads) {  // Ã_I, I = 1..3 (a's, then b's)
      const int r = e / kTile, d = e % kTile, i = kBlk + r % kSelfRows;
      const float x = r < kSelfRows ? s.raw.a[i][d] : s.raw.b[i][d];
      s.a_ref[r][d] = x * __expf(s.raw.g[i][d] - s.raw.g[kBlk * (i / kBlk)][d]);
    }
    scale_left_rows(s.raw, s.b_ref);
#pragma unroll 4
    for (int d = 0; d < kTile; ++d) {
      const float ai = s.raw.a[di][d], bi = s.raw.b[di][d], gi = s.raw.g[di][d];
#pragma unroll
      for (int m = 0; m < 4; ++m) {  // one exponential a pair serves both scores
        const int j = kBlk * D + tid % 4 + 4 * m;
        const bool keep = kept(di, j, p.inclusive), keep_self = kSelf && j < di;
        if (keep || keep_self) {
          const float bj_e = s.raw.b[j][d] * __expf(gi - s.raw.g[j][d]);
          if (keep) diag[m] = fmaf(ai, bj_e, diag[m]);
          if (keep_self) diag_self[m] = fmaf(bi, bj_e, diag_self[m]);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int unit = warp + 8 * u;
      if (unit >= 12) break;
      const int I = pair_rows(unit / 2), J = unit / 2 - I * (I - 1) / 2, n0 = kBlk * J + 8 * (unit % 2);
      const float* b_op = &s.b_ref[left_rows_at(I) + n0][0];
      warp_product<1, false>(acc[u], &s.a_ref[kBlk * (I - 1)][0], kOpPitch, 1, b_op, 1, kOpPitch, 0, 0, 1, 0, kTile);
      if constexpr (kSelf)
        warp_product<1, false>(acc_self[u], &s.a_ref[kSelfRows + kBlk * (I - 1)][0], kOpPitch, 1, b_op, 1, kOpPitch,
                               0, 0, 1, 0, kTile);
    }
  }
  // The scores (times `scale`) and b's self scores: the off-diagonal blocks, the diagonal ones (zero where
  // not kept), the blocks above the diagonal zeros.
  auto store = [&](float* out, const float (&off)[2][1][4], const float (&on)[4], float scale) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int unit = warp + 8 * u;
      if (unit >= 12) break;
      const int I = pair_rows(unit / 2), J = unit / 2 - I * (I - 1) / 2, col = kBlk * J + 8 * (unit % 2) + 2 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<float2*>(out + (kBlk * I + g + 8 * r) * C + col) =
            make_float2(scale * off[u][0][2 * r], scale * off[u][0][2 * r + 1]);
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) out[di * C + kBlk * D + tid % 4 + 4 * m] = scale * on[m];
    for (int e = tid; e < 6 * kBlk * kBlk; e += kThreads) {
      const int pair = e / (kBlk * kBlk), I = pair < 3 ? 0 : pair < 5 ? 1 : 2,
                J = pair < 3 ? pair + 1 : pair < 5 ? pair - 1 : 3;
      out[(kBlk * I + (e / kBlk) % kBlk) * C + kBlk * J + e % kBlk] = 0.f;
    }
  };
  store(p.scores + static_cast<int64_t>(blockIdx.x) * C * C, acc, diag, p.scale);
  if constexpr (kSelf) store(p.self_scores + static_cast<int64_t>(blockIdx.x) * C * C, acc_self, diag_self, 1.f);
}

// kPair: with bp.d_self_scores, b's self scores' gradient too (a variant of its own, as the forward's).
// Per tile: the off-diagonal products (warps 0-3 da of blocks I = 1..3, warps 4-7 db of blocks J = 0..2, one
// n-tile of 8 channels each), kept in registers until every warp is done with the operands, then written
// where those were; the diagonal blocks (threads 0-127 one channel of a block each, with kPair threads
// 128-255 the same for the self scores, which adds their shares to the products'); each (row, channel)'s
// gradients summed and stored by threads 0-127.
template <typename T, bool kPair>
__global__ void __launch_bounds__(kThreads) channel_scores_backward_blocked_kernel(const ChannelScoresBackwardParams bp) {
  constexpr int C = kMaxC, kScores = kPair ? 2 : 1;
  const ChannelScoresParams& p = bp.forward;
  extern __shared__ __align__(16) unsigned char blocked_smem[];
  auto& s = *reinterpret_cast<BackwardShared<kScores>*>(blocked_smem);
  const int K = p.dim, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const Rows rows = rows_of(p, blockIdx.x);
  const int64_t scores_at = static_cast<int64_t>(blockIdx.x) * C * C;
  for (int e = tid; e < kScores * C * C; e += kThreads) {  // only kept entries are read
    const int x = e / (C * C), at = e % (C * C);
    s.dA[x][at / C][at % C] = x == 0 ? p.scale * bp.d_scores[scores_at + at] : bp.d_self_scores[scores_at + at];
  }
  const bool rows_da = warp < 4;
  const int n0 = 8 * (warp % 4);
  // The diagonal blocks: thread t owns channel t % 32 of block (t / 32) % 4, every pair of it, of a's scores
  // (t < 128) or b's self scores (t >= 128: strict, b in a's place).
  const int d_own = tid % 32, D = tid / 32 % 4;
  const bool self = kPair && tid >= 4 * kTile, diagonal = kPair || tid < 4 * kTile;
  for (int d0 = 0; d0 < K; d0 += kTile) {
    __syncthreads();
    load_tiles<T>(s.raw, p, rows, C, K, d0);
    __syncthreads();
    for (int e = tid; e < kScores * kScaledRows * kTile; e += kThreads) {  // Ã'_J, J = 0..2 (a's, then b's)
      const int r = e / kTile % kScaledRows, d = e % kTile, J = r < 48 ? 0 : r < 80 ? 1 : 2,
                i = kBlk * (J + 1) + r - below_rows_at(J);
      const float x = e < kScaledRows * kTile ? s.raw.a[i][d] : s.raw.b[i][d];
      s.u.op.a_ref[e / kTile][d] = x * __expf(s.raw.g[i][d] - s.raw.g[kBlk * J + kBlk - 1][d]);
    }
    scale_left_rows(s.raw, s.u.op.b_ref);
    __syncthreads();
    float acc[3][kScores][1][4] = {};  // da: a block's share of each score; db: of their sum
#pragma unroll
    for (int blk = 0; blk < 3; ++blk) {
#pragma unroll
      for (int x = 0; x < kScores; ++x) {
        if (rows_da) {  // dA[16 I .., :16 I] B̃_I, I = blk + 1
          const int I = blk + 1;
          warp_product<1, false>(acc[blk][x], &s.dA[x][kBlk * I][0], kDAPitch, 1, &s.u.op.b_ref[left_rows_at(I)][n0],
                                 kOpPitch, 1, 0, 0, 1, 0, kBlk * I);
        } else {  // dA[16 (J + 1) .., 16 J ..]^T Ã'_J, J = blk
          const int J = blk;
          warp_product<1, false>(acc[blk][0], &s.dA[x][kBlk * (J + 1)][kBlk * J], 1, kDAPitch,
                                 &s.u.op.a_ref[kScaledRows * x + below_rows_at(J)][n0], kOpPitch, 1, 0, 0, 1, 0,
                                 C - kBlk * (J + 1));
        }
      }
    }
    __syncthreads();  // the operands are done with: the shares take their place, times their row factors
#pragma unroll
    for (int blk = 0; blk < 3; ++blk)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = n0 + 2 * t + e;
          if (rows_da) {  // exp(G_i - G_16I)
            const int I = blk + 1, i = kBlk * I + g + 8 * r;
            const float f = __expf(s.raw.g[i][d] - s.raw.g[kBlk * I][d]);
#pragma unroll
            for (int x = 0; x < kScores; ++x) s.u.off[x][i][d] = acc[blk][x][0][2 * r + e] * f;
          } else {  // exp(G_16J+15 - G_j)
            const int J = blk, j = kBlk * J + g + 8 * r;
            s.u.off[kScores][j][d] =
                acc[blk][0][0][2 * r + e] * __expf(s.raw.g[kBlk * J + kBlk - 1][d] - s.raw.g[j][d]);
          }
        }
    for (int e = tid; e < kBlk * kTile; e += kThreads) {  // rows with no off-diagonal share
#pragma unroll
      for (int x = 0; x < kScores; ++x) s.u.off[x][e / kTile][e % kTile] = 0.f;
      s.u.off[kScores][C - kBlk + e / kTile][e % kTile] = 0.f;
    }
    float da[kBlk] = {}, db[kBlk] = {};
    if (diagonal) {  // one exponential a pair serves both
      const auto& a_rows = self ? s.raw.b : s.raw.a;
      const auto& dA = s.dA[self ? kScores - 1 : 0];
      const bool inclusive = !self && p.inclusive;
#pragma unroll
      for (int il = 0; il < kBlk; ++il) {
        const int i = kBlk * D + il;
        const float ai = a_rows[i][d_own], gi = s.raw.g[i][d_own];
#pragma unroll
        for (int jl = 0; jl <= il; ++jl) {
          const int j = kBlk * D + jl;
          if (jl == il && !inclusive) continue;
          const float w = dA[i][j] * __expf(gi - s.raw.g[j][d_own]);
          da[il] = fmaf(w, s.raw.b[j][d_own], da[il]);
          db[jl] = fmaf(w, ai, db[jl]);
        }
      }
    }
    __syncthreads();  // the products' shares are in shared memory
    if constexpr (kPair) {
      if (self) {
#pragma unroll
        for (int l = 0; l < kBlk; ++l) {
          s.u.off[1][kBlk * D + l][d_own] += da[l];
          s.u.off[2][kBlk * D + l][d_own] += db[l];
        }
      }
      __syncthreads();
    }
    if (tid < 4 * kTile && d0 + d_own < K) {
      constexpr int kGroup = 8;  // rows whose priors are loaded together
#pragma unroll
      for (int l0 = 0; l0 < kBlk; l0 += kGroup) {
        Prior prior[kGroup];
#pragma unroll
        for (int l = 0; l < kGroup; ++l) prior[l] = prior_gradients<T>(bp, rows, kBlk * D + l0 + l, d0 + d_own);
#pragma unroll
        for (int l = 0; l < kGroup; ++l) {
          const int row = kBlk * D + l0 + l;
          const float a_row = s.raw.a[row][d_own], b_row = s.raw.b[row][d_own];
          const float da_row = da[l0 + l] + s.u.off[0][row][d_own], db_row = db[l0 + l] + s.u.off[kScores][row][d_own];
          // With the self scores b's gradient takes their da too (b is their a), and dG its b * da.
          const float self_da = kPair ? s.u.off[kScores - 1][row][d_own] : 0.f;
          store_gradients<T>(bp, rows, row, d0 + d_own, da_row, db_row + self_da,
                             a_row * da_row - b_row * (db_row - self_da), prior[l]);
        }
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) channel_scores_forward_kernel(const ChannelScoresParams p) {
  __shared__ Tiles s;
  const int C = p.chunk, K = p.dim;
  const Rows rows = rows_of(p, blockIdx.x);
  const int i = threadIdx.x / 4, j0 = threadIdx.x % 4;
  const bool self = p.self_scores != nullptr;
  constexpr int kCols = kMaxC / 4;
  float acc[kCols], acc_self[kCols];
#pragma unroll
  for (int r = 0; r < kCols; ++r) acc[r] = acc_self[r] = 0.f;
  for (int d0 = 0; d0 < K; d0 += kTile) {
    __syncthreads();
    load_tiles<T>(s, p, rows, C, K, d0);
    __syncthreads();
    if (i >= C) continue;
#pragma unroll 4
    for (int d = 0; d < kTile; ++d) {
      const float ai = s.a[i][d], bi = s.b[i][d], gi = s.g[i][d];
#pragma unroll
      for (int r = 0; r < kCols; ++r) {
        const int j = j0 + 4 * r;
        const bool keep = j < C && kept(i, j, p.inclusive), keep_self = self && j < i;
        if (keep || keep_self) {
          const float bj_e = s.b[j][d] * __expf(gi - s.g[j][d]);
          if (keep) acc[r] = fmaf(ai, bj_e, acc[r]);
          if (keep_self) acc_self[r] = fmaf(bi, bj_e, acc_self[r]);
        }
      }
    }
  }
  if (i >= C) return;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * C * C + static_cast<int64_t>(i) * C;
#pragma unroll
  for (int r = 0; r < kCols; ++r) {
    const int j = j0 + 4 * r;
    if (j >= C) continue;
    p.scores[row + j] = p.scale * acc[r];  // zero where not kept
    if (self) p.self_scores[row + j] = acc_self[r];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) channel_scores_backward_kernel(const ChannelScoresBackwardParams bp) {
  const ChannelScoresParams& p = bp.forward;
  __shared__ Tiles s;
  __shared__ float dA[kMaxC][kMaxC + 1];
  const int C = p.chunk, K = p.dim;
  const Rows rows = rows_of(p, blockIdx.x);
  const float* dS = bp.d_scores + static_cast<int64_t>(blockIdx.x) * C * C;
  for (int e = threadIdx.x; e < C * C; e += kThreads) {
    const int i = e / C, j = e % C;
    dA[i][j] = kept(i, j, p.inclusive) ? p.scale * dS[e] : 0.f;
  }
  const int d = threadIdx.x % kTile, row0 = threadIdx.x / kTile;
  constexpr int kRowStep = kThreads / kTile;
  for (int d0 = 0; d0 < K; d0 += kTile) {
    __syncthreads();
    load_tiles<T>(s, p, rows, C, K, d0);
    __syncthreads();
    if (d0 + d >= K) continue;
    for (int m = row0; m < C; m += kRowStep) {
      const float am = s.a[m][d], bm = s.b[m][d], gm = s.g[m][d];
      float da = 0.f, db = 0.f;
      for (int j = 0; j <= m; ++j) da = fmaf(dA[m][j] * s.b[j][d], __expf(gm - s.g[j][d]), da);  // row m
      for (int i = m; i < C; ++i) db = fmaf(dA[i][m] * s.a[i][d], __expf(s.g[i][d] - gm), db);    // column m
      store_gradients<T>(bp, rows, m, d0 + d, da, db, am * da - bm * db, prior_gradients<T>(bp, rows, m, d0 + d));
    }
  }
}

// The chunk gate (kernels/prefill.h): thread idx walks column (b, h, n, d), d fastest so a warp's loads
// and stores are consecutive floats. Floor: one read and one write of [B, H, N, C, D] fp32; at
// lt-100m/kda's 16 x 2048 tokens, 12 heads of 64: 101 MB each way, ~0.06 ms at 3.3 TB/s.
template <bool kBackward>
__global__ void chunk_gate_kernel(ChunkGateParams p) {
  const int64_t chunks = (p.tokens + p.chunk - 1) / p.chunk;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.batch * p.heads * chunks * p.dim) return;
  const int d = static_cast<int>(idx % p.dim);
  int64_t rest = idx / p.dim;
  const int64_t n = rest % chunks;
  rest /= chunks;
  const int h = static_cast<int>(rest % p.heads);
  const int64_t b = rest / p.heads;
  const int64_t token_stride = static_cast<int64_t>(p.heads) * p.dim;
  const int64_t token0 = ((b * p.tokens + n * p.chunk) * p.heads + h) * p.dim + d;  // (b, n C, h, d)
  const int64_t chunk0 = ((b * p.heads + h) * chunks + n) * p.chunk * p.dim + d;    // (b, h, n, 0, d)
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk), p.tokens - n * p.chunk));
  float sum = 0.f;
  if (!kBackward) {
    for (int c = 0; c < p.chunk; ++c) {
      if (c < rows) sum += p.in[token0 + c * token_stride];
      p.out[chunk0 + static_cast<int64_t>(c) * p.dim] = sum;
    }
  } else {
    for (int c = p.chunk - 1; c >= 0; --c) {
      sum += p.in[chunk0 + static_cast<int64_t>(c) * p.dim];
      if (c < rows) p.out[token0 + c * token_stride] = sum;
    }
  }
}

template <bool kBackward>
void launch_chunk_gate(const ChunkGateParams& p, void* stream, const char* op) {
  LT2_CHECK(p.in && p.out, op, ": in and out must be given");
  LT2_CHECK(p.batch >= 0 && p.tokens >= 0 && p.heads >= 1 && p.dim >= 1 && p.chunk >= 1, op,
            ": batch and tokens must be >= 0, heads, dim and chunk >= 1, found ", p.batch, ", ", p.tokens, ", ",
            p.heads, ", ", p.dim, ", ", p.chunk);
  const int64_t columns = p.batch * p.heads * ((p.tokens + p.chunk - 1) / p.chunk) * p.dim;
  if (columns == 0) return;
  constexpr int kGateThreads = 256;
  const int64_t blocks = (columns + kGateThreads - 1) / kGateThreads;
  LT2_CHECK(blocks <= INT32_MAX, op, ": ", columns, " columns exceed a grid");
  chunk_gate_kernel<kBackward><<<static_cast<unsigned>(blocks), kGateThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_launch(op);
}

// Calls f(T{}) with T the rows' CUDA type: fp32 or bf16 (the two the mixers hand over; fewer
// instantiations of the tensor-core kernels to build).
template <typename F>
void dispatch_rows(DType dtype, F&& f) {
  if (dtype == DType::BFloat16)
    f(__nv_bfloat16{});
  else
    f(float{});
}

void check_params(const ChannelScoresParams& p, const char* op) {
  LT2_CHECK(p.a && p.b && p.g, op, ": a, b and g must be given");
  LT2_CHECK(p.chunk >= 1 && p.chunk <= kMaxC && p.dim >= 1 && p.count >= 0 && p.count <= INT32_MAX, op,
            ": chunk must be in [1, ", kMaxC, "], dim >= 1 and count in [0, 2^31), found chunk ", p.chunk,
            ", dim ", p.dim, ", count ", p.count);
  LT2_CHECK(p.dtype != DType::Float16, op, ": a and b are fp32 or bf16");
  LT2_CHECK(p.token_rows || p.dtype == DType::Float32, op, ": packed chunk rows are fp32");
  LT2_CHECK(!p.token_rows || (p.seq >= 1 && p.heads >= 1 && p.count % p.heads == 0 &&
                              p.count / p.heads % ((p.seq + p.chunk - 1) / p.chunk) == 0 &&
                              p.row_stride >= int64_t{p.heads} * p.dim),
            op, ": token rows need seq and heads >= 1, count = batch x heads x chunks and row_stride >= heads x "
            "dim, found seq ", p.seq, ", heads ", p.heads, ", count ", p.count, ", row_stride ", p.row_stride);
}

}  // namespace

void channel_scores_forward(const ChannelScoresParams& p, void* stream) {
  check_params(p, "channel_scores_forward");
  LT2_CHECK(p.scores, "channel_scores_forward: scores must be given");
  if (p.count == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_rows(p.dtype, [&](auto t) {
    using T = decltype(t);
    auto blocked = [&](auto self) {
      constexpr auto kernel = channel_scores_forward_blocked_kernel<T, decltype(self)::value>;
      reserve_shared<kernel>(sizeof(ForwardShared), "channel_scores_forward");
      kernel<<<static_cast<unsigned>(p.count), kThreads, sizeof(ForwardShared), s>>>(p);
    };
    if (p.chunk == kMaxC && p.self_scores) {
      blocked(std::true_type{});
    } else if (p.chunk == kMaxC) {
      blocked(std::false_type{});
    } else {
      channel_scores_forward_kernel<T><<<static_cast<unsigned>(p.count), kThreads, 0, s>>>(p);
    }
  });
  check_launch("channel_scores_forward");
}

void channel_scores_backward(const ChannelScoresBackwardParams& bp, void* stream) {
  check_params(bp.forward, "channel_scores_backward");
  LT2_CHECK(bp.d_scores && bp.da && bp.db && bp.dg && !bp.forward.self_scores,
            "channel_scores_backward: d_scores, da, db and dg must be given, and no self_scores");
  LT2_CHECK(!bp.d_self_scores || bp.da != bp.db,
            "channel_scores_backward: with d_self_scores da and db must be apart (a's and b's gradients)");
  if (bp.forward.count == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto blocks = static_cast<unsigned>(bp.forward.count);
  dispatch_rows(bp.forward.dtype, [&](auto t) {
    using T = decltype(t);
    auto blocked = [&](auto pair) {
      constexpr bool kPair = decltype(pair)::value;
      constexpr auto kernel = channel_scores_backward_blocked_kernel<T, kPair>;
      constexpr size_t bytes = sizeof(BackwardShared<kPair ? 2 : 1>);
      reserve_shared<kernel>(bytes, "channel_scores_backward");
      kernel<<<blocks, kThreads, bytes, s>>>(bp);
    };
    if (bp.forward.chunk == kMaxC && bp.d_self_scores) {
      blocked(std::true_type{});
    } else if (bp.forward.chunk == kMaxC) {
      blocked(std::false_type{});
    } else {
      channel_scores_backward_kernel<T><<<blocks, kThreads, 0, s>>>(bp);
      if (bp.d_self_scores) {  // b's self scores by a pass of their own, added to b's gradients
        ChannelScoresBackwardParams self = bp;
        self.forward.a = bp.forward.b, self.forward.inclusive = false, self.forward.scale = 1.f;
        self.d_scores = bp.d_self_scores, self.d_self_scores = nullptr;
        self.da = bp.db, self.accumulate = true;
        channel_scores_backward_kernel<T><<<blocks, kThreads, 0, s>>>(self);
      }
    }
  });
  check_launch("channel_scores_backward");
}

void chunk_gate_forward(const ChunkGateParams& p, void* stream) {
  launch_chunk_gate<false>(p, stream, "chunk_gate_forward");
}

void chunk_gate_backward(const ChunkGateParams& p, void* stream) {
  launch_chunk_gate<true>(p, stream, "chunk_gate_backward");
}

}  // namespace lt2::kernels
