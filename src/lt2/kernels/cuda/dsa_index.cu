// DSA decode selection (dsa_decode.h): the lightning indexer's scores of one new token per sequence
// and the top-k over them.
//
// dsa_index_scores, tensor-core form (bf16/fp16, H and D multiples of 16, 16-byte aligned rows).
//   Floor: the valid index keys are read once, 2 D bytes a key (B = 8, L = 32k, D = 128: 67 MB,
//   ~16 us at ~4.2 TB/s). The math is a [keys x D] x [D x H] product per sequence, H flops per
//   key byte (64 at H = 64: 4.3 GFLOP at B = 8, L = 32k), within what mma.sync sustains at that
//   bandwidth, so the kernel is bound by the key reads.
//   Design: a block of 4 warps takes `tiles_per_block` consecutive tiles of 64 keys of one
//   sequence. It stages q [H, D] (and w) in shared memory once; the launcher gives a block several
//   tiles when the batch fills the GPU anyway, so re-reading q from L2 stays a fraction of the key
//   traffic. Per tile, warp w multiplies its 16 keys (the M side of mma.m16n8k16, A row-major)
//   with all H heads (the N side: B = q^T, whose "col" layout is q [H, D] row-major), fp32
//   accumulators [16 keys x H] in registers. The dot products sum over d in any order, so d is
//   permuted within each 32-wide chunk: the thread with lane % 4 == t holds elements
//   [8 t, 8 t + 8) of the chunk, the first four as its A elements (k = 2t, 2t+1, 2t+8, 2t+9) of the
//   chunk's first k-step, the last four of its second. So every key byte goes from global memory
//   straight into registers with one 16-byte load per row and chunk (no shared-memory staging of
//   the keys), and the q elements the same thread needs are one 16-byte shared load per head tile.
//   Epilogue in registers: relu, times w[head], summed over the thread's heads, then over the
//   quad of lanes that holds one key row (the mma C layout). Keys at or past the length are not
//   read; a warp or block with none left only writes -inf.
// dsa_index_scores, plain-FMA form (fp32, other shapes, unaligned rows): a block of 256 threads
//   takes 32 keys, stages them and q in shared memory as fp32, and thread (key, group) sums the
//   heads group, group + 8, ... of its key; the 8 groups are summed in shared memory. It is bound
//   by shared-memory reads (about one per FMA), far above the key-read floor: a fallback.
//
// dsa_index_backward (training; bf16): the products a = q k^T (computed by both kernels), dq = g k
//   and dkeys = g^T q, 2 D H FLOPs per visible (row, key) pair each. Floor at lt-100m's DSA layer
//   (16 sequences of 2048 rows, H 64, D 128, causal: 16 x 2048 x 2049 / 2 = 33.6M visible pairs):
//   4 x 2 x 64 x 128 x 33.6M = 2.2 TFLOP, ~3.3 ms at the ~660 TFLOP/s of bf16 mma.sync on an H100.
//   The bytes (d_scores, 4 per pair, read by both kernels: 268 MB; q and the keys re-read from L2
//   per row or key tile) stay below that.
//   dq/dw kernel: a block per (row, sequence), a warp per 16 heads (the M side), which keeps its q
//   rows as A fragments in registers and walks the row's visible keys in tiles of 64 staged in
//   shared memory: a = q K^T (B fragments straight from the tile's rows), g and dw's terms in
//   registers, then dq += g K, g's accumulators serving as the A fragments (the C layout of one
//   m16n8k16 is the A layout of the next, as in FlashAttention's P V) and K's B fragments coming
//   from ldmatrix.trans.
//   dkeys kernel: a block per (64 keys, sequence, part of the rows), a warp per 16 keys (M) held as
//   A fragments; it walks its part of the rows that see any of its keys, each row's q [H, D], w and
//   d_scores staged in shared memory: a^T = K q^T, g^T, then dkeys += g^T q (q's B fragments by
//   ldmatrix.trans), and writes its partial sum. The split fills the device: one block a key tile
//   would be 96 to 512 blocks over 396 slots (3 an SM) for a block of 372 rows at lt-100m's DSA
//   layer (6 to 32 key tiles x 16 sequences), each walking its rows one after another.
//   Shared-memory floor: every mma.sync of both kernels takes its B operand from shared memory (two
//   32-bit loads or half an ldmatrix.x4 a lane: 256 bytes a warp for 2048 FMAs), so a (row, key tile)
//   pair costs 4 warps x 128 mma x 256 B = 128 KB of shared reads in each kernel, ~1,024 cycles an
//   SM at 128 B a cycle, against ~820 for its mma at ~62% of the tensor peak: the kernels are bound
//   by shared-memory bandwidth. At lt-100m's DSA layer (540,672 pairs a layer application, 48 a
//   step at 2048 x 16) that is ~110 ms a step for each kernel on an H100 (~1.98 GHz, 132 SMs).
//   Beyond it: B fragments reused by more than one M tile (registers allow none: dkeys holds a
//   [16 keys x D] fp32 accumulator a warp) or wgmma, which reads its operands from shared memory
//   without the register file.
//   Both kernels keep two buffers of what they stage (a key tile, a row) and copy the next in by
//   cp.async while the products of the current one run: at 164 (dkeys) and 170 (dq) registers a
//   thread they hold 3 and 2 blocks of 4 warps an SM, too few to hide a copy's L2 latency behind
//   other blocks.
//
// dsa_head_probs (training; the indexer loss's target): per row, each head's softmax over the
//   support, summed over the heads. Floor: the scores are read once (B H rows keys elements) and the
//   target written once in fp32; at lt-100m's DSA layer (16 x 2048 rows over their visible keys,
//   12 heads) ~0.8 GB of bf16 scores and ~0.13 GB of target a layer application, ~0.3 ms at
//   ~3 TB/s. The libtorch form it replaces wrote and read the masked scores, the fp32 probabilities
//   [B, H, rows, keys], their head sum, the mask and the mass again: about six times those bytes.
//   Design: a block per row. Warp w takes heads w, w + 8, ...: its lanes stride over the keys with a
//   running (max, sum of exponentials) of the supported scores (one expf an element), merged across
//   the warp by shuffles, then 1 / sum goes to shared memory beside the max. Then each thread takes
//   keys t, t + 256, ... and sums exp(s_h - m_h) / sum_h over the heads, re-reading the row's scores
//   (just read, so from L2), and writes the mean over the heads. Two reads of the scores, no atomics.
//
// topk_select: a radix select on the 32-bit order-preserving key of each score (topk_indices'
//   map: negative floats bits inverted, others sign bit set; -0 taken as +0), 8 bits a pass from
//   the top, then one compaction pass. One thread-block cluster (sm_90) per row, of a block per
//   4,096 entries up to 16 blocks (8 where the device cannot place 16); block r owns a contiguous
//   slice of the row. Each pass, every block builds the
//   histogram of the next digit over its slice's entries that still match the chosen prefix; the
//   cluster barrier makes them visible, every block sums all of them through distributed shared
//   memory and finds the same digit: the bin holding the need-th largest remaining entry. The
//   passes stop once every entry matching the prefix is needed (at most 4 passes). The compaction
//   writes the entries above the threshold prefix, and the lowest-index `need` entries matching it
//   (all equal keys after 4 passes), each in ascending index: a block's offsets come from the
//   counts of the lower ranks, a warp's from a scan over the block's warps, a lane's from ballots.
//   Floor: the scores are fresh in L2 (B L 4 bytes: 1 MB at B = 8, L = 32k) and are read once:
//   each block keeps its slice's keys in shared memory (up to 16384 a block, so rows up to
//   131072 entries entirely with 8 blocks, 262144 with 16; the passes re-read the rest of longer
//   rows). Then the kernel is bound by one L2 round trip, at most 10 cluster barriers and the
//   shared-memory passes: a few microseconds for a whole batch. Long rows are bound by the passes
//   over each block's slice, so above 32k entries a row takes a non-portable cluster of up to 16
//   blocks where the device can place one: a block then walks at most 8,192 entries of a 128k row
//   per pass (bench/results/decode_topk16_h200.md has the 16-block cluster against 8).
#include <cooperative_groups.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/dsa_decode.h"

namespace lt2::kernels {
namespace {


// Lengths are at most kDsaMaxLength, so the int sums below cannot overflow.

// The sequence's valid length, clamped to [0, max_len].
__device__ __forceinline__ int valid_length(const int64_t* seq_lens, int b, int max_len) {
  const int64_t len = seq_lens[b];
  return static_cast<int>(len < 0 ? 0 : (len > max_len ? max_len : len));
}

// ---------------------------------------------------------------------------------------------
// dsa_index_scores, tensor-core form.

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaTileKeys = 16 * kMmaWarps;  // 16 keys (one mma M tile) per warp
constexpr int kMmaMaxTilesPerBlock = 8;
constexpr int kMmaTargetBlocksPerSm = 4;   // a block takes more tiles only while this many remain
constexpr int kMmaChunksPerLoad = 4;       // 32-wide d chunks in registers at once: 128 d, 32 registers

// Pitch (elements) of q's rows in shared memory: 64 bytes past a multiple of 128, so the 16-byte
// loads of lanes 0-7 (two rows, four lanes each) fall on distinct banks.
int mma_q_pitch(int D) { return (round_up(2 * D, 128) + 64) / 2; }
size_t mma_smem_bytes(int H, int D) { return sizeof(uint16_t) * H * mma_q_pitch(D) + sizeof(float) * H; }

// Grid (blocks of tiles_per_block tiles, B); HT = H / 16. The thread with lane = 4 g + t holds key
// rows g and g + 8 of its warp's 16 and, for n-tile nt, accumulators of heads 8 nt + 2 t, + 1.
template <typename T, int HT>
__global__ void __launch_bounds__(kMmaThreads)
    dsa_scores_mma_kernel(const DsaIndexScoresParams p, int tiles_per_block, int pitch) {
  dependent_kernel_start();
  constexpr int H = 16 * HT, NT = 2 * HT;  // heads, n-tiles of 8 heads
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);                     // [H, pitch]
  float* s_w = reinterpret_cast<float*>(s_q + H * pitch);  // [H]

  const int b = blockIdx.y, D = p.head_dim, L = p.max_len;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int len = valid_length(p.seq_lens, b, L);
  const int n_tiles = ceil_div(L, kMmaTileKeys);
  const int tile0 = blockIdx.x * tiles_per_block, tile_end = min(tile0 + tiles_per_block, n_tiles);
  float* scores = p.scores + static_cast<int64_t>(b) * L;

  if (tile0 * kMmaTileKeys >= len) {  // no valid key in the block's tiles
    for (int j = tile0 * kMmaTileKeys + threadIdx.x; j < min(tile_end * kMmaTileKeys, L); j += kMmaThreads)
      scores[j] = -INFINITY;
    return;
  }

  const int row_group = b / p.rows_per_group;
  const T* q = static_cast<const T*>(p.q) + row_group * p.q_group_stride +
               (b - row_group * p.rows_per_group) * p.q_batch_stride;
  const int row_vecs = D / 8;  // 16-byte vectors per q row
  for (int i = threadIdx.x; i < H * row_vecs; i += kMmaThreads) {
    const int h = i / row_vecs, d = 8 * (i % row_vecs);
    *reinterpret_cast<uint4*>(s_q + h * pitch + d) = *reinterpret_cast<const uint4*>(q + h * p.q_head_stride + d);
  }
  for (int h = threadIdx.x; h < H; h += kMmaThreads) s_w[h] = p.w[static_cast<int64_t>(b) * H + h];
  __syncthreads();  // s_q and s_w are read-only from here on

  const T* keys = static_cast<const T*>(p.keys) + row_group * p.k_batch_stride;
  const int full_chunks = D / 32;       // 32-wide chunks: two k-steps each
  const bool half_chunk = D % 32 != 0;  // D % 32 == 16: one more k-step
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
  for (int tile = tile0; tile < tile_end; ++tile) {
    const int warp_key0 = tile * kMmaTileKeys + 16 * warp;
    if (warp_key0 >= len) {  // warp-uniform: none of the warp's keys is valid
      if (lane < 16 && warp_key0 + lane < L) scores[warp_key0 + lane] = -INFINITY;
      continue;
    }
    const int j_lo = warp_key0 + g, j_hi = j_lo + 8;  // this thread's key rows (j_hi may pass L)
    const bool lo_ok = j_lo < len, hi_ok = j_hi < len;
    const T* row_lo = keys + static_cast<int64_t>(j_lo) * p.k_row_stride;  // read only when valid
    const T* row_hi = keys + static_cast<int64_t>(j_hi) * p.k_row_stride;

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

    for (int c0 = 0; c0 < full_chunks; c0 += kMmaChunksPerLoad) {
      // All of this round's loads in flight before the first mma.
      uint4 a_lo[kMmaChunksPerLoad], a_hi[kMmaChunksPerLoad];
#pragma unroll
      for (int c = 0; c < kMmaChunksPerLoad; ++c) {
        const int d = 32 * (c0 + c) + 8 * t;
        const bool in = c0 + c < full_chunks;
        a_lo[c] = in && lo_ok ? __ldg(reinterpret_cast<const uint4*>(row_lo + d)) : zero4;
        a_hi[c] = in && hi_ok ? __ldg(reinterpret_cast<const uint4*>(row_hi + d)) : zero4;
      }
#pragma unroll
      for (int c = 0; c < kMmaChunksPerLoad; ++c) {
        if (c0 + c < full_chunks) {
          const T* q_chunk = s_q + g * pitch + 32 * (c0 + c) + 8 * t;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4 bq = *reinterpret_cast<const uint4*>(q_chunk + 8 * nt * pitch);
            mma_16816<T>(acc[nt], a_lo[c].x, a_hi[c].x, a_lo[c].y, a_hi[c].y, bq.x, bq.y);
            mma_16816<T>(acc[nt], a_lo[c].z, a_hi[c].z, a_lo[c].w, a_hi[c].w, bq.z, bq.w);
          }
        }
      }
    }
    if (half_chunk) {  // the last 16 d: four elements per thread, one k-step
      const int d = 32 * full_chunks + 4 * t;
      const uint2 zero2 = make_uint2(0, 0);
      const uint2 lo = lo_ok ? __ldg(reinterpret_cast<const uint2*>(row_lo + d)) : zero2;
      const uint2 hi = hi_ok ? __ldg(reinterpret_cast<const uint2*>(row_hi + d)) : zero2;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint2 bq = *reinterpret_cast<const uint2*>(s_q + (8 * nt + g) * pitch + d);
        mma_16816<T>(acc[nt], lo.x, hi.x, lo.y, hi.y, bq.x, bq.y);
      }
    }

    // acc[nt][0..1]: row g, heads 8 nt + 2 t + {0, 1}; acc[nt][2..3]: row g + 8, same heads.
    float s_lo = 0.f, s_hi = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 wh = *reinterpret_cast<const float2*>(s_w + 8 * nt + 2 * t);
      s_lo += wh.x * fmaxf(acc[nt][0], 0.f) + wh.y * fmaxf(acc[nt][1], 0.f);
      s_hi += wh.x * fmaxf(acc[nt][2], 0.f) + wh.y * fmaxf(acc[nt][3], 0.f);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {  // the quad of lanes 4 g .. 4 g + 3
      s_lo += __shfl_xor_sync(0xffffffffu, s_lo, off);
      s_hi += __shfl_xor_sync(0xffffffffu, s_hi, off);
    }
    if (t == 0) {
      if (j_lo < L) scores[j_lo] = lo_ok ? s_lo : -INFINITY;
      if (j_hi < L) scores[j_hi] = hi_ok ? s_hi : -INFINITY;
    }
  }
}

// Tiles per block: doubled while the grid keeps kMmaTargetBlocksPerSm blocks per SM, so small
// batches spread over the GPU and large ones read q from L2 once per several tiles.
int mma_tiles_per_block(int batch, int n_tiles) {
  int device = 0;
  cudaGetDevice(&device);
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device, "dsa_index_scores");
  int tiles = 1;
  while (tiles < kMmaMaxTilesPerBlock &&
         static_cast<int64_t>(batch) * ceil_div(n_tiles, 2 * tiles) >= static_cast<int64_t>(kMmaTargetBlocksPerSm) * sms)
    tiles *= 2;
  return tiles;
}

template <typename T, int HT>
void launch_scores_mma(const DsaIndexScoresParams& p, cudaStream_t stream) {
  const int n_tiles = ceil_div(p.max_len, kMmaTileKeys);
  const int tiles = mma_tiles_per_block(p.batch, n_tiles);
  const size_t smem = mma_smem_bytes(p.heads, p.head_dim);
  reserve_shared<dsa_scores_mma_kernel<T, HT>>(smem, "dsa_index_scores");
  const dim3 grid(ceil_div(n_tiles, tiles), p.batch);
  launch_dependent_on_small_grid(p.pdl, "dsa_index_scores", dsa_scores_mma_kernel<T, HT>, grid, dim3(kMmaThreads), smem,
                                 stream, {}, p, tiles, mma_q_pitch(p.head_dim));
}

template <typename T>
void dispatch_scores_mma(const DsaIndexScoresParams& p, cudaStream_t stream) {
  switch (p.heads / 16) {
    case 1: launch_scores_mma<T, 1>(p, stream); break;
    case 2: launch_scores_mma<T, 2>(p, stream); break;
    case 3: launch_scores_mma<T, 3>(p, stream); break;
    case 4: launch_scores_mma<T, 4>(p, stream); break;
    case 5: launch_scores_mma<T, 5>(p, stream); break;
    case 6: launch_scores_mma<T, 6>(p, stream); break;
    case 7: launch_scores_mma<T, 7>(p, stream); break;
    default: launch_scores_mma<T, 8>(p, stream); break;
  }
}

bool aligned16(const void* ptr, int64_t stride_a, int64_t stride_b, int elem_bytes) {
  const int64_t vec = 16 / elem_bytes;
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && stride_a % vec == 0 && stride_b % vec == 0;
}

// Whether the tensor-core form takes p: 16-bit inputs, H and D multiples of 16, 16-byte rows.
bool mma_form_applies(const DsaIndexScoresParams& p) {
  return p.dtype != DType::Float32 && p.heads % 16 == 0 && p.head_dim % 16 == 0 &&
         aligned16(p.q, p.q_batch_stride, p.q_head_stride, 2) && aligned16(p.q, p.q_group_stride, 0, 2) &&
         aligned16(p.keys, p.k_batch_stride, p.k_row_stride, 2);
}

// ---------------------------------------------------------------------------------------------
// dsa_index_scores, plain-FMA form.

constexpr int kFmaThreads = 256;
constexpr int kFmaTileKeys = 32;                                         // lane = key
constexpr int kFmaGroups = kFmaThreads / kFmaTileKeys;                   // warp = head group
constexpr int kFmaMaxHeadsPerGroup = kDsaIndexMaxHeads / kFmaGroups;    // 16

size_t fma_smem_bytes(int H, int D) {
  return sizeof(float) * (static_cast<size_t>(H) * D + kFmaTileKeys * (D + 1) + kFmaGroups * kFmaTileKeys);
}

// Grid (ceil(L / 32), B).
template <typename T>
__global__ void __launch_bounds__(kFmaThreads) dsa_scores_fma_kernel(const DsaIndexScoresParams p) {
  extern __shared__ float s_f[];
  const int H = p.heads, D = p.head_dim, L = p.max_len, k_pitch = D + 1;
  float* s_q = s_f;                              // [H, D]
  float* s_k = s_q + H * D;                      // [32, D + 1]: odd pitch, a warp's 32 keys on 32 banks
  float* s_part = s_k + kFmaTileKeys * k_pitch;  // [groups, 32]: per-group partial scores

  const int b = blockIdx.y, key0 = blockIdx.x * kFmaTileKeys, tid = threadIdx.x;
  const int len = valid_length(p.seq_lens, b, L);
  float* scores = p.scores + static_cast<int64_t>(b) * L;
  if (key0 >= len) {
    if (tid < kFmaTileKeys && key0 + tid < L) scores[key0 + tid] = -INFINITY;
    return;
  }
  const int n_keys = min(kFmaTileKeys, len - key0);

  const int row_group = b / p.rows_per_group;
  const T* q = static_cast<const T*>(p.q) + row_group * p.q_group_stride +
               (b - row_group * p.rows_per_group) * p.q_batch_stride;
  for (int i = tid; i < H * D; i += kFmaThreads) s_q[i] = to_float(q[(i / D) * p.q_head_stride + i % D]);
  const T* keys = static_cast<const T*>(p.keys) + row_group * p.k_batch_stride;
  for (int i = tid; i < n_keys * D; i += kFmaThreads) {
    const int r = i / D, d = i % D;
    s_k[r * k_pitch + d] = to_float(keys[static_cast<int64_t>(key0 + r) * p.k_row_stride + d]);
  }
  __syncthreads();

  const int key = tid % kFmaTileKeys, group = tid / kFmaTileKeys;
  float part = 0.f;
  if (key < n_keys) {
    float acc[kFmaMaxHeadsPerGroup] = {};
    for (int d = 0; d < D; ++d) {
      const float kd = s_k[key * k_pitch + d];
#pragma unroll
      for (int i = 0; i < kFmaMaxHeadsPerGroup; ++i)
        if (group + kFmaGroups * i < H) acc[i] += s_q[(group + kFmaGroups * i) * D + d] * kd;  // broadcast
    }
#pragma unroll
    for (int i = 0; i < kFmaMaxHeadsPerGroup; ++i) {
      const int h = group + kFmaGroups * i;
      if (h < H) part += p.w[static_cast<int64_t>(b) * H + h] * fmaxf(acc[i], 0.f);
    }
  }
  s_part[group * kFmaTileKeys + key] = part;
  __syncthreads();
  if (tid < kFmaTileKeys && key0 + tid < L) {
    float s = 0.f;
    for (int r = 0; r < kFmaGroups; ++r) s += s_part[r * kFmaTileKeys + tid];
    scores[key0 + tid] = tid < n_keys ? s : -INFINITY;
  }
}

template <typename T>
void launch_scores_fma(const DsaIndexScoresParams& p, cudaStream_t stream) {
  const size_t smem = fma_smem_bytes(p.heads, p.head_dim);
  reserve_shared<dsa_scores_fma_kernel<T>>(smem, "dsa_index_scores");
  const dim3 grid(ceil_div(p.max_len, kFmaTileKeys), p.batch);
  dsa_scores_fma_kernel<T><<<grid, kFmaThreads, smem, stream>>>(p);
}

// ---------------------------------------------------------------------------------------------
// dsa_index_backward.

constexpr int kBwdTileKeys = 64;  // keys per tile: 4 k-steps of dq's product, 4 warps of dkeys's

// Shared-memory pitch (elements) of D-wide bf16 rows: 16 bytes past a multiple of 128 bytes, so
// the 8 rows of an ldmatrix and the quads of the 32-bit fragment loads fall on distinct banks.
constexpr int bwd_pitch(int D) { return D + 8; }

__device__ __forceinline__ uint32_t load32(const __nv_bfloat16* x) { return *reinterpret_cast<const uint32_t*>(x); }

// The B fragments of two n-tiles (16 columns from col) of a product whose k-rows are rows k0 ..
// k0 + 15 of a row-major bf16 tile in shared memory (ldmatrix_x4_trans: matrix q of lane 8q + i
// is row k0 + i + 8 (q % 2), column col + 8 (q / 2)).
__device__ __forceinline__ void b_fragments_trans(uint32_t (&b)[4], const __nv_bfloat16* tile, int pitch, int k0,
                                                  int col, int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + 8 * ((lane / 8) % 2)) * pitch + col + 8 * (lane / 16));
}

// Starts copying key rows j0 .. j0 + 63 into the tile s_k [64, bwd_pitch(D)] (cp.async; the caller
// commits and waits), rows at or past `end` zero.
template <int D>
__device__ __forceinline__ void stage_key_tile(__nv_bfloat16* s_k, const __nv_bfloat16* keys, int64_t row_stride,
                                               int j0, int end) {
  constexpr int vecs = D / 8;  // 16-byte vectors per row
  for (int i = threadIdx.x; i < kBwdTileKeys * vecs; i += blockDim.x) {
    const int k = i / vecs, c = 8 * (i % vecs);
    __nv_bfloat16* dst = s_k + k * bwd_pitch(D) + c;
    if (j0 + k < end) cp_async16(dst, keys + static_cast<int64_t>(j0 + k) * row_stride + c);
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// Starts copying n floats into s (cp.async; the caller commits and waits), those at or past `valid` zero.
__device__ __forceinline__ void stage_floats(float* s, const float* src, int n, int valid) {
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    if (i < valid) cp_async4(s + i, src + i);
    else s[i] = 0.f;
}

// Double buffering: waits for this thread's copies into the current buffer (those into the next,
// when `next_staged`, may stay in flight), then for every thread's.
__device__ __forceinline__ void wait_for_current_buffer(bool next_staged) {
  if (next_staged) cp_async_wait<1>();
  else cp_async_wait<0>();
  __syncthreads();
}

// g's m16n8 accumulators of n-tile nt (rows g, g + 8; columns 2t, 2t + 1 of the tile) as A
// fragments of the next product, whose k-steps are pairs of n-tiles: a0 and a1 from the even
// n-tile, a2 and a3 from the odd one.
__device__ __forceinline__ void to_a_fragment(uint32_t (&a)[4], int nt, float g0, float g1, float g2, float g3) {
  a[2 * (nt % 2)] = pack2<__nv_bfloat16>(g0, g1);
  a[2 * (nt % 2) + 1] = pack2<__nv_bfloat16>(g2, g3);
}

// Grid (rows, B), H / 16 warps; warp w takes heads 16 w .. 16 w + 15. Lane 4 g + t holds heads
// h0 + g and h0 + g + 8. Two buffers of a key tile and its d_scores: the next tile is copied in
// while the products of this one run.
template <int DT>
__global__ void __launch_bounds__(32 * kDsaIndexMaxHeads / 16) dsa_index_dq_kernel(const DsaIndexBackwardParams p) {
  using T = __nv_bfloat16;
  constexpr int D = 16 * DT, pitch = bwd_pitch(D), NT = kBwdTileKeys / 8;  // n-tiles of 8 keys
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_k = reinterpret_cast<T*>(smem);                                    // [2][64, pitch]
  float* s_d = reinterpret_cast<float*>(s_k + 2 * kBwdTileKeys * pitch);  // [2][64]

  const int r = blockIdx.x, b = blockIdx.y, H = p.heads, L = p.length;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, h0 = 16 * warp;
  const int len = static_cast<int>(min(static_cast<int64_t>(L), p.query_start + r + 1));
  const int64_t row = static_cast<int64_t>(b) * p.rows + r;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + r * p.q_row_stride;
  const T* keys = static_cast<const T*>(p.keys) + b * p.k_batch_stride;
  const float* d_row = p.d_scores + row * L;
  const float w_lo = p.w[row * H + h0 + g], w_hi = p.w[row * H + h0 + g + 8];

  uint32_t qa[DT][4];  // k-step ks: dims 16 ks + 2t (+1) and + 8, of heads h0 + g and h0 + g + 8
#pragma unroll
  for (int ks = 0; ks < DT; ++ks) {
    const T* lo = q + (h0 + g) * D + 16 * ks + 2 * t;
    qa[ks][0] = load32(lo), qa[ks][1] = load32(lo + 8 * D), qa[ks][2] = load32(lo + 8), qa[ks][3] = load32(lo + 8 * D + 8);
  }
  float dq[2 * DT][4];  // n-tiles of 8 dims
#pragma unroll
  for (int dn = 0; dn < 2 * DT; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.f;
  float dw_lo = 0.f, dw_hi = 0.f;

  const auto stage = [&](int j0, int buf) {
    stage_key_tile<D>(s_k + buf * kBwdTileKeys * pitch, keys, p.k_row_stride, j0, len);
    stage_floats(s_d + buf * kBwdTileKeys, d_row + j0, kBwdTileKeys, len - j0);
    cp_async_commit();
  };
  stage(0, 0);
  for (int j0 = 0, buf = 0; j0 < len; j0 += kBwdTileKeys, buf ^= 1) {
    const bool next = j0 + kBwdTileKeys < len;
    if (next) stage(j0 + kBwdTileKeys, buf ^ 1);
    wait_for_current_buffer(next);
    const T* tile = s_k + buf * kBwdTileKeys * pitch;
    const float* d_tile = s_d + buf * kBwdTileKeys;

    float a[NT][4];  // a[nt][0, 1]: head h0 + g, keys j0 + 8 nt + 2t, + 1; [2, 3]: head h0 + g + 8
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) a[nt][0] = a[nt][1] = a[nt][2] = a[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DT; ++ks)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const T* k_row = tile + (8 * nt + g) * pitch + 16 * ks + 2 * t;
        mma_16816<T>(a[nt], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], load32(k_row), load32(k_row + 8));
      }
    uint32_t ga[NT / 2][4];  // g as A fragments, k-steps of 16 keys
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 d = *reinterpret_cast<const float2*>(d_tile + 8 * nt + 2 * t);
      dw_lo += d.x * fmaxf(a[nt][0], 0.f) + d.y * fmaxf(a[nt][1], 0.f);
      dw_hi += d.x * fmaxf(a[nt][2], 0.f) + d.y * fmaxf(a[nt][3], 0.f);
      to_a_fragment(ga[nt / 2], nt, a[nt][0] > 0.f ? d.x * w_lo : 0.f, a[nt][1] > 0.f ? d.y * w_lo : 0.f,
                    a[nt][2] > 0.f ? d.x * w_hi : 0.f, a[nt][3] > 0.f ? d.y * w_hi : 0.f);
    }
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
      for (int dn2 = 0; dn2 < DT; ++dn2) {
        uint32_t kb[4];
        b_fragments_trans(kb, tile, pitch, 16 * kk, 16 * dn2, lane);
        mma_16816<T>(dq[2 * dn2], ga[kk][0], ga[kk][1], ga[kk][2], ga[kk][3], kb[0], kb[1]);
        mma_16816<T>(dq[2 * dn2 + 1], ga[kk][0], ga[kk][1], ga[kk][2], ga[kk][3], kb[2], kb[3]);
      }
    __syncthreads();  // this tile's buffer is read before the tile after next is copied into it
  }

#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {  // the quad of lanes 4 g .. 4 g + 3
    dw_lo += __shfl_xor_sync(0xffffffffu, dw_lo, off);
    dw_hi += __shfl_xor_sync(0xffffffffu, dw_hi, off);
  }
  if (t == 0) p.dw[row * H + h0 + g] = dw_lo, p.dw[row * H + h0 + g + 8] = dw_hi;
  T* dq_out = static_cast<T*>(p.dq) + b * p.dq_batch_stride + r * p.dq_row_stride;
#pragma unroll
  for (int dn = 0; dn < 2 * DT; ++dn) {
    const int d = 8 * dn + 2 * t;
    *reinterpret_cast<uint32_t*>(dq_out + (h0 + g) * D + d) = pack2<T>(dq[dn][0], dq[dn][1]);
    *reinterpret_cast<uint32_t*>(dq_out + (h0 + g + 8) * D + d) = pack2<T>(dq[dn][2], dq[dn][3]);
  }
}

// Grid (ceil(L / 64), B, row_splits), 4 warps; warp w takes keys j0 + 16 w .. + 15, lane 4 g + t
// keys g and g + 8 of those. The rows that see the tile are divided into row_splits equal parts, one
// a block (a part may be empty: the block writes zeros). Two buffers of a row's q, w and d_scores:
// the next row is copied in while the products of this one run.
template <int DT, int HT>
__global__ void __launch_bounds__(32 * kBwdTileKeys / 16) dsa_index_dkeys_kernel(const DsaIndexBackwardParams p) {
  using T = __nv_bfloat16;
  constexpr int D = 16 * DT, H = 16 * HT, pitch = bwd_pitch(D), vecs = D / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_k = reinterpret_cast<T*>(smem);                         // [64, pitch]
  T* s_q = s_k + kBwdTileKeys * pitch;                         // [2][H, pitch]
  float* s_w = reinterpret_cast<float*>(s_q + 2 * H * pitch);  // [2][H]
  float* s_d = s_w + 2 * H;                                    // [2][64]

  const int b = blockIdx.y, L = p.length, j0 = blockIdx.x * kBwdTileKeys;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, kw = 16 * warp;
  const T* keys = static_cast<const T*>(p.keys) + b * p.k_batch_stride;
  stage_key_tile<D>(s_k, keys, p.k_row_stride, j0, L);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t ka[DT][4];  // k-step ks: dims 16 ks + 2t (+1) and + 8, of keys kw + g and kw + g + 8
#pragma unroll
  for (int ks = 0; ks < DT; ++ks) {
    const T* lo = s_k + (kw + g) * pitch + 16 * ks + 2 * t;
    ka[ks][0] = load32(lo), ka[ks][1] = load32(lo + 8 * pitch), ka[ks][2] = load32(lo + 8),
    ka[ks][3] = load32(lo + 8 * pitch + 8);
  }
  float dk[2 * DT][4];
#pragma unroll
  for (int dn = 0; dn < 2 * DT; ++dn) dk[dn][0] = dk[dn][1] = dk[dn][2] = dk[dn][3] = 0.f;

  const auto stage = [&](int64_t r, int buf) {
    const int len = static_cast<int>(min(static_cast<int64_t>(L), p.query_start + r + 1));
    const int64_t row = static_cast<int64_t>(b) * p.rows + r;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + r * p.q_row_stride;
    for (int i = threadIdx.x; i < H * vecs; i += blockDim.x) {
      const int h = i / vecs, c = 8 * (i % vecs);
      cp_async16(s_q + (buf * H + h) * pitch + c, q + h * D + c);
    }
    stage_floats(s_w + buf * H, p.w + row * H, H, H);
    stage_floats(s_d + buf * kBwdTileKeys, p.d_scores + row * L + j0, kBwdTileKeys, len - j0);
    cp_async_commit();
  };
  // Row r sees key j when j <= query_start + r: the tile's keys are seen from row j0 - query_start on.
  const int64_t r_begin = max(static_cast<int64_t>(0), j0 - p.query_start);
  const int64_t part = (max(static_cast<int64_t>(0), p.rows - r_begin) + p.row_splits - 1) / p.row_splits;
  const int64_t r_lo = r_begin + blockIdx.z * part, r_hi = min(static_cast<int64_t>(p.rows), r_lo + part);
  if (r_lo < r_hi) stage(r_lo, 0);
  for (int64_t r = r_lo; r < r_hi; ++r) {
    const int buf = static_cast<int>((r - r_lo) % 2);
    const bool next = r + 1 < r_hi;
    if (next) stage(r + 1, buf ^ 1);
    wait_for_current_buffer(next);
    const T* s_q_row = s_q + buf * H * pitch;
    const float* s_w_row = s_w + buf * H;
    const float* s_d_row = s_d + buf * kBwdTileKeys;

    float a[2 * HT][4];  // a^T: a[nt][0, 1]: key kw + g, heads 8 nt + 2t, + 1; [2, 3]: key kw + g + 8
#pragma unroll
    for (int nt = 0; nt < 2 * HT; ++nt) a[nt][0] = a[nt][1] = a[nt][2] = a[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DT; ++ks)
#pragma unroll
      for (int nt = 0; nt < 2 * HT; ++nt) {
        const T* q_row = s_q_row + (8 * nt + g) * pitch + 16 * ks + 2 * t;
        mma_16816<T>(a[nt], ka[ks][0], ka[ks][1], ka[ks][2], ka[ks][3], load32(q_row), load32(q_row + 8));
      }
    const float d_lo = s_d_row[kw + g], d_hi = s_d_row[kw + g + 8];
    uint32_t ga[HT][4];  // g^T as A fragments, k-steps of 16 heads
#pragma unroll
    for (int nt = 0; nt < 2 * HT; ++nt) {
      const float2 w = *reinterpret_cast<const float2*>(s_w_row + 8 * nt + 2 * t);
      to_a_fragment(ga[nt / 2], nt, a[nt][0] > 0.f ? d_lo * w.x : 0.f, a[nt][1] > 0.f ? d_lo * w.y : 0.f,
                    a[nt][2] > 0.f ? d_hi * w.x : 0.f, a[nt][3] > 0.f ? d_hi * w.y : 0.f);
    }
#pragma unroll
    for (int kk = 0; kk < HT; ++kk)
#pragma unroll
      for (int dn2 = 0; dn2 < DT; ++dn2) {
        uint32_t qb[4];
        b_fragments_trans(qb, s_q_row, pitch, 16 * kk, 16 * dn2, lane);
        mma_16816<T>(dk[2 * dn2], ga[kk][0], ga[kk][1], ga[kk][2], ga[kk][3], qb[0], qb[1]);
        mma_16816<T>(dk[2 * dn2 + 1], ga[kk][0], ga[kk][1], ga[kk][2], ga[kk][3], qb[2], qb[3]);
      }
    __syncthreads();  // this row's buffer is read before the row after next is copied into it
  }

  float* out = p.dkeys + (static_cast<int64_t>(blockIdx.z) * p.batch + b) * L * D;
  const int j_lo = j0 + kw + g, j_hi = j_lo + 8;
#pragma unroll
  for (int dn = 0; dn < 2 * DT; ++dn) {
    const int d = 8 * dn + 2 * t;
    if (j_lo < L) *reinterpret_cast<float2*>(out + static_cast<int64_t>(j_lo) * D + d) = make_float2(dk[dn][0], dk[dn][1]);
    if (j_hi < L) *reinterpret_cast<float2*>(out + static_cast<int64_t>(j_hi) * D + d) = make_float2(dk[dn][2], dk[dn][3]);
  }
}

template <int DT, int HT>
void launch_index_backward(const DsaIndexBackwardParams& p, cudaStream_t stream) {
  constexpr int D = 16 * DT, H = 16 * HT, pitch = bwd_pitch(D);
  const size_t smem_dq = 2 * (sizeof(__nv_bfloat16) * kBwdTileKeys * pitch + sizeof(float) * kBwdTileKeys);
  reserve_shared<dsa_index_dq_kernel<DT>>(smem_dq, "dsa_index_backward");
  dsa_index_dq_kernel<DT><<<dim3(p.rows, p.batch), 32 * H / 16, smem_dq, stream>>>(p);
  check_launch("dsa_index_backward (dq)");
  const size_t smem_dk =
      sizeof(__nv_bfloat16) * (kBwdTileKeys + 2 * H) * pitch + 2 * sizeof(float) * (H + kBwdTileKeys);
  reserve_shared<dsa_index_dkeys_kernel<DT, HT>>(smem_dk, "dsa_index_backward");
  dsa_index_dkeys_kernel<DT, HT><<<dim3(ceil_div(p.length, kBwdTileKeys), p.batch, p.row_splits),
                                   32 * kBwdTileKeys / 16, smem_dk, stream>>>(p);
  check_launch("dsa_index_backward (dkeys)");
}

template <int DT>
void dispatch_index_backward(const DsaIndexBackwardParams& p, cudaStream_t stream) {
  switch (p.heads) {
    case 16: launch_index_backward<DT, 1>(p, stream); break;
    case 32: launch_index_backward<DT, 2>(p, stream); break;
    case 64: launch_index_backward<DT, 4>(p, stream); break;
    default: launch_index_backward<DT, 8>(p, stream); break;
  }
}

}  // namespace

int dsa_index_backward_row_splits(int batch, int rows, int length) {
  constexpr int kMinRows = 32;  // rows a part at least: each part re-reads its key tile and writes a partial
  int device = 0;
  cudaGetDevice(&device);
  const int64_t fill = 8LL * device_attribute(cudaDevAttrMultiProcessorCount, device, "dsa_index_backward");
  const int64_t blocks = std::max<int64_t>(1, static_cast<int64_t>(ceil_div(length, kBwdTileKeys)) * batch);
  return static_cast<int>(std::clamp<int64_t>((fill + blocks - 1) / blocks, 1, std::max(1, ceil_div(rows, kMinRows))));
}

void dsa_index_backward(const DsaIndexBackwardParams& p, void* stream) {
  LT2_CHECK(dsa_index_backward_supported(p.heads, p.head_dim), "dsa_index_backward: ", p.heads, " heads of dim ",
            p.head_dim, " (it takes 16, 32, 64 or 128 heads of dim 64 or 128)");
  LT2_CHECK(p.batch >= 0 && p.batch <= 65535 && p.rows >= 0 && p.length >= 1 && p.length <= kDsaMaxLength,
            "dsa_index_backward: batch ", p.batch, " (at most 65535), ", p.rows, " rows, length ", p.length);
  LT2_CHECK(p.row_splits >= 1 && p.row_splits <= 65535, "dsa_index_backward: row_splits ", p.row_splits,
            " must be in [1, 65535]");
  if (p.batch == 0 || p.rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.head_dim == 64) dispatch_index_backward<4>(p, s);
  else dispatch_index_backward<8>(p, s);
}

namespace {

// ---------------------------------------------------------------------------------------------
// dsa_head_probs.

constexpr int kHeadProbsThreads = 256;

// The softmax statistics (max m, sum of exp(x - m)) of two parts merged; max -inf means no element.
__device__ __forceinline__ float2 merge_softmax_stats(float2 a, float2 b) {
  const float m = fmaxf(a.x, b.x);
  if (m == -INFINITY) return make_float2(m, 0.f);
  return make_float2(m, a.y * expf(a.x - m) + b.y * expf(b.x - m));
}

// Grid (rows, B). Shared memory: each head's max over the support, then 1 / its sum of exponentials.
template <typename T>
__global__ void __launch_bounds__(kHeadProbsThreads) dsa_head_probs_kernel(const DsaHeadProbsParams p) {
  extern __shared__ float head_stats[];
  const int r = blockIdx.x, b = blockIdx.y, lane = threadIdx.x % 32;
  const bool* support = p.support + b * p.m_batch_stride + r * p.m_row_stride;
  const T* scores = static_cast<const T*>(p.scores) + b * p.s_batch_stride + r * p.s_row_stride;
  for (int h = threadIdx.x / 32; h < p.heads; h += kHeadProbsThreads / 32) {
    const T* s = scores + h * p.s_head_stride;
    float m = -INFINITY, sum = 0.f;
    for (int j = lane; j < p.keys; j += 32) {
      if (!support[j]) continue;
      const float x = to_float(s[j]);
      if (x > m) sum = sum * expf(m - x) + 1.f, m = x;
      else if (m > -INFINITY) sum += expf(x - m);  // -inf scores before any finite one add nothing
    }
    float2 stats = make_float2(m, sum);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      stats = merge_softmax_stats(stats, make_float2(__shfl_xor_sync(0xffffffffu, stats.x, off),
                                                     __shfl_xor_sync(0xffffffffu, stats.y, off)));
    if (lane == 0) head_stats[h] = stats.x, head_stats[p.heads + h] = stats.y > 0.f ? 1.f / stats.y : 0.f;
  }
  __syncthreads();
  const float inv_heads = 1.f / static_cast<float>(p.heads);
  float* out = p.probs + (static_cast<int64_t>(b) * p.rows + r) * p.keys;
  for (int j = threadIdx.x; j < p.keys; j += kHeadProbsThreads) {
    float acc = 0.f;
    if (support[j])
      for (int h = 0; h < p.heads; ++h)
        acc += expf(to_float(scores[h * p.s_head_stride + j]) - head_stats[h]) * head_stats[p.heads + h];
    out[j] = acc * inv_heads;
  }
}

}  // namespace

void dsa_head_probs(const DsaHeadProbsParams& p, void* stream) {
  LT2_CHECK(p.heads >= 1 && p.heads <= kDsaHeadProbsMaxHeads, "dsa_head_probs: ", p.heads, " heads (1..",
            kDsaHeadProbsMaxHeads, ")");
  LT2_CHECK(p.batch >= 0 && p.batch <= 65535 && p.rows >= 0 && p.keys >= 0, "dsa_head_probs: batch ", p.batch,
            " (at most 65535), ", p.rows, " rows, ", p.keys, " keys");
  if (p.batch == 0 || p.rows == 0 || p.keys == 0) return;
  const size_t smem = 2 * sizeof(float) * p.heads;
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) {
    dsa_head_probs_kernel<decltype(t)><<<dim3(p.rows, p.batch), kHeadProbsThreads, smem, s>>>(p);
  });
  check_launch("dsa_head_probs");
}

namespace {

// ---------------------------------------------------------------------------------------------
// topk_select.

constexpr int kTopkThreads = 512;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkPortableBlocks = 8;    // the portable cluster size
constexpr int kTopkMaxBlocks = 16;        // the non-portable one of sm_90 (where the device allows it)
constexpr int kTopkEntriesPerBlock = 4096;  // a row takes another block per this many entries
constexpr int kTopkBins = 256;            // 8-bit digits: 4 passes at most
constexpr int kTopkRoundPerWarp = 256;    // compaction: consecutive entries per warp per round
constexpr int kTopkCachedKeys = 16384;    // a block keeps this many of its slice's keys in shared memory
static_assert(kTopkThreads >= kTopkBins, "one thread per histogram bin");

// hist[bin] += 1 for the active lanes; every lane of the warp calls it. The lanes of one bin add
// together, one atomic per distinct bin of the warp (runs of equal scores, -inf padding and the
// top digits of similar scores put many lanes on one bin).
__device__ __forceinline__ void count_in_bin(uint32_t* hist, uint32_t bin, bool active) {
  const unsigned lanes = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(lanes, bin);  // the active lanes of this bin
  if (static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

// Grid (cluster blocks, B) in clusters of (blocks, 1, 1): one cluster per row. A block reads its
// slice's scores from global memory once, keeping the keys of the first `cached` entries in shared
// memory (all of them up to blocks x kTopkCachedKeys entries a row); the passes re-read the rest.
__global__ void __launch_bounds__(kTopkThreads) topk_select_kernel(const TopkSelectParams p, int cached) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  dependent_kernel_start();
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), blocks = static_cast<int>(cluster.num_blocks());
  extern __shared__ uint32_t s_keys[];     // [cached]: keys of entries lo .. lo + cached - 1
  __shared__ uint32_t s_hist[kTopkBins];   // this block's histogram of the current digit
  __shared__ uint32_t s_total[kTopkBins];  // the cluster's
  __shared__ uint32_t s_pick[5];           // digit; the cluster's entries above its bin, in it; this block's
  __shared__ uint32_t s_counts[2];         // this block's entries above the threshold prefix, matching it
  __shared__ uint32_t s_offsets[2];        // the same summed over the lower ranks
  __shared__ uint32_t s_warp[kTopkWarps];  // compaction: per-warp counts (above | matching << 16)

  const int b = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n = p.seq_lens ? valid_length(p.seq_lens, b, p.length) : p.length;
  const int k_eff = min(p.k, n);
  const float* row = p.scores + static_cast<int64_t>(b) * p.length;
  int64_t* out = p.indices + static_cast<int64_t>(b) * p.k;
  const int chunk = ceil_div(n, blocks);
  const int lo = min(n, rank * chunk), hi = min(n, lo + chunk);  // this block's slice of the row
  const int cache_end = min(hi, lo + cached);
  for (int i = lo + tid; i < cache_end; i += kTopkThreads) s_keys[i - lo] = order_key(row[i]);
  __syncthreads();
  auto key_at = [&](int i) { return i < cache_end ? s_keys[i - lo] : order_key(row[i]); };  // lo <= i < hi

  // The selection so far: entries whose key under `mask` exceeds `prefix` are in; `need` more are
  // to come from the `group` entries (cluster-wide) whose masked key equals it. Identical in every
  // thread of the cluster, so the loop below is uniform.
  uint32_t prefix = 0, mask = 0;
  int need = k_eff, group = n;
  uint32_t own_above = 0, own_group = hi - lo;  // this block's share of both
  for (int shift = 24; shift >= 0 && group != need; shift -= 8) {
    if (tid < kTopkBins) s_hist[tid] = 0;
    __syncthreads();
    for (int base = lo + 32 * warp; base < hi; base += kTopkThreads) {  // warp-uniform trip count
      const int i = base + lane;
      const uint32_t key = i < hi ? key_at(i) : 0;
      count_in_bin(s_hist, (key >> shift) & 0xffu, i < hi && (key & mask) == prefix);
    }
    cluster.sync();  // every block's histogram is complete and visible
    if (tid < kTopkBins) {
      uint32_t total = 0;
      for (int r = 0; r < blocks; ++r) total += cluster.map_shared_rank(s_hist, r)[tid];
      s_total[tid] = total;
    }
    cluster.sync();  // no remote histogram is read any more (the next pass may clear them); s_total is complete
    if (warp == 0) {
      // Lane l holds bins 8 l .. 8 l + 7; the digit is the bin holding the need-th largest entry:
      // above(d) < need <= above(d) + count(d), with above(d) the entries in higher bins.
      uint32_t count[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += (count[i] = s_total[8 * lane + i]);
      uint32_t suffix = sum;  // entries in the bins of lanes >= l
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t v = __shfl_down_sync(0xffffffffu, suffix, off);
        if (lane + off < 32) suffix += v;
      }
      uint32_t above = suffix - sum;
      int digit = -1;
      uint32_t digit_above = 0;
#pragma unroll
      for (int i = 7; i >= 0; --i) {
        if (above < static_cast<uint32_t>(need) && static_cast<uint32_t>(need) <= above + count[i]) {
          digit = 8 * lane + i;
          digit_above = above;
        }
        above += count[i];
      }
      const unsigned found = __ballot_sync(0xffffffffu, digit >= 0);  // exactly one lane
      const int src = __ffs(found) - 1;
      digit = __shfl_sync(0xffffffffu, digit, src);
      digit_above = __shfl_sync(0xffffffffu, digit_above, src);
      uint32_t own = 0;  // this block's entries in bins above the digit
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (8 * lane + i > digit) own += s_hist[8 * lane + i];
      own = __reduce_add_sync(0xffffffffu, own);
      if (lane == 0) {
        s_pick[0] = digit;
        s_pick[1] = digit_above;
        s_pick[2] = s_total[digit];
        s_pick[3] = own;
        s_pick[4] = s_hist[digit];
      }
    }
    __syncthreads();  // s_pick is read before the next pass writes it: two cluster barriers lie between
    const uint32_t digit = s_pick[0];
    need -= static_cast<int>(s_pick[1]);
    group = static_cast<int>(s_pick[2]);
    own_above += s_pick[3];
    own_group = s_pick[4];
    prefix |= digit << shift;
    mask |= 0xffu << shift;
  }

  // Offsets of this block's entries among the cluster's: the counts of the lower ranks.
  if (tid == 0) {
    s_counts[0] = own_above;
    s_counts[1] = own_group;
  }
  cluster.sync();
  if (tid < 2) {
    uint32_t sum = 0;
    for (int r = 0; r < rank; ++r) sum += cluster.map_shared_rank(s_counts, r)[tid];
    s_offsets[tid] = sum;
  }
  cluster.sync();  // no block exits while another reads its counts; s_offsets is complete

  // Above the prefix: positions [0, k_eff - need) in ascending index; matching it: the first
  // `need` in ascending index at positions [k_eff - need, k_eff).
  const int n_above = k_eff - need;
  uint32_t run_above = s_offsets[0], run_group = s_offsets[1];
  for (int base = lo; base < hi; base += kTopkWarps * kTopkRoundPerWarp) {
    const int warp_base = base + kTopkRoundPerWarp * warp;
    uint32_t above_bits[kTopkRoundPerWarp / 32], group_bits[kTopkRoundPerWarp / 32];
    uint32_t warp_counts = 0;  // above | matching << 16 (at most 256 each)
#pragma unroll
    for (int e = 0; e < kTopkRoundPerWarp / 32; ++e) {
      const int i = warp_base + 32 * e + lane;
      const uint32_t key = i < hi ? key_at(i) & mask : 0;
      above_bits[e] = __ballot_sync(0xffffffffu, i < hi && key > prefix);
      group_bits[e] = __ballot_sync(0xffffffffu, i < hi && key == prefix);
      warp_counts += __popc(above_bits[e]) | (__popc(group_bits[e]) << 16);
    }
    if (lane == 0) s_warp[warp] = warp_counts;
    __syncthreads();
    uint32_t before = 0, round = 0;  // this warp's offset within the round, and the round's total
    for (int w = 0; w < kTopkWarps; ++w) {
      if (w < warp) before += s_warp[w];
      round += s_warp[w];
    }
    __syncthreads();  // s_warp is read before the next round writes it
    uint32_t pos_above = run_above + (before & 0xffffu), pos_group = run_group + (before >> 16);
    const uint32_t lanes_below = (1u << lane) - 1;
#pragma unroll
    for (int e = 0; e < kTopkRoundPerWarp / 32; ++e) {
      const int i = warp_base + 32 * e + lane;
      if (above_bits[e] >> lane & 1u) out[pos_above + __popc(above_bits[e] & lanes_below)] = i;
      if (group_bits[e] >> lane & 1u) {
        const uint32_t r = pos_group + __popc(group_bits[e] & lanes_below);
        if (r < static_cast<uint32_t>(need)) out[n_above + r] = i;
      }
      pos_above += __popc(above_bits[e]);
      pos_group += __popc(group_bits[e]);
    }
    run_above += round & 0xffffu;
    run_group += round >> 16;
  }

  // Past the length (seq_lens given, k > len): the lowest-index padding entries, len, len + 1, ...
  for (int pos = k_eff + rank * kTopkThreads + tid; pos < p.k; pos += blocks * kTopkThreads)
    out[pos] = n + (pos - k_eff);
#endif
}

}  // namespace

void dsa_index_scores(const DsaIndexScoresParams& params, void* stream) {
  DsaIndexScoresParams p = params;
  LT2_CHECK(p.rows_per_group >= 1, "dsa_index_scores: rows_per_group must be >= 1, found ", p.rows_per_group);
  if (p.rows_per_group == 1) p.q_group_stride = p.q_batch_stride;
  LT2_CHECK(dsa_index_scores_supported(p.heads, p.head_dim), "dsa_index_scores: ", p.heads,
            " heads of dim ", p.head_dim, " (the kernels take 1..", kDsaIndexMaxHeads, " heads of dim 1..",
            kDsaIndexMaxHeadDim, ")");
  LT2_CHECK(p.batch >= 0 && p.batch <= 65535 && p.max_len >= 1 && p.max_len <= kDsaMaxLength,
            "dsa_index_scores: batch ", p.batch, " (at most 65535) and cache length ", p.max_len, " (1..",
            kDsaMaxLength, ")");
  if (p.batch == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  if (mma_form_applies(p)) {
    if (p.dtype == DType::BFloat16) dispatch_scores_mma<__nv_bfloat16>(p, s);
    else dispatch_scores_mma<__half>(p, s);
  } else {
    dispatch_dtype(p.dtype, [&](auto t) { launch_scores_fma<decltype(t)>(p, s); });
  }
  check_launch("dsa_index_scores");
}

namespace {

// The most blocks a top-k cluster may have on `device`: 16 where a 16-block cluster of the kernel
// (with its largest shared memory) can be resident, else the portable 8.
int topk_device_max_blocks(int device) {
  static std::mutex mutex;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(device); it != cache.end()) return it->second;
  int blocks = kTopkPortableBlocks;
  const size_t smem = sizeof(uint32_t) * kTopkCachedKeys;
  reserve_shared<topk_select_kernel>(smem, "topk_select");
  if (cudaFuncSetAttribute(topk_select_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(kTopkMaxBlocks, 1), config.blockDim = dim3(kTopkThreads), config.dynamicSmemBytes = smem;
    cudaLaunchAttribute cluster = cluster_launch(kTopkMaxBlocks);
    config.attrs = &cluster, config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, topk_select_kernel, &config) == cudaSuccess && clusters >= 1)
      blocks = kTopkMaxBlocks;
  }
  cudaGetLastError();  // a refused query leaves the portable size, not an error for the next launch
  return cache[device] = blocks;
}

}  // namespace

void topk_select(const TopkSelectParams& p, void* stream) {
  LT2_CHECK(p.length >= 1 && p.length <= kDsaMaxLength && p.k >= 1 && p.k <= p.length, "topk_select: k = ", p.k,
            " of ", p.length, " entries (1 <= k <= length <= ", kDsaMaxLength, ")");
  LT2_CHECK(p.batch >= 0 && p.batch <= 65535, "topk_select: batch ", p.batch, " (at most 65535)");
  if (p.batch == 0) return;
  int device = 0;
  cudaGetDevice(&device);
  const int max_blocks = std::clamp(p.max_blocks > 0 ? p.max_blocks : kTopkMaxBlocks, 1, topk_device_max_blocks(device));
  const int blocks = std::clamp(ceil_div(p.length, kTopkEntriesPerBlock), 1, max_blocks);
  const int cached = std::min(ceil_div(p.length, blocks), kTopkCachedKeys);  // a slice holds at most length / blocks
  const size_t smem = sizeof(uint32_t) * cached;
  reserve_shared<topk_select_kernel>(smem, "topk_select");
  launch_dependent_on_small_grid(p.pdl, "topk_select (it needs an sm_90 GPU)", topk_select_kernel, dim3(blocks, p.batch),
                                 dim3(kTopkThreads), smem, static_cast<cudaStream_t>(stream),
                                 {cluster_launch(blocks)}, p, cached);
}

}  // namespace lt2::kernels
