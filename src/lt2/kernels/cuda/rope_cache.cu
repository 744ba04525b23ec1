// RoPE kernels: attention's decode prologue (decode.h: rope_cache_write) and the rotation of whole
// [B, T, H, D] tensors for training and prefill (prefill.h: rope_apply).
//
// rope_cache_write: RoPE of the new token's q and k at per-sequence positions and the k, v rows
// written into the caches. A few KB per sequence: launch-bound. Grid (H + 2 H_kv, B), one block of
// kThreads per head row: blocks 0 .. H-1 rotate query head h into q_out, H .. H+H_kv-1 rotate key
// head j into its cache row, the last H_kv copy value head j into its cache row.
//
// rope_apply floor: one read of x and one write of y (the copied dims past the rotation included).
// At lt-100m's training step (16 x 2048 tokens, 12 heads of 64, bf16) q and k are 50 MB each, so a
// pass over both moves 201 MB: ~61 us at ~3.3 TB/s. A step rotates each of its 48 layer applications
// three times (the forward, its recompute under per-loop checkpointing, the backward): 29 GB, ~8.8 ms.
// The libtorch form makes about nine passes over x's size for each (the pair swap, two broadcast
// products, the sum; the backward's products, swap and sum).
//
// rope_apply design: block (U, R); a thread owns P pairs of the rows of one position t (U = D / 2P
// threads cover a row, R positions a block), so its angles are computed once for all the rows it
// rotates: kRopeRows rows (b, h) per group, loaded before any is rotated so their loads are in
// flight together (a spare row of the last group reads and writes a valid row again: no branch). Where the
// rows are whole 16-byte pieces and the tensors 16-byte aligned, every access is 16 bytes: P = 4
// (bf16, fp16) or 2 (fp32) interleaved pairs from one piece, or P = 8 or 4 pairs of halves from one
// piece of each half; otherwise P = 1 with element accesses. A warp then reads 32 / U positions' rows
// in whole 32-byte sectors. The frequencies theta^(-2i / D) come from the host in float64 (as
// nn/rope.h makes them), divided by 2 pi: the position times one is the angle in turns, whose
// fraction (float64: exact to ~1e-11 turns at a million positions) goes to fp32 within [-1/2, 1/2],
// where the fast sine and cosine are accurate to ~4e-7. Per 16-byte piece that is a few float64
// operations and two special-function ones: the kernel stays bound by memory.
#include "lt2/kernels/prefill.h"

#include <cmath>

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

namespace {
constexpr int kRopeThreads = 256;
constexpr int kRopeRows = 4;  // rows (b, h) a thread loads before it rotates them

// rope_apply's kernel arguments: the params and the frequencies in turns, made on the host.
struct RopeKernelArgs {
  RopeParams p;
  double turns[kRopeMaxHeadDim / 2];  // theta^(-2i / D) / (2 pi)
  int rows_per_block;                 // a multiple of kRopeRows
};

// The P pairs at unit `unit` of one row: members a[i], b[i] of pair unit P + i. Vec: 16-byte pieces
// (interleaved: one piece of 2P elements; halves: P elements at unit P and at unit P + D / 2), read
// by __ldcs (streaming: x is read once). __ldg's non-coherent loads let ptxas sink a group's later
// loads below its first store; a coherent load keeps them all ahead.
template <typename T, int P, bool Interleaved, bool Vec>
__device__ __forceinline__ void load_pairs(const T* row, int unit, int half, float (&a)[P], float (&b)[P]) {
  if constexpr (Vec && Interleaved) {
    float f[2 * P];
    unpack16<T>(__ldcs(reinterpret_cast<const uint4*>(row + 2 * P * unit)), f);
#pragma unroll
    for (int i = 0; i < P; ++i) a[i] = f[2 * i], b[i] = f[2 * i + 1];
  } else if constexpr (Vec) {
    unpack16<T>(__ldcs(reinterpret_cast<const uint4*>(row + P * unit)), a);
    unpack16<T>(__ldcs(reinterpret_cast<const uint4*>(row + P * unit + half)), b);
  } else if constexpr (Interleaved) {
    a[0] = to_float(row[2 * unit]), b[0] = to_float(row[2 * unit + 1]);
  } else {
    a[0] = to_float(row[unit]), b[0] = to_float(row[unit + half]);
  }
}

template <typename T, int P, bool Interleaved, bool Vec>
__device__ __forceinline__ void store_pairs(T* row, int unit, int half, const float (&a)[P], const float (&b)[P]) {
  if constexpr (Vec && Interleaved) {
    alignas(16) T v[2 * P];
#pragma unroll
    for (int i = 0; i < P; ++i) v[2 * i] = from_float<T>(a[i]), v[2 * i + 1] = from_float<T>(b[i]);
    *reinterpret_cast<uint4*>(row + 2 * P * unit) = *reinterpret_cast<const uint4*>(v);
  } else if constexpr (Vec) {
    alignas(16) T lo[P], hi[P];
#pragma unroll
    for (int i = 0; i < P; ++i) lo[i] = from_float<T>(a[i]), hi[i] = from_float<T>(b[i]);
    *reinterpret_cast<uint4*>(row + P * unit) = *reinterpret_cast<const uint4*>(lo);
    *reinterpret_cast<uint4*>(row + P * unit + half) = *reinterpret_cast<const uint4*>(hi);
  } else if constexpr (Interleaved) {
    row[2 * unit] = from_float<T>(a[0]), row[2 * unit + 1] = from_float<T>(b[0]);
  } else {
    row[unit] = from_float<T>(a[0]), row[unit + half] = from_float<T>(b[0]);
  }
}

// Dims [0, n) of a row copied from src to dst by the `units` threads of the row, this one at `unit`:
// 16-byte pieces (Vec) or elements, every units-th from its own.
template <typename T, bool Vec>
__device__ __forceinline__ void copy_row_dims(const T* src, T* dst, int n, int unit, int units) {
  constexpr int kStep = Vec ? 16 / sizeof(T) : 1;
  for (int e = unit * kStep; e < n; e += units * kStep) {
    if constexpr (Vec) *reinterpret_cast<uint4*>(dst + e) = __ldcs(reinterpret_cast<const uint4*>(src + e));
    else dst[e] = src[e];
  }
}

template <typename T, int P, bool Interleaved, bool Vec>
__global__ void __launch_bounds__(kRopeThreads) rope_apply_kernel(const RopeKernelArgs args) {
  const RopeParams& p = args.p;
  const int t = blockIdx.x * blockDim.y + threadIdx.y, unit = threadIdx.x, half = p.head_dim / 2;
  if (t >= p.seq) return;
  // The angles of the thread's pairs at position start + t, reduced to within half a turn.
  const double pos = static_cast<double>(p.start + t);
  float c[P], s[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const double turn = pos * args.turns[unit * P + i];
    __sincosf(static_cast<float>(turn - rint(turn)) * 6.28318530717958648f, &s[i], &c[i]);
    if (p.inverse) s[i] = -s[i];
  }
  const T* x = static_cast<const T*>(p.x) + t * p.x_token_stride;
  T* y = static_cast<T*>(p.y) + t * p.y_token_stride;
  const int rows = p.batch * p.heads, first = blockIdx.y * args.rows_per_block;
  const int last = min(first + args.rows_per_block, rows);
  int b = first / p.heads, h = first - b * p.heads;  // row first + g is (b, h) advanced g times
  for (int r0 = first; r0 < last; r0 += kRopeRows) {
    // The group's rows' addresses first, then all their loads: nothing between the loads for the
    // scheduler to put a store or a division.
    const T* in[kRopeRows];
    T* out[kRopeRows];
#pragma unroll
    for (int g = 0; g < kRopeRows; ++g) {
      in[g] = x + b * p.x_batch_stride + h * p.x_head_stride;
      out[g] = y + b * p.y_batch_stride + h * p.y_head_stride;
      if (r0 + g + 1 < last && ++h == p.heads) h = 0, ++b;  // past the last row: the last row again
    }
    float xa[kRopeRows][P], xb[kRopeRows][P];
#pragma unroll
    for (int g = 0; g < kRopeRows; ++g) load_pairs<T, P, Interleaved, Vec>(in[g], unit, half, xa[g], xb[g]);
#pragma unroll
    for (int g = 0; g < kRopeRows; ++g) {  // a spare row stores its valid row again: no branch
      float ya[P], yb[P];
#pragma unroll
      for (int i = 0; i < P; ++i) {
        ya[i] = xa[g][i] * c[i] - xb[g][i] * s[i];
        yb[i] = xb[g][i] * c[i] + xa[g][i] * s[i];
      }
      store_pairs<T, P, Interleaved, Vec>(out[g], unit, half, ya, yb);
    }
    if (p.pass_dims > 0) {  // the dims past the rotation, as they are
#pragma unroll
      for (int g = 0; g < kRopeRows; ++g)
        copy_row_dims<T, Vec>(in[g] + p.head_dim, out[g] + p.head_dim, p.pass_dims, unit, blockDim.x);
    }
    if (++h == p.heads) h = 0, ++b;  // the next group's first row
  }
}

// Whether the 16-byte form takes p: rows of whole pieces in its pair layout and in the copied dims, and
// x's and y's pointers and the strides of their dims of more than one entry in whole pieces.
bool rope_vec_ok(const RopeParams& p, int vec) {
  const int64_t span = p.interleaved ? p.head_dim : p.head_dim / 2;
  const auto whole = [&](int64_t stride, int size) { return size == 1 || stride % vec == 0; };
  return span % vec == 0 && p.pass_dims % vec == 0 && aligned16(p.x) && aligned16(p.y) &&
         whole(p.x_batch_stride, p.batch) && whole(p.x_token_stride, p.seq) && whole(p.x_head_stride, p.heads) &&
         whole(p.y_batch_stride, p.batch) && whole(p.y_token_stride, p.seq) && whole(p.y_head_stride, p.heads);
}

template <typename T, int P, bool Interleaved, bool Vec>
void launch_rope_apply(const RopeKernelArgs& args, cudaStream_t stream) {
  const RopeParams& p = args.p;
  const int units = p.head_dim / 2 / P, per_block = std::max(1, std::min(kRopeThreads / units, p.seq));
  const dim3 block(static_cast<unsigned>(units), static_cast<unsigned>(per_block));
  const dim3 grid(static_cast<unsigned>(ceil_div(p.seq, per_block)),
                  static_cast<unsigned>(ceil_div(p.batch * p.heads, args.rows_per_block)));
  rope_apply_kernel<T, P, Interleaved, Vec><<<grid, block, 0, stream>>>(args);
}

}  // namespace

bool rope_apply_supported(int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  return batch >= 0 && seq >= 0 && heads >= 0 && head_dim >= 2 && head_dim % 2 == 0 &&
         head_dim <= kRopeMaxHeadDim && seq <= INT32_MAX - kRopeThreads && batch * heads <= INT32_MAX - kRopeRows;
}

void rope_apply(const RopeParams& p, void* stream) {
  LT2_CHECK(rope_apply_supported(p.batch, p.seq, p.heads, p.head_dim), "rope_apply: ", p.batch, " x ", p.seq,
            " tokens of ", p.heads, " heads of head dim ", p.head_dim, " (even, at most ", kRopeMaxHeadDim, ")");
  LT2_CHECK(p.x && p.y, "rope_apply: x and y must be given");
  LT2_CHECK(p.pass_dims >= 0, "rope_apply: pass_dims must be >= 0, found ", p.pass_dims);
  if (p.batch == 0 || p.seq == 0 || p.heads == 0) return;
  RopeKernelArgs args{};
  args.p = p;
  const double two_pi = 6.283185307179586476925286766559;
  for (int i = 0; i < p.head_dim / 2; ++i)
    args.turns[i] = std::pow(p.theta, -static_cast<double>(2 * i) / p.head_dim) / two_pi;
  // Enough rows a block for whole groups, few enough for a grid of many blocks; more where the
  // grid's second dim would pass its 65535.
  const int rows = p.batch * p.heads;
  args.rows_per_block = std::max(kRopeRows, round_up(ceil_div(rows, 65535), kRopeRows));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    if (rope_vec_ok(p, kVec)) {
      if (p.interleaved) launch_rope_apply<T, kVec / 2, true, true>(args, s);
      else launch_rope_apply<T, kVec, false, true>(args, s);
    } else {
      if (p.interleaved) launch_rope_apply<T, 1, true, false>(args, s);
      else launch_rope_apply<T, 1, false, false>(args, s);
    }
  });
  check_launch("rope_apply");
}

}  // namespace lt2::kernels
