// Sparse flash-decoding (sparse_attention_decode.h): attention_decode's split/combine design over
// a gathered list of cache rows. In the CUDA-core form (the tensor-core one is below) a split
// block of 128 threads takes whole 16-key tiles of its sequence's index list and, for each tile:
//   1. copies the 16 selected rows (keys, and values unless they alias the keys) into shared
//      memory with 16-byte cp.async, double-buffered: tile t + 1 is in flight while t is computed;
//      the row numbers are fetched two tiles ahead, so no load waits on an index load;
//   2. scores: 16 thread tiles of 8 lanes; the 8 lanes share a key row (chunk r, r + 8, ... of the
//      row each), a tile computes a few heads x keys dot products against the block's fp32 query
//      (pre-scaled to base-2 logits), reduced over the 8 lanes by shuffles;
//   3. online softmax (running max and sum per head, base 2), one half-warp per head row;
//   4. values: a thread owns a few heads x 16-byte chunks of the output for a subset of the tile's
//      keys (key groups, merged in shared memory at the end when there are several).
// Every selected row is read from global memory once per kv head and used by all G query heads of
// the block. The splits' (max, sum, acc) partials are merged by the combine kernel
// (split_combine.cuh), or, with DSA's output absorption folded in, by absorb_combine_kernel
// (below). The split count depends only on the shapes, the counts and indices are read on the
// device, so a captured graph replays with new ones.
//
// Floor. Bytes: B Hkv n (Dk + Dv, or Dk when the values alias the keys) x dtype size. DSA's latent
// preset (B 8, n 2048, one kv head of 576 bf16 dims, aliased) reads 18.9 MB: 4.5 us at 4.2 TB/s;
// its GQA form (Hkv 16, D 128, separate values) 134 MB: 32 us. FMAs: B Hkv n G (Dk + Dv): with
// G = 16 the latent preset needs 285 M, >= 8.5 us at the H200's fp32 peak, so on CUDA cores it is
// FMA-bound, which is why that preset runs the tensor-core form below. For G <= 4 it is memory
// bound.
//
// Two forms:
//   - tensor cores (sparse_attention_mma_kernel): bf16 / fp16, Dk 576, Dv 512 aliased in the
//     keys, G 16, i.e. DSA's latent preset. mma m16n8k16 with M = the 16 heads: S = Q K^T and
//     O += P V per 32-key tile, a 4-stage cp.async ring of tiles, 8 warps, one block per SM. The
//     products are 71 MFLOP a sequence (0.57 GFLOP at batch 8), far below what mma.sync
//     sustains, so the gather should bound it; in the engine it takes ~12 us a call at 4k x 8
//     against 4.5 us of bytes (bench/results/decode_h200.md), each tile a dependent chain of
//     scores, softmax and P V with its barriers. It runs its own split count
//     (tc::splits: about one block per SM, at least two tiles a split; n 2048 on 132 SMs: 32
//     splits at batch 1, 16 at batch 8), never more than the caller's workspace
//     (sparse_attention_decode_num_splits) holds, so the partials and the combine stay small
//     (sparse_attention_decode_splits_used says how many);
//   - CUDA cores (sparse_attention_split_kernel, below): every other shape, fp32, separate values
//     and NSA. 16-key tiles so batch 1 fills 132 SMs: the latent preset in fp32 splits its 2048
//     rows into 128 one-tile splits (at batch 8, 32 splits of four tiles); the GQA form runs 16 kv
//     heads x 66 splits of two tiles.
#include "lt2/kernels/sparse_attention_decode.h"

#include <cooperative_groups.h>

#include <atomic>

#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/cuda/split_combine.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kTileKeys = 16;   // keys per tile (rows per shared-memory buffer)
constexpr int kDotLanes = 8;    // lanes sharing one key row in the score loop
constexpr float kLog2e = 1.4426950408889634f;

constexpr size_t round16(size_t bytes) { return (bytes + 15) / 16 * 16; }


template <typename T, int DK, int DV, int GMAX>
struct SparseShape {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  static constexpr int kChunksK = DK / kVec, kChunksV = DV / kVec;
  static constexpr int kQuads = kVec / 4;  // float4 pieces of a chunk in the fp32 query

  // Scores: thread tile (tid / 8) computes kScoreHeads x kScoreKeys dot products; its 8 lanes
  // take chunks lane, lane + 8, ... of the row (kChunksPerLane each).
  static constexpr int kScoreHeads = GMAX < 4 ? GMAX : 4;
  static constexpr int kScoreKeys = GMAX / kScoreHeads;
  static constexpr int kKeyTiles = kTileKeys / kScoreKeys;
  static constexpr int kChunksPerLane = kChunksK / kDotLanes;

  // Values: a thread accumulates kOutHeads heads x kOutChunks chunks of the output (chunks
  // c, c + kChunkThreads, ...) over the keys jj = key group (mod kKeyGroups) of each tile.
  static constexpr int kOutHeads = GMAX < 8 ? GMAX : 8;
  static constexpr int kOutHeadTiles = GMAX / kOutHeads;
  static constexpr int kUnits = kOutHeadTiles * kChunksV;
  static constexpr int kOutChunks = kUnits >= kThreads ? kUnits / kThreads : 1;
  static constexpr int kKeyGroups = kUnits >= kThreads ? 1 : kThreads / kUnits;
  static constexpr int kChunkThreads = kChunksV / kOutChunks;

  static_assert(DK % kVec == 0 && DV % kVec == 0, "head dims must fill whole 16-byte chunks");
  static_assert(kChunksK % kDotLanes == 0, "a key row must split evenly over the dot lanes");
  static_assert(kScoreHeads * kScoreKeys == GMAX &&
                    (GMAX / kScoreHeads) * kKeyTiles * kDotLanes == kThreads,
                "the score tiles must cover heads x keys with every thread");
  static_assert(kChunkThreads * kOutHeadTiles * kKeyGroups == kThreads && kKeyGroups <= kTileKeys,
                "the value accumulators must cover heads x chunks with every thread");
  static_assert(kChunkThreads >= 8, "a quarter-warp reads 8 consecutive chunks of one value row");
  static_assert((kTileKeys * kChunksK) % kThreads == 0 && (kTileKeys * kChunksV) % kThreads == 0,
                "a tile's copies must split evenly over the threads");

  // Shared memory, in bytes: the fixed part, then the key/value tiles (after the last tile, the
  // key groups' partial outputs in the same place). Every section is a multiple of 16 bytes.
  static constexpr size_t kQBytes = size_t{4} * GMAX * DK;           // fp32 query
  static constexpr size_t kTileStatBytes = size_t{4} * GMAX * kTileKeys;  // scores, probabilities
  static constexpr size_t kRowStatBytes = round16(size_t{4} * GMAX);  // correction, max, sum
  static constexpr size_t kRowsBytes = size_t{4} * 2 * kTileKeys;     // row numbers of two tiles
  static constexpr size_t kScoreOffset = kQBytes;
  static constexpr size_t kProbOffset = kScoreOffset + kTileStatBytes;
  static constexpr size_t kCorrOffset = kProbOffset + kTileStatBytes;
  static constexpr size_t kMaxOffset = kCorrOffset + kRowStatBytes;
  static constexpr size_t kSumOffset = kMaxOffset + kRowStatBytes;
  static constexpr size_t kRowsOffset = kSumOffset + kRowStatBytes;
  static constexpr size_t kTilesOffset = kRowsOffset + kRowsBytes;
  static constexpr size_t kKeyTileBytes = size_t{2} * kTileKeys * DK * sizeof(T);
  static constexpr size_t kValueTileBytes = size_t{2} * kTileKeys * DV * sizeof(T);
  static constexpr size_t kMergeBytes = kKeyGroups > 1 ? size_t{4} * kKeyGroups * GMAX * DV : 0;
  static constexpr size_t smem_bytes(bool alias) {
    const size_t tiles = kKeyTileBytes + (alias ? 0 : kValueTileBytes);
    return kTilesOffset + (tiles > kMergeBytes ? tiles : kMergeBytes);
  }
};

// Whether the splits leave fp32 partials for a combine (several splits, or the folded output
// absorption) instead of writing out.
__device__ __forceinline__ bool writes_partials(const SparseAttentionDecodeParams& p) {
  return p.num_splits > 1 || p.absorb_w != nullptr;
}

// 16 bytes from global to shared memory without a register round trip; read = false zero-fills
// the destination without touching `src` (a key past the split's end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool read) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(read ? 16 : 0)
               : "memory");
}

// Two blocks per SM as the occupancy target: it still leaves 255 registers a thread, and with it
// ptxas keeps every instance free of spills (without it, the (128, 128) G = 16 ones spill).
template <typename T, int DK, int DV, int GMAX>
__global__ void __launch_bounds__(kThreads, 2)
    sparse_attention_split_kernel(const SparseAttentionDecodeParams p, const bool alias) {
  using Shape = SparseShape<T, DK, DV, GMAX>;
  constexpr int VEC = Shape::kVec, CK = Shape::kChunksK, CV = Shape::kChunksV, TK = kTileKeys;
  constexpr int QUADS = Shape::kQuads, SH = Shape::kScoreHeads, SK = Shape::kScoreKeys;
  constexpr int OH = Shape::kOutHeads, OC = Shape::kOutChunks, KG = Shape::kKeyGroups;
  constexpr int CT = Shape::kChunkThreads;
  constexpr int kRowsPerHalfWarp = (GMAX + 7) / 8;

  extern __shared__ __align__(16) unsigned char smem[];
  // [GMAX][QUADS][CK][4]: 4-float piece `quad` of chunk c of head g at ((g QUADS + quad) CK + c) 4,
  // so the 8 lanes of a dot read 128 consecutive bytes.
  float* s_q = reinterpret_cast<float*>(smem);
  float* s_score = reinterpret_cast<float*>(smem + Shape::kScoreOffset);  // [GMAX][TK]
  float* s_prob = reinterpret_cast<float*>(smem + Shape::kProbOffset);    // [TK][GMAX]
  float* s_corr = reinterpret_cast<float*>(smem + Shape::kCorrOffset);    // [GMAX] this tile's rescale
  float* s_max = reinterpret_cast<float*>(smem + Shape::kMaxOffset);      // [GMAX] running max
  float* s_sum = reinterpret_cast<float*>(smem + Shape::kSumOffset);      // [GMAX] running sum
  int* s_rows = reinterpret_cast<int*>(smem + Shape::kRowsOffset);        // [2][TK], -1: no key
  T* s_k = reinterpret_cast<T*>(smem + Shape::kTilesOffset);              // [2][TK][DK]
  // [2][TK][DV], or the key rows themselves when the values alias the keys.
  T* s_v = alias ? s_k : s_k + 2 * TK * DK;
  const int v_row = alias ? DK : DV;  // elements between value rows in shared memory

  const int split = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z;
  const int G = p.q_heads / p.kv_heads, S = p.num_splits, tid = threadIdx.x;
  const int64_t count64 = p.counts[b];
  const int count = static_cast<int>(count64 < 0 ? 0 : (count64 > p.n ? p.n : count64));
  // Splits take whole tiles, so only the last tile of a sequence is partial; the count is read on
  // the device, the split count is fixed.
  const int chunk = ceil_div(count, S * TK) * TK;
  const int start = min(split * chunk, count), end = min(start + chunk, count);
  const int64_t row0 = static_cast<int64_t>(b) * p.q_heads + hkv * G;  // output row of head 0
  T* out = static_cast<T*>(p.out);
  const bool partials = writes_partials(p);
  // Output element d of head g (g < G): this split's partial, or the final value.
  auto store = [&](int g, int d, float value) {
    const int64_t row = row0 + g;
    if (partials) p.partial_out[(row * S + split) * DV + d] = value;
    else out[row * DV + d] = from_float<T>(value);
  };

  if (start >= end) {  // nothing to attend: an empty partial (weight 0 in the combine)
    for (int i = tid; i < G * DV; i += kThreads) store(i / DV, i % DV, 0.f);
    if (partials && tid < G) p.partial_lse[(row0 + tid) * S + split] = -INFINITY;
    return;
  }

  const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + hkv * G * p.q_head_stride;
  const T* k_head = static_cast<const T*>(p.k_cache) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_head = static_cast<const T*>(p.v_cache) + b * p.v_batch_stride + hkv * p.v_head_stride;
  const int64_t* indices = p.indices + static_cast<int64_t>(b) * p.n;

  // Cache row of key j of the split; -1 past its end. Entries out of [0, Lmax) are clamped so a
  // bad index cannot read outside the cache.
  auto row_of = [&](int j) -> int {
    if (j >= end) return -1;
    const int64_t r = __ldg(indices + j);
    return static_cast<int>(r < 0 ? 0 : (r >= p.max_len ? p.max_len - 1 : r));
  };
  // Starts the copies of the tile whose rows are in s_rows[buf] into buffer `buf`.
  auto load_tile = [&](int buf) {
    const int* rows = s_rows + buf * TK;
    T* dst_k = s_k + buf * TK * DK;
#pragma unroll
    for (int i = 0; i < TK * CK / kThreads; ++i) {
      const int e = tid + i * kThreads, jj = e / CK, c = e % CK, r = rows[jj];
      cp_async16(dst_k + jj * DK + c * VEC, k_head + (r < 0 ? 0 : r * p.k_row_stride) + c * VEC, r >= 0);
    }
    if (!alias) {
      T* dst_v = s_v + buf * TK * DV;
#pragma unroll
      for (int i = 0; i < TK * CV / kThreads; ++i) {
        const int e = tid + i * kThreads, jj = e / CV, c = e % CV, r = rows[jj];
        cp_async16(dst_v + jj * DV + c * VEC, v_head + (r < 0 ? 0 : r * p.v_row_stride) + c * VEC, r >= 0);
      }
    }
  };

  if (tid < TK) {
    s_rows[tid] = row_of(start + tid);
    s_rows[TK + tid] = row_of(start + TK + tid);
  }
  __syncthreads();  // rows of tiles 0 and 1 visible
  load_tile(0);
  cp_async_commit();
  int next_rows = tid < TK ? row_of(start + 2 * TK + tid) : -1;  // tile 2, stored after tile 0

  // The query of every head in fp32, scaled so that scores are base-2 logits; heads G..GMAX-1
  // (padding of the instance) are zeros. Staged while tile 0 is in flight; the first barrier
  // of the loop publishes it.
  const float q_scale = p.scale * kLog2e;
  for (int i = tid; i < GMAX * CK; i += kThreads) {
    const int g = i / CK, c = i % CK;
    float f[VEC];
    if (g < G) {
      unpack16<T>(__ldg(reinterpret_cast<const uint4*>(q_base + g * p.q_head_stride + c * VEC)), f);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int quad = 0; quad < QUADS; ++quad)
      *reinterpret_cast<float4*>(s_q + ((g * QUADS + quad) * CK + c) * 4) =
          make_float4(f[4 * quad] * q_scale, f[4 * quad + 1] * q_scale, f[4 * quad + 2] * q_scale,
                      f[4 * quad + 3] * q_scale);
  }

  // Thread roles. Scores: tile (tid / 8) = head block x key block, lane r = tid % 8 (the three
  // low bits, so the reduction stays within the tile's lanes; the 4 tiles of a warp share heads).
  const int lane = tid % kDotLanes, score_tile = tid / kDotLanes;
  const int score_head = (score_tile / Shape::kKeyTiles) * SH;
  const int score_key = (score_tile % Shape::kKeyTiles) * SK;
  // Softmax: half-warp (tid / 16) owns head rows half, half + 8; lane tid % 16 = key of the tile.
  const int soft_half = tid / 16, soft_key = tid % 16;
  // Values: chunk thread (fastest, so a warp reads consecutive chunks of one row), head block,
  // key group.
  const int out_chunk = tid % CT;
  const int out_head = (tid / CT) % Shape::kOutHeadTiles * OH;
  const int key_group = tid / (CT * Shape::kOutHeadTiles);

  float m_run[kRowsPerHalfWarp], l_run[kRowsPerHalfWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
  }
  float acc[OH][OC][VEC];
#pragma unroll
  for (int h = 0; h < OH; ++h)
#pragma unroll
    for (int n = 0; n < OC; ++n)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][n][e] = 0.f;

  const int tiles = ceil_div(end - start, TK);
  for (int t = 0; t < tiles; ++t) {
    const int buf = t & 1;
    // Buffer buf ^ 1 was last read in iteration t - 1, which ended with a barrier.
    if (t + 1 < tiles) load_tile(buf ^ 1);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning tile t
    cp_async_wait<1>();
    __syncthreads();  // tile t landed for every thread's copies

    {  // Scores of the tile: s_score[g][jj] = q_g . k_jj (base-2 logits).
      const T* keys = s_k + buf * TK * DK;
      float dot[SH][SK];
#pragma unroll
      for (int h = 0; h < SH; ++h)
#pragma unroll
        for (int k = 0; k < SK; ++k) dot[h][k] = 0.f;
#pragma unroll
      for (int i = 0; i < Shape::kChunksPerLane; ++i) {
        const int c = lane + i * kDotLanes;
        float kf[SK][VEC];
#pragma unroll
        for (int k = 0; k < SK; ++k)
          unpack16<T>(*reinterpret_cast<const uint4*>(keys + (score_key + k) * DK + c * VEC), kf[k]);
#pragma unroll
        for (int h = 0; h < SH; ++h) {
          float qf[VEC];
#pragma unroll
          for (int quad = 0; quad < QUADS; ++quad) {
            const float4 v =
                *reinterpret_cast<const float4*>(s_q + (((score_head + h) * QUADS + quad) * CK + c) * 4);
            qf[4 * quad] = v.x, qf[4 * quad + 1] = v.y, qf[4 * quad + 2] = v.z, qf[4 * quad + 3] = v.w;
          }
#pragma unroll
          for (int k = 0; k < SK; ++k)
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot[h][k] = fmaf(qf[e], kf[k][e], dot[h][k]);
        }
      }
#pragma unroll
      for (int h = 0; h < SH; ++h)
#pragma unroll
        for (int k = 0; k < SK; ++k) {
#pragma unroll
          for (int off = kDotLanes / 2; off > 0; off >>= 1)
            dot[h][k] += __shfl_xor_sync(0xffffffffu, dot[h][k], off);
          if (lane == 0) s_score[(score_head + h) * TK + score_key + k] = dot[h][k];
        }
    }
    __syncthreads();

    {  // Online softmax per head row; every thread runs the shuffles (full-warp masks).
      const bool valid = start + t * TK + soft_key < end;  // a tile's key 0 always is
#pragma unroll
      for (int i = 0; i < kRowsPerHalfWarp; ++i) {
        const int g = soft_half + 8 * i;
        const bool owned = g < GMAX;  // half-warps past the instance's heads compute on zeros
        const float s = !valid ? -INFINITY : (owned ? s_score[g * TK + soft_key] : 0.f);
        float mx = s;
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_new = fmaxf(m_run[i], mx);  // finite: key 0 is valid
        const float corr = exp2f(m_run[i] - m_new);  // 0 on the first tile (m_run = -inf)
        const float prob = valid ? exp2f(s - m_new) : 0.f;
        float sum = prob;
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        l_run[i] = l_run[i] * corr + sum;
        m_run[i] = m_new;
        if (owned) {
          s_prob[soft_key * GMAX + g] = prob;
          if (soft_key == 0) {
            s_corr[g] = corr;
            s_max[g] = m_new;
            s_sum[g] = l_run[i];
          }
        }
      }
    }
    __syncthreads();

    {  // Values: acc = corr * acc + sum over this thread's keys of prob * v.
      const T* values = s_v + buf * TK * v_row;
#pragma unroll
      for (int h = 0; h < OH; ++h) {
        const float corr = s_corr[out_head + h];
#pragma unroll
        for (int n = 0; n < OC; ++n)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[h][n][e] *= corr;
      }
#pragma unroll
      for (int i = 0; i < TK / KG; ++i) {
        const int jj = key_group + i * KG;  // keys past the end have prob 0 and zero rows
        float prob[OH];
        if constexpr (OH % 4 == 0) {
#pragma unroll
          for (int h = 0; h < OH; h += 4) {
            const float4 v = *reinterpret_cast<const float4*>(s_prob + jj * GMAX + out_head + h);
            prob[h] = v.x, prob[h + 1] = v.y, prob[h + 2] = v.z, prob[h + 3] = v.w;
          }
        } else {
#pragma unroll
          for (int h = 0; h < OH; ++h) prob[h] = s_prob[jj * GMAX + out_head + h];
        }
#pragma unroll
        for (int n = 0; n < OC; ++n) {
          float vf[VEC];
          unpack16<T>(*reinterpret_cast<const uint4*>(values + jj * v_row + (out_chunk + n * CT) * VEC), vf);
#pragma unroll
          for (int h = 0; h < OH; ++h)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[h][n][e] = fmaf(prob[h], vf[e], acc[h][n][e]);
        }
      }
    }
    // Rows of tile t + 2 into the slot tile t used (its copies were issued an iteration ago).
    if (tid < TK) s_rows[buf * TK + tid] = next_rows;
    next_rows = tid < TK ? row_of(start + (t + 3) * TK + tid) : -1;
    __syncthreads();  // buffer buf and the tile statistics are free again
  }
  // Every copy has landed (the last iteration committed an empty group) and every thread is past
  // its last read of the tiles, so their space can hold the key groups' partial outputs.

  if constexpr (KG == 1) {
#pragma unroll
    for (int h = 0; h < OH; ++h) {
      const int g = out_head + h;
      if (g >= G) continue;
      const float inv_l = 1.f / s_sum[g];
#pragma unroll
      for (int n = 0; n < OC; ++n)
#pragma unroll
        for (int e = 0; e < VEC; ++e) store(g, (out_chunk + n * CT) * VEC + e, acc[h][n][e] * inv_l);
    }
  } else {
    float* s_merge = reinterpret_cast<float*>(smem + Shape::kTilesOffset);  // [KG][GMAX][DV]
#pragma unroll
    for (int h = 0; h < OH; ++h)
#pragma unroll
      for (int n = 0; n < OC; ++n)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          s_merge[(key_group * GMAX + out_head + h) * DV + (out_chunk + n * CT) * VEC + e] = acc[h][n][e];
    __syncthreads();
    for (int i = tid; i < G * DV; i += kThreads) {
      const int g = i / DV, d = i % DV;
      float a = 0.f;
#pragma unroll
      for (int r = 0; r < KG; ++r) a += s_merge[(r * GMAX + g) * DV + d];
      store(g, d, a / s_sum[g]);
    }
  }
  if (partials && tid < G) p.partial_lse[(row0 + tid) * S + split] = s_max[tid] + log2f(s_sum[tid]);
}

template <typename T, int DK, int DV, int GMAX>
void launch_split(const SparseAttentionDecodeParams& p, bool alias, cudaStream_t stream) {
  const size_t smem = SparseShape<T, DK, DV, GMAX>::smem_bytes(alias);
  reserve_shared<sparse_attention_split_kernel<T, DK, DV, GMAX>>(smem, "sparse_attention_decode");
  const dim3 grid(p.num_splits, p.kv_heads, p.batch);
  sparse_attention_split_kernel<T, DK, DV, GMAX><<<grid, kThreads, smem, stream>>>(p, alias);
}

// Query heads per kv head -> the instance with that many (padded to a power of two).
template <typename T, int DK, int DV>
void launch_groups(const SparseAttentionDecodeParams& p, int groups, bool alias, cudaStream_t stream) {
  if (groups <= 1) launch_split<T, DK, DV, 1>(p, alias, stream);
  else if (groups <= 2) launch_split<T, DK, DV, 2>(p, alias, stream);
  else if (groups <= 4) launch_split<T, DK, DV, 4>(p, alias, stream);
  else if (groups <= 8) launch_split<T, DK, DV, 8>(p, alias, stream);
  else launch_split<T, DK, DV, 16>(p, alias, stream);
}


// ---- Tensor-core form: the latent preset (bf16 / fp16, Dk 576, Dv 512 aliased in the keys, G 16).
namespace tc {
constexpr int kHeads = 16;  // the M of mma m16n8k16: the query heads of the kv head
constexpr int kDk = 576, kDv = 512;
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kTileKeys = 32;         // keys per tile (rows per shared-memory stage)
constexpr int kStages = 4;            // tiles in shared memory: kStages - 1 in flight while one is computed
constexpr int kMinTilesPerSplit = 2;  // fewer, longer splits: each writes 32 KB of fp32 partials
// Shared-memory row of a key: 1168 bytes, so the 8 rows an ldmatrix reads start 16 bytes apart
// modulo 128 (distinct banks); the 16 padding bytes are never read.
constexpr int kPitch = kDk + 8;
constexpr int kChunks = kDk / 8;  // 16-byte chunks of a row (2-byte T)
// Scores: warp w takes dims [144 (w % 4), +144) (9 k-steps) of keys [16 (w / 4), +16) (two n8
// tiles); the four dim quarters are summed in shared memory.
constexpr int kKSplit = 4;
constexpr int kKSteps = kDk / 16 / kKSplit;
constexpr int kRedPitch = kTileKeys + 8;   // floats: float2 stores of the 8 rows g hit 2 wavefronts
constexpr int kProbPitch = kTileKeys + 8;  // T: the A-fragment loads of the 8 rows g hit distinct banks
// Values: warp w owns output dims [64 w, +64) (8 n8 tiles) of all 16 heads.
constexpr int kColsPerWarp = kDv / kWarps;
static_assert(kKSplit * 2 == kWarps && kTileKeys == 2 * 16, "score warps: 4 dim quarters x 2 key halves");
static_assert(kKSteps * 16 * kKSplit == kDk && kColsPerWarp == 64, "warp tiles must cover the head dims");
static_assert((kTileKeys * kChunks) % kThreads == 0, "a tile's copies must split evenly over the threads");

constexpr size_t kTileBytes = size_t{2} * kTileKeys * kPitch;
constexpr size_t kRedOffset = kStages * kTileBytes;
constexpr size_t kProbOffset = kRedOffset + size_t{4} * kKSplit * kHeads * kRedPitch;
constexpr size_t kCorrOffset = kProbOffset + size_t{2} * kHeads * kProbPitch;
constexpr size_t kMaxOffset = kCorrOffset + size_t{4} * kHeads;
constexpr size_t kSumOffset = kMaxOffset + size_t{4} * kHeads;
constexpr size_t kRowsOffset = kSumOffset + size_t{4} * kHeads;
constexpr size_t kSmemBytes = kRowsOffset + size_t{4} * kStages * kTileKeys;  // 161,728 bytes
static_assert(kProbOffset % 16 == 0 && kRowsOffset % 16 == 0, "sections stay 16-byte aligned");

// Splits of the tensor-core form: about one block per SM (a block holds 158 KB of shared memory),
// at least kMinTilesPerSplit tiles each, the tiles spread evenly (no split left empty by the
// rounding at count = n), and never more than the caller's workspace holds.
int splits(int batch, int kv_heads, int n, int sms, int workspace_splits) {
  const int tiles = ceil_div(std::max(1, n), kTileKeys);
  int target = ceil_div(sms, std::max(1, batch * kv_heads));
  target = std::max(1, std::min(target, tiles / kMinTilesPerSplit));
  const int per_split = ceil_div(tiles, target);
  return std::clamp(std::min(ceil_div(tiles, per_split), workspace_splits), 1, kSparseAttentionMaxSplits);
}
}  // namespace tc

// Four 8 x 8 matrices of 16-bit elements from shared memory; lanes 8 i .. 8 i + 7 give the row
// addresses of matrix i (16-byte aligned), and lane 4 g + t receives in r[i] the pair (row g,
// columns 2t, 2t + 1) of matrix i, the lower column in the low half.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}
// The same, transposed: lane 4 g + t receives (rows 2t, 2t + 1, column g) of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}
__device__ __forceinline__ uint32_t lds32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The latent preset on tensor cores. Grid = splits x Hkv x B, 256 threads (8 warps), one block per
// SM; a block takes whole 32-key tiles of its split, kStages of them in shared memory (cp.async,
// the row numbers fetched a tile ahead of their copies). Per tile, with lane = 4 g + t
// (mma_16816's fragment convention):
//   S = Q K^T: A = Q [16 heads, 576], its fragments loaded once into registers (36 a warp: the
//      warp's dim quarter); B = K^T, whose n8 columns are key rows with k contiguous, i.e. the
//      shared-memory rows themselves: ldmatrix (not transposed) of 8 keys x 8 dims gives b0 / b1.
//      The 4 dim quarters' partial sums meet in shared memory;
//   online softmax in fp32, base 2, one half-warp per head row (2 keys a lane); P is rounded to
//      T into shared memory, the row's rescale factor beside it;
//   O += P V: A = P [16 heads, 32 keys] (two k-steps), B = V [keys, dims], the keys' first 512
//      dims: ldmatrix.trans of 8 keys x 8 dims gives b0 / b1 (k = key). Each warp keeps its 64
//      output dims of all 16 heads in 32 fp32 accumulators a thread.
// Counts, empty splits, the partial format and the single-split direct write are the CUDA-core
// kernel's.
template <typename T>
__global__ void __launch_bounds__(tc::kThreads, 1)
    sparse_attention_mma_kernel(const SparseAttentionDecodeParams p) {
  dependent_kernel_start();
  using namespace tc;
  constexpr int TK = tc::kTileKeys, kThreads = tc::kThreads;  // (the CUDA-core form's names shadowed)
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_tiles = reinterpret_cast<T*>(smem);                             // [kStages][TK][kPitch]
  float* s_red = reinterpret_cast<float*>(smem + kRedOffset);          // [kKSplit][16][kRedPitch]
  T* s_prob = reinterpret_cast<T*>(smem + kProbOffset);                // [16][kProbPitch]
  float* s_corr = reinterpret_cast<float*>(smem + kCorrOffset);        // [16] this tile's rescale
  float* s_max = reinterpret_cast<float*>(smem + kMaxOffset);          // [16]
  float* s_sum = reinterpret_cast<float*>(smem + kSumOffset);          // [16]
  int* s_rows = reinterpret_cast<int*>(smem + kRowsOffset);            // [kStages][TK], -1: no key

  const int split = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int S = p.num_splits;
  const int64_t count64 = p.counts[b];
  const int count = static_cast<int>(count64 < 0 ? 0 : (count64 > p.n ? p.n : count64));
  const int chunk = ceil_div(count, S * TK) * TK;
  const int start = min(split * chunk, count), end = min(start + chunk, count);
  const int64_t row0 = static_cast<int64_t>(b) * p.q_heads + hkv * kHeads;  // output row of head 0
  T* out = static_cast<T*>(p.out);
  const bool partials = writes_partials(p);
  // Output elements d, d + 1 (d even) of head h.
  auto store2 = [&](int h, int d, float x, float y) {
    const int64_t row = row0 + h;
    if (partials) *reinterpret_cast<float2*>(p.partial_out + (row * S + split) * kDv + d) = make_float2(x, y);
    else *reinterpret_cast<uint32_t*>(out + row * kDv + d) = pack2<T>(x, y);
  };

  if (start >= end) {  // nothing to attend: an empty partial (weight 0 in the combine), or zeros
    for (int i = tid; i < kHeads * kDv / 2; i += kThreads) store2(i / (kDv / 2), 2 * (i % (kDv / 2)), 0.f, 0.f);
    if (partials && tid < kHeads) p.partial_lse[(row0 + tid) * S + split] = -INFINITY;
    return;
  }

  const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + hkv * kHeads * p.q_head_stride;
  const T* k_head = static_cast<const T*>(p.k_cache) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const int64_t* indices = p.indices + static_cast<int64_t>(b) * p.n;
  auto row_of = [&](int j) -> int {
    if (j >= end) return -1;
    const int64_t r = __ldg(indices + j);
    return static_cast<int>(r < 0 ? 0 : (r >= p.max_len ? p.max_len - 1 : r));
  };
  auto load_tile = [&](int slot) {
    const int* rows = s_rows + slot * TK;
    T* dst = s_tiles + slot * TK * kPitch;
#pragma unroll
    for (int i = 0; i < TK * kChunks / kThreads; ++i) {
      const int e = tid + i * kThreads, jj = e / kChunks, c = e % kChunks, r = rows[jj];
      cp_async16(dst + jj * kPitch + c * 8, k_head + (r < 0 ? 0 : r * p.k_row_stride) + c * 8, r >= 0);
    }
  };

  const int tiles = ceil_div(end - start, TK);
  if (tid < TK) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) s_rows[s * TK + tid] = row_of(start + s * TK + tid);
  }
  __syncthreads();  // rows of tiles 0 .. kStages - 1 visible
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load_tile(s);
    cp_async_commit();  // possibly empty: group s is tile s
  }
  int next_rows = tid < TK ? row_of(start + kStages * TK + tid) : -1;

  // Score warp roles and the A fragments of Q over the warp's dim quarter:
  // qa[i] = Q[g][k + 2t, +1], Q[g + 8][k + 2t, +1], Q[g][k + 8 + 2t, +1], Q[g + 8][k + 8 + 2t, +1],
  // k = 16 (9 kq + i). The scale is applied to the fp32 scores.
  const int kq = warp % kKSplit, key_half = warp / kKSplit;
  uint32_t qa[kKSteps][4];
  {
    const T* q_lo = q_base + g * p.q_head_stride + kq * kKSteps * 16 + 2 * t4;
    const T* q_hi = q_lo + 8 * p.q_head_stride;
#pragma unroll
    for (int i = 0; i < kKSteps; ++i) {
      qa[i][0] = __ldg(reinterpret_cast<const unsigned*>(q_lo + 16 * i));
      qa[i][1] = __ldg(reinterpret_cast<const unsigned*>(q_hi + 16 * i));
      qa[i][2] = __ldg(reinterpret_cast<const unsigned*>(q_lo + 16 * i + 8));
      qa[i][3] = __ldg(reinterpret_cast<const unsigned*>(q_hi + 16 * i + 8));
    }
  }
  // ldmatrix row addresses: lane = 8 mi + r gives row r of matrix mi.
  const int mi = lane / 8, mr = lane % 8;
  // Scores, matrix mi = (n8 tile mi / 2 of the warp's 16 keys, dims + 8 (mi % 2)): r[0], r[1] =
  // b0, b1 of n-tile 0; r[2], r[3] of n-tile 1 (b0 = K[key g][k + 2t, +1], b1 = ...[k + 8 + 2t, +1]).
  const int k_frag = (16 * key_half + 8 * (mi / 2) + mr) * kPitch + kq * kKSteps * 16 + 8 * (mi % 2);
  // Values, matrix mi = (keys + 8 (mi % 2), dims + 8 (mi / 2)) transposed: r[0], r[1] = b0, b1 of
  // the n-tile at dims c, r[2], r[3] of the one at c + 8 (b0 = V[key 2t, +1][c + g], b1 = keys + 8).
  const int v_frag = (8 * (mi % 2) + mr) * kPitch + warp * kColsPerWarp + 8 * (mi / 2);
  // Softmax: half-warp tid / 16 owns head row soft_row, lane tid % 16 keys soft_key, + 1.
  const int soft_row = tid / 16, soft_key = 2 * (tid % 16);
  const float score_scale = p.scale * kLog2e;

  float m_run = -INFINITY, l_run = 0.f;  // of head soft_row (every lane of its half-warp)
  float o[kColsPerWarp / 8][4];          // o[j] = O[g][c + 2t, +1], O[g + 8][c + 2t, +1], c = 64 warp + 8 j
#pragma unroll
  for (int j = 0; j < kColsPerWarp / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;

  for (int t = 0; t < tiles; ++t) {
    const int slot = t % kStages;
    // The slot of tile t + kStages - 1 was last read in iteration t - 1, which ended with a barrier.
    if (t + kStages - 1 < tiles) load_tile((t + kStages - 1) % kStages);
    cp_async_commit();  // possibly empty: keeps group t meaning tile t
    cp_async_wait<kStages - 1>();
    __syncthreads();  // tile t landed for every thread's copies
    const T* keys = s_tiles + slot * TK * kPitch;

    {  // Partial scores of the warp's dim quarter x 16 keys; two accumulator chains per n-tile.
      float acc[2][2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][c][e] = 0.f;
#pragma unroll
      for (int i = 0; i < kKSteps; ++i) {
        uint32_t kb[4];
        ldmatrix_x4(kb, keys + k_frag + 16 * i);
        mma_16816<T>(acc[0][i % 2], qa[i][0], qa[i][1], qa[i][2], qa[i][3], kb[0], kb[1]);
        mma_16816<T>(acc[1][i % 2], qa[i][0], qa[i][1], qa[i][2], qa[i][3], kb[2], kb[3]);
      }
      float* red = s_red + kq * kHeads * kRedPitch;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int key = 16 * key_half + 8 * n + 2 * t4;
        *reinterpret_cast<float2*>(red + g * kRedPitch + key) =
            make_float2(acc[n][0][0] + acc[n][1][0], acc[n][0][1] + acc[n][1][1]);
        *reinterpret_cast<float2*>(red + (g + 8) * kRedPitch + key) =
            make_float2(acc[n][0][2] + acc[n][1][2], acc[n][0][3] + acc[n][1][3]);
      }
    }
    __syncthreads();

    {  // Online softmax of head soft_row over the tile (keys past the split's end: -inf, p 0).
      float2 sc = make_float2(0.f, 0.f);
#pragma unroll
      for (int q = 0; q < kKSplit; ++q) {
        const float2 v = *reinterpret_cast<const float2*>(s_red + (q * kHeads + soft_row) * kRedPitch + soft_key);
        sc.x += v.x, sc.y += v.y;
      }
      const int j = start + t * TK + soft_key;
      const float s0 = j < end ? sc.x * score_scale : -INFINITY;
      const float s1 = j + 1 < end ? sc.y * score_scale : -INFINITY;
      float mx = fmaxf(s0, s1);
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);        // finite: a tile's key 0 is valid
      const float corr = exp2f(m_run - m_new);     // 0 on the first tile
      const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
      float sum = p0 + p1;
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l_run = l_run * corr + sum;
      m_run = m_new;
      *reinterpret_cast<uint32_t*>(s_prob + soft_row * kProbPitch + soft_key) = pack2<T>(p0, p1);
      if (tid % 16 == 0) s_corr[soft_row] = corr;
    }
    __syncthreads();

    {  // O = corr O + P V over the tile's two 16-key k-steps.
      const float c_lo = s_corr[g], c_hi = s_corr[g + 8];
#pragma unroll
      for (int j = 0; j < kColsPerWarp / 8; ++j) {
        o[j][0] *= c_lo, o[j][1] *= c_lo;
        o[j][2] *= c_hi, o[j][3] *= c_hi;
      }
#pragma unroll
      for (int ks = 0; ks < TK / 16; ++ks) {
        // a0 = P[g][16 ks + 2t, +1], a1 = P[g + 8][..], a2 = P[g][16 ks + 8 + 2t, +1], a3 = P[g + 8][..]
        const T* pr = s_prob + g * kProbPitch + 16 * ks + 2 * t4;
        const uint32_t a0 = lds32(pr), a1 = lds32(pr + 8 * kProbPitch);
        const uint32_t a2 = lds32(pr + 8), a3 = lds32(pr + 8 * kProbPitch + 8);
#pragma unroll
        for (int jp = 0; jp < kColsPerWarp / 16; ++jp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, keys + v_frag + 16 * ks * kPitch + 16 * jp);
          mma_16816<T>(o[2 * jp], a0, a1, a2, a3, vb[0], vb[1]);
          mma_16816<T>(o[2 * jp + 1], a0, a1, a2, a3, vb[2], vb[3]);
        }
      }
    }
    // Rows of tile t + kStages into the slot tile t used (its copies were issued long ago).
    if (tid < TK) s_rows[slot * TK + tid] = next_rows;
    next_rows = tid < TK ? row_of(start + (t + kStages + 1) * TK + tid) : -1;
    __syncthreads();  // slot t, the scores and the probabilities are free again
  }
  cp_async_wait<0>();  // only empty groups can remain; none may be pending at exit

  if (tid % 16 == 0) {
    s_max[soft_row] = m_run;
    s_sum[soft_row] = l_run;
  }
  __syncthreads();
  const float inv_lo = 1.f / s_sum[g], inv_hi = 1.f / s_sum[g + 8];
#pragma unroll
  for (int j = 0; j < kColsPerWarp / 8; ++j) {
    const int d = warp * kColsPerWarp + 8 * j + 2 * t4;
    store2(g, d, o[j][0] * inv_lo, o[j][1] * inv_lo);
    store2(g + 8, d, o[j][2] * inv_hi, o[j][3] * inv_hi);
  }
  if (partials && tid < kHeads) p.partial_lse[(row0 + tid) * S + split] = s_max[tid] + log2f(s_sum[tid]);
}

// ---- The combine with the output absorption folded in (p.absorb_w; DSA's latent form).
namespace absorb {
constexpr int kThreads = 128;  // one per output dim (Dy <= kSparseAbsorbMaxDim)
constexpr int kCols = 64;      // dims of o a block merges and contracts
static_assert(kThreads >= kSparseAbsorbMaxDim, "a thread per output dim");

// Shared memory: the block's merged o [B][kCols], its partial y [B][Dy], the splits' weights [B][S].
size_t smem_bytes(const SparseAttentionDecodeParams& p) {
  return sizeof(float) * p.batch * (static_cast<size_t>(p.num_splits) + kCols + p.absorb_dim);
}
}  // namespace absorb

// Grid = (Dv / 64) x Hq blocks in clusters of Dv / 64 (at most 8), one cluster per head h; block r
// owns o's dims [64 r, 64 r + 64):
//   1. before the dependency wait, thread j loads absorb_w[h, j, 64 r ..] (no kernel writes it)
//      into registers, so its round trip overlaps the end of the split kernel;
//   2. the splits' weights w_s = 2^(lse_s - M) / sum_s' 2^(lse_s' - M), a warp per sequence
//      (all zeros for a sequence whose splits are all empty);
//   3. o[b, 64 r + c] = sum_s w_s partial[b, h, s, 64 r + c] for every sequence b, in shared memory;
//   4. thread j: partial y[b, j] = sum_c o[b, 64 r + c] absorb_w[h, j, 64 r + c], in shared memory;
//   5. after a cluster barrier, block r sums the cluster's partial y over its share of the (b, j)
//      through distributed shared memory, applies the gate and rounds once.
// Every weight and partial element is read once, the sums are in a fixed order.
template <typename T>
__global__ void __launch_bounds__(absorb::kThreads)
    absorb_combine_kernel(const SparseAttentionDecodeParams p) {
  namespace cg = cooperative_groups;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T)), kChunks = absorb::kCols / VEC;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), blocks = static_cast<int>(cluster.num_blocks());
  const int h = blockIdx.x / blocks, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int B = p.batch, S = p.num_splits, Hq = p.q_heads, Dv = p.head_dim_v, Dy = p.absorb_dim;
  const int c0 = rank * absorb::kCols;
  uint4 w[kChunks];
  if (tid < Dy) {
    const uint4* row =
        reinterpret_cast<const uint4*>(static_cast<const T*>(p.absorb_w) + (static_cast<int64_t>(h) * Dy + tid) * Dv + c0);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) w[i] = __ldg(row + i);
  }
  dependent_kernel_start();

  extern __shared__ __align__(16) float s_absorb[];
  float* s_o = s_absorb;                  // [B][kCols] (first: its float4 reads stay aligned)
  float* s_y = s_o + B * absorb::kCols;   // [B][Dy]
  float* s_w = s_y + B * Dy;              // [B][S]
  for (int b = warp; b < B; b += absorb::kThreads / 32) {
    const float* lse = p.partial_lse + (static_cast<int64_t>(b) * Hq + h) * S;
    float m = -INFINITY;
    for (int s = lane; s < S; s += 32) m = fmaxf(m, lse[s]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float total = 0.f;
    for (int s = lane; s < S; s += 32) total += m == -INFINITY ? 0.f : exp2f(lse[s] - m);
    total = warp_sum(total);
    const float inv_total = total > 0.f ? 1.f / total : 0.f;
    for (int s = lane; s < S; s += 32) s_w[b * S + s] = m == -INFINITY ? 0.f : exp2f(lse[s] - m) * inv_total;
  }
  __syncthreads();
  for (int i = tid; i < B * absorb::kCols; i += absorb::kThreads) {
    const int b = i / absorb::kCols, c = i % absorb::kCols;
    const float* part = p.partial_out + (static_cast<int64_t>(b) * Hq + h) * S * Dv + c0 + c;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc = fmaf(s_w[b * S + s], part[static_cast<int64_t>(s) * Dv], acc);
    s_o[i] = acc;
  }
  __syncthreads();
  if (tid < Dy) {
    float wf[absorb::kCols];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) unpack16<T>(w[i], wf + i * VEC);
    for (int b = 0; b < B; ++b) {
      const float* o = s_o + b * absorb::kCols;  // one address per warp: a broadcast
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < absorb::kCols; c += 4) {
        const float4 v = *reinterpret_cast<const float4*>(o + c);
        acc = fmaf(wf[c + 3], v.w, fmaf(wf[c + 2], v.z, fmaf(wf[c + 1], v.y, fmaf(wf[c], v.x, acc))));
      }
      s_y[b * Dy + tid] = acc;
    }
  }
  cluster.sync();  // every block's partial y is complete and visible
  const T* gate = static_cast<const T*>(p.gate);
  T* y = static_cast<T*>(p.y);
  for (int i = rank * absorb::kThreads + tid; i < B * Dy; i += blocks * absorb::kThreads) {
    const int b = i / Dy, j = i % Dy;
    float acc = 0.f;
    for (int r = 0; r < blocks; ++r) acc += cluster.map_shared_rank(s_y, r)[i];
    if (gate) acc *= sigmoid(to_float(gate[b * p.gate_batch_stride + h * p.gate_head_stride + j]));
    y[(static_cast<int64_t>(b) * Hq + h) * Dy + j] = from_float<T>(acc);
  }
  cluster.sync();  // no block exits while another reads its partial y
}

// Whether p takes the tensor-core form (values alias the keys: `alias`).
bool use_mma_form(const SparseAttentionDecodeParams& p, int groups, bool alias) {
  return (p.dtype == DType::BFloat16 || p.dtype == DType::Float16) && p.head_dim_k == tc::kDk &&
         p.head_dim_v == tc::kDv && alias && groups == tc::kHeads;
}

bool values_alias_keys(const SparseAttentionDecodeParams& p) {
  return p.v_cache == p.k_cache && p.v_batch_stride == p.k_batch_stride && p.v_head_stride == p.k_head_stride &&
         p.v_row_stride == p.k_row_stride && p.head_dim_v <= p.head_dim_k;
}

int groups_of(const SparseAttentionDecodeParams& p) {
  return p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0 ? p.q_heads / p.kv_heads : 0;
}

// The splits the launcher runs for p (see sparse_attention_decode_splits_used).
int splits_used(const SparseAttentionDecodeParams& p) {
  if (!use_mma_form(p, groups_of(p), values_alias_keys(p)) || p.num_splits <= 1) return p.num_splits;
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  LT2_CHECK(err == cudaSuccess, "sparse_attention_decode: no current CUDA device: ", cudaGetErrorString(err));
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device, "sparse_attention_decode");
  return tc::splits(p.batch, p.kv_heads, p.n, sms, p.num_splits);
}

}  // namespace

int sparse_attention_decode_num_splits(int batch, int kv_heads, int groups, int n, int device) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device, "sparse_attention_decode");
  // Blocks wanted per SM. With more than 4 heads per kv head a block is FMA-bound (G (Dk + Dv)
  // FMAs per row read) and large (the fp32 query of all heads): two per SM keep the FMA units busy,
  // and fewer, longer splits write fewer partials. With fewer heads it is memory bound: more blocks
  // keep more copies in flight.
  const int per_sm = groups > 4 ? 2 : 8;
  int splits = ceil_div(per_sm * sms, std::max(1, batch * kv_heads));
  splits = std::min(splits, ceil_div(std::max(1, n), kTileKeys));  // at least a tile per split
  return std::clamp(splits, 1, kSparseAttentionMaxSplits);
}

int sparse_attention_decode_splits_used(const SparseAttentionDecodeParams& p) { return splits_used(p); }

void sparse_attention_decode(const SparseAttentionDecodeParams& p, void* stream) {
  const int groups = groups_of(p);
  LT2_CHECK(sparse_attention_decode_supported(p.head_dim_k, p.head_dim_v, groups),
            "sparse_attention_decode: head dims (", p.head_dim_k, ", ", p.head_dim_v, ") with ", p.q_heads,
            " query heads over ", p.kv_heads, " kv heads have no kernel instance (head dims (64, 64), "
            "(128, 128), (256, 256) or (576, 512); a multiple of the kv heads, at most ",
            kSparseAttentionMaxGroups, " query heads per kv head)");
  LT2_CHECK(p.n >= 1 && p.max_len >= 1, "sparse_attention_decode: ", p.n, " indices per sequence over ",
            p.max_len, " cache rows (at least one of each)");
  LT2_CHECK(p.num_splits >= 1 && p.num_splits <= kSparseAttentionMaxSplits &&
                (p.num_splits == 1 || (p.partial_out && p.partial_lse)),
            "sparse_attention_decode: ", p.num_splits, " splits (1..", kSparseAttentionMaxSplits,
            ", a workspace when more than one)");
  LT2_CHECK(p.batch >= 0 && p.batch <= 65535 && p.kv_heads <= 65535, "sparse_attention_decode: batch ",
            p.batch, " and kv heads ", p.kv_heads, " must fit a grid dimension (at most 65535)");
  LT2_CHECK(!p.absorb_w || (sparse_attention_absorb_supported(p.batch, p.head_dim_v, p.absorb_dim) && p.y &&
                            p.partial_out && p.partial_lse),
            "sparse_attention_decode: the folded output absorption takes 1..", kSparseAbsorbMaxRows,
            " sequences, Dv a multiple of 64 up to 512 and 1..", kSparseAbsorbMaxDim, " output dims, with y and a "
            "workspace; found batch ", p.batch, ", Dv ", p.head_dim_v, ", Dy ", p.absorb_dim);
  if (p.batch == 0) return;
  // The values are the keys' first Dv dims: read each row once.
  const bool alias = values_alias_keys(p);
  auto s = static_cast<cudaStream_t>(stream);
  // The tensor-core form runs its own (fewer) splits within the caller's workspace.
  SparseAttentionDecodeParams run = p;
  run.num_splits = splits_used(p);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, float>) {
      if (use_mma_form(p, groups, alias)) {
        reserve_shared<sparse_attention_mma_kernel<T>>(tc::kSmemBytes, "sparse_attention_decode");
        const dim3 grid(run.num_splits, p.kv_heads, p.batch);
        launch_dependent_on_small_grid(p.pdl, "sparse_attention_decode (tensor-core splits)", sparse_attention_mma_kernel<T>,
                                       grid, dim3(tc::kThreads), tc::kSmemBytes, s, {}, run);
      }
    }
    if (!use_mma_form(p, groups, alias)) {
      switch (p.head_dim_k) {
        case 64: launch_groups<T, 64, 64>(run, groups, alias, s); break;
        case 128: launch_groups<T, 128, 128>(run, groups, alias, s); break;
        case 256: launch_groups<T, 256, 256>(run, groups, alias, s); break;
        default: launch_groups<T, 576, 512>(run, groups, alias, s); break;
      }
      check_launch("sparse_attention_decode (splits)");
    }
    if (p.absorb_w) {
      const int blocks = p.head_dim_v / absorb::kCols;
      launch_dependent_on_small_grid(p.pdl, "sparse_attention_decode (combine with the output absorption)",
                                     absorb_combine_kernel<T>, dim3(blocks * p.q_heads), dim3(absorb::kThreads),
                                     absorb::smem_bytes(run), s, {cluster_launch(blocks)}, run);
    } else if (run.num_splits > 1) {
      // A block per 128 output dims of a row: at batch 1 the latent preset has only 16 rows.
      const dim3 grid(p.batch * p.q_heads, ceil_div(p.head_dim_v, kCombineThreads));
      launch_dependent_on_small_grid(p.pdl, "sparse_attention_decode (combine)",
                                     combine_splits_kernel<T, kSparseAttentionMaxSplits>, grid, dim3(kCombineThreads),
                                     0, s, {}, p.partial_out, p.partial_lse, static_cast<T*>(p.out), run.num_splits,
                                     p.head_dim_v);
    }
  });
}

}  // namespace lt2::kernels
