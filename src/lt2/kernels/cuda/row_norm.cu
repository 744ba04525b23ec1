// Row normalisation with an optional weight and activated gate, forward and backward, for the
// linear mixers in training and prefill (the gated RMSNorm of their output, the L2 norm of q and k):
// kernels/prefill.h has the formulas.
//
// Floor. Forward: read x (and the gate), write y and one fp32 r per row; backward: read x, dy (and
// the gate) and r, write dx (and dgate). At lt2-gdn-1.3b's output norm (8 x 4096 tokens, 16 heads
// of 192, bf16) that is 0.40 GB forward and 0.60 GB backward with the gate: ~0.08 and ~0.13 ms at
// ~4.8 TB/s. With a residual add (a block norm in training) the forward also reads the residual and
// writes h, and the backward reads h's other gradient and writes the residual's: at lt-100m (32768
// rows of 768, fp32 x, bf16 residual and y) 12 bytes an element forward and 16 backward, where the
// add, the norm, autograd's sum of h's two gradients and the residual gradient's cast took 16 and 28
// in five passes. The reference (fp32 casts, pow, mean, rsqrt, products, SiLU, and autograd's backward
// of each) makes a dozen passes over fp32 copies of these tensors.
//
// Design. Where a row is whole 16-byte pieces (D a multiple of 16 / sizeof(T), at most 32 pieces) and
// the tensors 16-byte aligned: a row takes L lanes (the power of two >= its pieces), a warp 32 / L
// rows, a lane one piece (8 bf16 or 4 fp32), so every access is 16 bytes and the row's sums are
// L-lane shuffles (a load per 2-byte element keeps ~12 KiB in flight per SM, under the ~25 KiB the
// HBM's latency-bandwidth product asks: ~3x the traffic floor). Otherwise, and with a residual add:
// one warp per row; lane l holds elements l, l + 32, ... (PerLane of them: D <= 32 PerLane), so
// loads are coalesced and the row's sums are warp shuffles. The backward walks rows grid-stride, a
// lane summing dweight for its own columns, then the block's warps sum through shared memory and one
// atomicAdd per column and block remains. Rows past kMaxWarpRowDim (Mamba2's 1536-wide gated norm at
// d 768) take a block of 256 threads a row, each holding 8 or 16 elements: a warp's registers would
// spill there.
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kWarps = 8;  // rows in flight per block
constexpr int kWideThreads = 256;  // a block a row past kMaxWarpRowDim

__device__ __forceinline__ float activate(float g, GateAct act) {
  if (act == GateAct::None) return 1.f;
  const float s = 1.f / (1.f + __expf(-g));
  return act == GateAct::Swish ? g * s : s;
}
__device__ __forceinline__ float activate_grad(float g, GateAct act) {
  if (act == GateAct::None) return 0.f;
  const float s = 1.f / (1.f + __expf(-g));
  return act == GateAct::Swish ? s * (1.f + g * (1.f - s)) : s * (1.f - s);
}

// The first element of gate row `row` (RowNormParams: groups of packed rows, strided).
__device__ __forceinline__ int64_t gate_offset(const RowNormParams& p, int64_t row) {
  return row / p.gate_group_rows * p.gate_group_stride + row % p.gate_group_rows * p.dim;
}

// The row of `dim` elements from element `start` of base: lane l's elements l, l + Stride, ... (Stride
// the threads sharing a row: a warp's 32, or a wide block's).
template <typename T, int PerLane, int Stride = 32>
__device__ __forceinline__ void load_row(const void* base, int64_t start, int dim, int lane, float (&v)[PerLane]) {
  const T* p = static_cast<const T*>(base) + start;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int i = lane + Stride * j;
    v[j] = i < dim ? to_float(p[i]) : 0.f;
  }
}

template <typename T, int PerLane, int Stride = 32>
__device__ __forceinline__ void store_row(void* base, int64_t start, int dim, int lane, const float (&v)[PerLane]) {
  T* p = static_cast<T*>(base) + start;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int i = lane + Stride * j;
    if (i < dim) p[i] = from_float<T>(v[j]);
  }
}

// A row of a residual (or its gradient) in RowNormParams::residual_dtype: the rows' type T, or bf16.
template <typename T, int PerLane>
__device__ __forceinline__ void load_residual_row(const void* base, DType dtype, int64_t start, int dim, int lane,
                                                  float (&v)[PerLane]) {
  if (dtype == DType::BFloat16) load_row<__nv_bfloat16>(base, start, dim, lane, v);
  else load_row<T>(base, start, dim, lane, v);
}
template <typename T, int PerLane>
__device__ __forceinline__ void store_residual_row(void* base, DType dtype, int64_t start, int dim, int lane,
                                                   const float (&v)[PerLane]) {
  if (dtype == DType::BFloat16) store_row<__nv_bfloat16>(base, start, dim, lane, v);
  else store_row<T>(base, start, dim, lane, v);
}

// A lane's piece of N elements of type U at p (N * sizeof(U) bytes: 16, or 8 for the bf16 output of
// fp32 rows), as floats, and back; by value, so each is one vector access.
template <typename U, int N>
__device__ __forceinline__ void load_piece(const U* p, float (&out)[N]) {
  if constexpr (N * sizeof(U) == 16) {
    unpack16<U>(*reinterpret_cast<const uint4*>(p), out);
  } else {
    static_assert(N * sizeof(U) == 8, "a piece is 16 or 8 bytes");
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    alignas(8) U v[N];
    *reinterpret_cast<uint2*>(v) = raw;
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(v[j]);
  }
}
template <typename U, int N>
__device__ __forceinline__ void store_piece(U* p, const float (&in)[N]) {
  alignas(N * sizeof(U)) U v[N];
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = from_float<U>(in[j]);
  if constexpr (N * sizeof(U) == 16) *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
  else *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(v);
}

// weight[i] for the lane's columns (1 without a weight), fp32 or of the rows' type T.
template <typename T, int PerLane, int Stride = 32>
__device__ __forceinline__ void load_weight(const RowNormParams& p, int lane, float (&w)[PerLane]) {
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int i = lane + Stride * j;
    w[j] = p.weight && i < p.dim ? param_as_float<T>(p.weight, p.weight_dtype, i) : 1.f;
  }
}

// A row's backward terms for the thread's N elements (RowNormBackwardParams' formulas) with n = x r
// and a = act(gate): dn = dy weight a, dweight's term dy n a added to dw, dgate written over g; returns
// the thread's part of sum(dn n).
template <int N>
__device__ __forceinline__ float row_backward_terms(const RowNormParams& p, float r, const float (&x)[N],
                                                    const float (&dy)[N], const float (&w)[N], float (&g)[N],
                                                    float (&dn)[N], float (&dw)[N]) {
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float n = x[j] * r, a = p.gate ? activate(g[j], p.act) : 1.f;
    dn[j] = dy[j] * w[j] * a;
    dot = fmaf(dn[j], n, dot);
    dw[j] = fmaf(dy[j] * n, a, dw[j]);
    if (p.gate) g[j] = dy[j] * n * w[j] * activate_grad(g[j], p.act);  // dgate, in place
  }
  return dot;
}

// T: x's (and the gate's) type; TO: y's.
template <typename T, typename TO, int PerLane>
__global__ void __launch_bounds__(32 * kWarps) row_norm_forward_kernel(const RowNormParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  float x[PerLane], w[PerLane], g[PerLane];
  load_row<T>(p.x, row * p.dim, p.dim, lane, x);
  if (p.residual) {  // h = x + residual in T, as the add would round it
    float m[PerLane];
    load_residual_row<T>(p.residual, p.residual_dtype, row * p.dim, p.dim, lane, m);
#pragma unroll
    for (int j = 0; j < PerLane; ++j) x[j] = to_float(from_float<T>(x[j] + m[j]));
    store_row<T>(p.h, row * p.dim, p.dim, lane, x);
  }
  if (p.gate) load_row<T>(p.gate, gate_offset(p, row), p.dim, lane, g);
  load_weight<T>(p, lane, w);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) ss = fmaf(x[j], x[j], ss);
  const float r = rsqrtf(warp_sum(ss) / p.divisor + p.eps);
#pragma unroll
  for (int j = 0; j < PerLane; ++j) x[j] *= r * w[j] * (p.gate ? activate(g[j], p.act) : 1.f);
  store_row<TO>(p.y, row * p.dim, p.dim, lane, x);
  if (lane == 0) p.rstd[row] = r;
}

// The forward in 16-byte pieces, L lanes a row (the design above); lanes past the row's pieces and
// rows past the end take part in the shuffles with zeros.
template <typename T, typename TO, int L>
__global__ void __launch_bounds__(32 * kWarps) row_norm_forward_vec_kernel(const RowNormParams p) {
  constexpr int kVec = 16 / sizeof(T), kRowsPerWarp = 32 / L;
  const int lane = threadIdx.x % 32, piece = lane % L, c = piece * kVec;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kRowsPerWarp + lane / L;
  const bool active = row < p.rows && c < p.dim;
  const int64_t at = row * p.dim + c;
  float x[kVec] = {}, g[kVec];
  if (active) unpack16<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + at), x);
  if (active && p.gate)
    unpack16<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.gate) + gate_offset(p, row) + c), g);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) ss = fmaf(x[j], x[j], ss);
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o, L);
  const float r = rsqrtf(ss / p.divisor + p.eps);
  if (!active) return;
  float y[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float w = p.weight ? param_as_float<T>(p.weight, p.weight_dtype, c + j) : 1.f;
    y[j] = x[j] * r * w * (p.gate ? activate(g[j], p.act) : 1.f);
  }
  store_piece<TO>(static_cast<TO*>(p.y) + at, y);
  if (piece == 0) p.rstd[row] = r;
}

// dweight[i] += sum over the block's warps of partial[warp][i] for i < dim, one atomicAdd per column
// (after a barrier: every warp has written its row of partial).
template <int Cols>
__device__ __forceinline__ void add_block_columns(const float (&partial)[kWarps][Cols], int dim, float* dweight) {
  __syncthreads();
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) sum += partial[k][i];
    atomicAdd(dweight + i, sum);
  }
}

template <typename T, typename TO, int PerLane>
__global__ void __launch_bounds__(32 * kWarps) row_norm_backward_kernel(const RowNormBackwardParams bp) {
  const RowNormParams& p = bp.forward;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float w[PerLane], dw[PerLane] = {};
  load_weight<T>(p, lane, w);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    float x[PerLane], dy[PerLane], g[PerLane];
    load_row<T>(p.x, row * p.dim, p.dim, lane, x);
    load_row<TO>(bp.dy, row * p.dim, p.dim, lane, dy);
    if (p.gate) load_row<T>(p.gate, gate_offset(p, row), p.dim, lane, g);
    const float r = p.rstd[row];
    float dn[PerLane];
    const float mean_dot = warp_sum(row_backward_terms(p, r, x, dy, w, g, dn, dw)) / p.divisor;
#pragma unroll
    for (int j = 0; j < PerLane; ++j) x[j] = r * (dn[j] - x[j] * r * mean_dot);  // dx, in place
    if (bp.dh) {  // h's gradient from its other uses (dy is reused: its values are spent)
      load_row<T>(bp.dh, row * p.dim, p.dim, lane, dy);
#pragma unroll
      for (int j = 0; j < PerLane; ++j) x[j] += dy[j];
    }
    store_row<T>(bp.dx, row * p.dim, p.dim, lane, x);
    if (bp.dresidual) store_residual_row<T>(bp.dresidual, p.residual_dtype, row * p.dim, p.dim, lane, x);
    if (p.gate) store_row<T>(bp.dgate, row * p.dim, p.dim, lane, g);
  }
  if (!bp.dweight) return;
  // The block's warps sum their columns, then one atomic per column.
  __shared__ float partial[kWarps][32 * PerLane];
#pragma unroll
  for (int j = 0; j < PerLane; ++j) partial[warp][lane + 32 * j] = dw[j];
  add_block_columns(partial, p.dim, bp.dweight);
}

// The backward in 16-byte pieces, L lanes a row, rows grid-stride (a warp's row groups advance
// together, so its shuffles see every lane). dweight: a lane sums its piece's columns over its rows,
// the warp's row groups over shuffles, the block's warps through shared memory, then one atomicAdd
// per column and block.
template <typename T, typename TO, int L>
__global__ void __launch_bounds__(32 * kWarps) row_norm_backward_vec_kernel(const RowNormBackwardParams bp) {
  constexpr int kVec = 16 / sizeof(T), kRowsPerWarp = 32 / L;
  const RowNormParams& p = bp.forward;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, piece = lane % L, c = piece * kVec;
  const bool in_row = c < p.dim;
  float w[kVec], dw[kVec] = {};
#pragma unroll
  for (int j = 0; j < kVec; ++j) w[j] = p.weight && in_row ? param_as_float<T>(p.weight, p.weight_dtype, c + j) : 1.f;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kRowsPerWarp;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRowsPerWarp; first < p.rows;
       first += step) {
    const int64_t row = first + lane / L, at = row * p.dim + c;
    const bool active = row < p.rows && in_row;
    float x[kVec] = {}, dy[kVec] = {}, g[kVec];
    if (active) {
      unpack16<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + at), x);
      load_piece<TO>(static_cast<const TO*>(bp.dy) + at, dy);
      if (p.gate)
        unpack16<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.gate) + gate_offset(p, row) + c), g);
    }
    const float r = active ? p.rstd[row] : 0.f;
    float dn[kVec], dot = 0.f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float n = x[j] * r, a = p.gate && active ? activate(g[j], p.act) : 1.f;
      dn[j] = dy[j] * w[j] * a;
      dot = fmaf(dn[j], n, dot);
      dw[j] = fmaf(dy[j] * n, a, dw[j]);
      if (p.gate && active) g[j] = dy[j] * n * w[j] * activate_grad(g[j], p.act);  // dgate, in place
    }
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o, L);
    if (!active) continue;
    const float mean_dot = dot / p.divisor;
    alignas(16) T dx[kVec], dg[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      dx[j] = from_float<T>(r * (dn[j] - x[j] * r * mean_dot));
      if (p.gate) dg[j] = from_float<T>(g[j]);
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(bp.dx) + at) = *reinterpret_cast<const uint4*>(dx);
    if (p.gate) *reinterpret_cast<uint4*>(static_cast<T*>(bp.dgate) + at) = *reinterpret_cast<const uint4*>(dg);
  }
  if (!bp.dweight) return;
  __shared__ float partial[kWarps][32 * 8];  // a row's columns: at most 32 pieces of 8
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float v = dw[j];
#pragma unroll
    for (int o = L; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);  // over the warp's row groups
    if (lane < L && in_row) partial[warp][c + j] = v;
  }
  add_block_columns(partial, p.dim, bp.dweight);
}

// Rows longer than a warp's registers take (kMaxWarpRowDim < D <= kMaxRowNormDim): a block of
// kWideThreads a row, thread t holding elements t, t + kWideThreads, ... (PerThread of them), the
// row's sums through the warps' shuffles and shared memory (block_sum). No residual add: the block
// norms that take one are narrower.
template <typename T, typename TO, int PerThread>
__global__ void __launch_bounds__(kWideThreads) row_norm_forward_wide_kernel(const RowNormParams p) {
  __shared__ float scratch[32];
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;
  float x[PerThread], w[PerThread], g[PerThread];
  load_row<T, PerThread, kWideThreads>(p.x, row * p.dim, p.dim, t, x);
  if (p.gate) load_row<T, PerThread, kWideThreads>(p.gate, gate_offset(p, row), p.dim, t, g);
  load_weight<T, PerThread, kWideThreads>(p, t, w);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PerThread; ++j) ss = fmaf(x[j], x[j], ss);
  const float r = rsqrtf(block_sum(ss, scratch) / p.divisor + p.eps);
#pragma unroll
  for (int j = 0; j < PerThread; ++j) x[j] *= r * w[j] * (p.gate ? activate(g[j], p.act) : 1.f);
  store_row<TO, PerThread, kWideThreads>(p.y, row * p.dim, p.dim, t, x);
  if (t == 0) p.rstd[row] = r;
}

// Its backward: rows grid-stride, a thread summing dweight for its own columns over its block's rows,
// then one atomicAdd per column and block.
template <typename T, typename TO, int PerThread>
__global__ void __launch_bounds__(kWideThreads) row_norm_backward_wide_kernel(const RowNormBackwardParams bp) {
  __shared__ float scratch[32];
  const RowNormParams& p = bp.forward;
  const int t = threadIdx.x;
  float w[PerThread], dw[PerThread] = {};
  load_weight<T, PerThread, kWideThreads>(p, t, w);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    float x[PerThread], dy[PerThread], g[PerThread];
    load_row<T, PerThread, kWideThreads>(p.x, row * p.dim, p.dim, t, x);
    load_row<TO, PerThread, kWideThreads>(bp.dy, row * p.dim, p.dim, t, dy);
    if (p.gate) load_row<T, PerThread, kWideThreads>(p.gate, gate_offset(p, row), p.dim, t, g);
    const float r = p.rstd[row];
    float dn[PerThread];
    const float mean_dot = block_sum(row_backward_terms(p, r, x, dy, w, g, dn, dw), scratch) / p.divisor;
#pragma unroll
    for (int j = 0; j < PerThread; ++j) x[j] = r * (dn[j] - x[j] * r * mean_dot);  // dx, in place
    store_row<T, PerThread, kWideThreads>(bp.dx, row * p.dim, p.dim, t, x);
    if (p.gate) store_row<T, PerThread, kWideThreads>(bp.dgate, row * p.dim, p.dim, t, g);
  }
  if (!bp.dweight) return;
#pragma unroll
  for (int j = 0; j < PerThread; ++j) {
    const int i = t + kWideThreads * j;
    if (i < p.dim) atomicAdd(bp.dweight + i, dw[j]);
  }
}

// Calls f(std::integral_constant<int, L>) with L the lanes a row of p takes in the 16-byte form, and
// returns true; false where the form does not serve p (the row not whole 16-byte pieces, more than
// 32 of them, or a tensor not 16-byte aligned).
template <typename T, typename F>
bool dispatch_row_lanes(const RowNormParams& p, std::initializer_list<const void*> tensors, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  const int pieces = p.dim / kVec;
  if (p.dim % kVec != 0 || pieces > 32) return false;
  for (const void* t : tensors)
    if (t && !aligned16(t)) return false;
  if (p.gate && (p.gate_group_stride * static_cast<int64_t>(sizeof(T))) % 16 != 0) return false;
  int lanes = 1;
  while (lanes < pieces) lanes *= 2;
  switch (lanes) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
  return true;
}

void check_params(const RowNormParams& p, const char* op) {
  LT2_CHECK(p.dim >= 1 && p.dim <= kMaxRowNormDim, op, ": row length must be in [1, ", kMaxRowNormDim, "], found ",
            p.dim);
  LT2_CHECK(p.rows >= 0 && p.rows / kWarps < INT32_MAX, op, ": rows ", p.rows, " outside [0, 2^31 x ", kWarps, ")");
  LT2_CHECK(p.dim <= kMaxWarpRowDim || p.rows <= INT32_MAX, op, ": rows ", p.rows, " of ", p.dim,
            " elements (a block a row) outside [0, 2^31)");
  LT2_CHECK(p.x && p.rstd && p.divisor > 0, op, ": x and rstd must be given and the divisor > 0");
  LT2_CHECK(p.weight_dtype == DType::Float32 || p.weight_dtype == p.dtype, op,
            ": the weight must be fp32 or of x's dtype");
  LT2_CHECK(!p.gate || (p.gate_group_rows >= 1 && p.gate_group_stride >= int64_t{p.gate_group_rows} * p.dim), op,
            ": the gate's groups must hold >= 1 rows and be at least that many rows apart, found ",
            p.gate_group_rows, " rows ", p.gate_group_stride, " elements apart");
}

// A residual (forward) or its gradient (backward): of x's dtype, or bf16 with fp32 x, and no gate.
void check_residual(const RowNormParams& p, const char* op) {
  LT2_CHECK(!p.gate && (p.residual_dtype == p.dtype || (p.dtype == DType::Float32 && p.residual_dtype == DType::BFloat16)),
            op, ": a residual must be of x's dtype, or bf16 with fp32 x, and comes without a gate");
  LT2_CHECK(p.dim <= kMaxWarpRowDim, op, ": a residual add takes rows of at most ", kMaxWarpRowDim,
            " elements, found ", p.dim);
}

// Calls f(T{}, TO{}) with T the rows' CUDA type and TO the output's: T, or bf16 for fp32 rows.
template <typename F>
void dispatch_types(const RowNormParams& p, F&& f) {
  if (p.out_dtype == p.dtype) {
    dispatch_dtype(p.dtype, [&](auto t) { f(t, t); });
    return;
  }
  LT2_CHECK(p.dtype == DType::Float32 && p.out_dtype == DType::BFloat16,
            "row norm: the output's dtype must be x's, or bf16 for fp32 x");
  f(float{}, __nv_bfloat16{});
}

// Calls f with the elements per lane the row length needs: 8 (D <= 256) or 32 (D <= kMaxWarpRowDim).
template <typename F>
void dispatch_per_lane(int dim, F&& f) {
  if (dim <= 256) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 32>{});
}

// Calls f with the elements per thread a wide row needs: 8 (D <= 2048) or 16 (D <= kMaxRowNormDim).
template <typename F>
void dispatch_per_thread(int dim, F&& f) {
  static_assert(16 * kWideThreads >= kMaxRowNormDim, "a wide row fits its block's registers");
  if (dim <= 8 * kWideThreads) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 16>{});
}

}  // namespace

void row_norm_forward(const RowNormParams& p, void* stream) {
  check_params(p, "row_norm_forward");
  LT2_CHECK(p.y && (!p.residual || p.h), "row_norm_forward: y (and h with a residual) must be given");
  if (p.residual) check_residual(p, "row_norm_forward");
  if (p.rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_types(p, [&](auto t, auto out) {
    using T = decltype(t);
    using TO = decltype(out);
    if (!p.residual && dispatch_row_lanes<T>(p, {p.x, p.y, p.gate}, [&](auto lanes) {
          constexpr int L = decltype(lanes)::value;
          const int64_t rows_per_block = int64_t{kWarps} * (32 / L);
          const auto blocks = static_cast<unsigned>((p.rows + rows_per_block - 1) / rows_per_block);
          row_norm_forward_vec_kernel<T, TO, L><<<blocks, 32 * kWarps, 0, s>>>(p);
        }))
      return;
    if (p.dim > kMaxWarpRowDim) {
      dispatch_per_thread(p.dim, [&](auto per_thread) {
        row_norm_forward_wide_kernel<T, TO, decltype(per_thread)::value>
            <<<static_cast<unsigned>(p.rows), kWideThreads, 0, s>>>(p);
      });
      return;
    }
    const auto blocks = static_cast<unsigned>((p.rows + kWarps - 1) / kWarps);
    dispatch_per_lane(p.dim, [&](auto per_lane) {
      row_norm_forward_kernel<T, TO, decltype(per_lane)::value><<<blocks, 32 * kWarps, 0, s>>>(p);
    });
  });
  check_launch("row_norm_forward");
}

void row_norm_backward(const RowNormBackwardParams& bp, void* stream) {
  const RowNormParams& p = bp.forward;
  check_params(p, "row_norm_backward");
  LT2_CHECK(bp.dy && bp.dx && (!p.gate || bp.dgate), "row_norm_backward: dy, dx (and dgate with a gate) must be given");
  if (bp.dresidual) check_residual(p, "row_norm_backward");
  if (p.rows == 0) return;
  int device = 0;
  cudaGetDevice(&device);
  // Enough blocks to fill the device a few times over; each walks its rows grid-stride, so the
  // dweight atomics are per block, not per row.
  const int64_t fill = 8LL * device_attribute(cudaDevAttrMultiProcessorCount, device, "row_norm_backward");
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_types(p, [&](auto t, auto out) {
    using T = decltype(t);
    using TO = decltype(out);
    if (!bp.dh && !bp.dresidual && dispatch_row_lanes<T>(p, {p.x, p.gate, bp.dy, bp.dx, bp.dgate}, [&](auto lanes) {
          constexpr int L = decltype(lanes)::value;
          const int64_t rows_per_block = int64_t{kWarps} * (32 / L);
          const auto blocks =
              static_cast<unsigned>(std::min<int64_t>((p.rows + rows_per_block - 1) / rows_per_block, fill));
          row_norm_backward_vec_kernel<T, TO, L><<<blocks, 32 * kWarps, 0, s>>>(bp);
        }))
      return;
    if (p.dim > kMaxWarpRowDim) {
      LT2_CHECK(!bp.dh, "row_norm_backward: h's gradient comes with rows of at most ", kMaxWarpRowDim, " elements");
      dispatch_per_thread(p.dim, [&](auto per_thread) {
        row_norm_backward_wide_kernel<T, TO, decltype(per_thread)::value>
            <<<static_cast<unsigned>(std::min<int64_t>(p.rows, fill)), kWideThreads, 0, s>>>(bp);
      });
      return;
    }
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((p.rows + kWarps - 1) / kWarps, fill));
    dispatch_per_lane(p.dim, [&](auto per_lane) {
      row_norm_backward_kernel<T, TO, decltype(per_lane)::value><<<blocks, 32 * kWarps, 0, s>>>(bp);
    });
  });
  check_launch("row_norm_backward");
}

}  // namespace lt2::kernels
