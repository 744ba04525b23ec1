// Elementwise kernels of a block's decode path (decode.h: rms_norm, silu_mul). At decode a row is
// a few KiB, so these are launch-bound: their point is replacing the chain of small libtorch
// kernels (dtype casts, add, norm, silu, mul) with one launch each.
#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kNormThreads = 256;
constexpr int kSiluMulThreads = 256;

// One block per row. Two passes over the row: the sum of squares, then the scaled output. The
// second pass reads back what the same thread wrote or read in the first (same index mapping),
// so it needs neither shared memory for the row nor a barrier, and the row is in L1/L2.
template <typename T, bool kResidual>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const RmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int d = p.dim;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* residual = kResidual ? static_cast<const T*>(p.residual) + row * p.residual_row_stride : nullptr;
  T* h = kResidual ? static_cast<T*>(p.h) + row * d : nullptr;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < d; i += kNormThreads) {
    float v = to_float(x[i]);
    if constexpr (kResidual) {
      const T hv = from_float<T>(v + to_float(residual[i]));  // the residual stream's rounding
      h[i] = hv;
      v = to_float(hv);
    }
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / d + p.eps);
  const T* src = kResidual ? h : x;
  const T* weight = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * d;
  for (int i = threadIdx.x; i < d; i += kNormThreads)
    y[i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
}

// One thread per output element.
template <typename T>
__global__ void __launch_bounds__(kSiluMulThreads) silu_mul_kernel(const SiluMulParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kSiluMulThreads + threadIdx.x;
  if (idx >= p.rows * p.hidden) return;
  const int64_t row = idx / p.hidden;
  const int c = static_cast<int>(idx - row * p.hidden);
  const T* in = static_cast<const T*>(p.gate_up) + row * p.row_stride;
  const float a = to_float(in[c]);
  const T act = from_float<T>(silu(a));
  static_cast<T*>(p.out)[idx] = from_float<T>(to_float(act) * to_float(in[p.hidden + c]));
}

// The same, 16 bytes of T a thread (8 bf16 / fp16 or 4 fp32 columns of one row), where hidden, the
// row stride and both pointers allow 16-byte accesses. At prefill sizes (8k rows of 5,632) the
// one-element form issues a 2-byte load per input and a 64-bit division per element, and runs at
// ~3x the traffic floor; here a thread moves 48 bytes in three accesses and divides once.
template <typename T>
__global__ void __launch_bounds__(kSiluMulThreads) silu_mul_vec_kernel(const SiluMulParams p) {
  constexpr int kVec = 16 / sizeof(T);
  const int per_row = p.hidden / kVec;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kSiluMulThreads + threadIdx.x;
  if (idx >= p.rows * per_row) return;
  const int64_t row = idx / per_row;
  const int c = static_cast<int>(idx - row * per_row) * kVec;
  const T* in = static_cast<const T*>(p.gate_up) + row * p.row_stride;
  alignas(16) T gate[kVec], up[kVec], out[kVec];
  *reinterpret_cast<uint4*>(gate) = *reinterpret_cast<const uint4*>(in + c);
  *reinterpret_cast<uint4*>(up) = *reinterpret_cast<const uint4*>(in + p.hidden + c);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const T act = from_float<T>(silu(to_float(gate[j])));
    out[j] = from_float<T>(to_float(act) * to_float(up[j]));
  }
  *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + idx * kVec) = *reinterpret_cast<const uint4*>(out);
}

}  // namespace

void rms_norm(const RmsNormParams& p, void* stream) {
  LT2_CHECK(p.dim >= 1 && p.rows >= 0 && p.rows <= INT32_MAX && (!p.residual || p.h),
            "rms_norm: ", p.rows, " rows of dim ", p.dim, " (an h output is needed with a residual)");
  if (p.rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(p.rows);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (p.residual) rms_norm_kernel<T, true><<<grid, kNormThreads, 0, s>>>(p);
    else rms_norm_kernel<T, false><<<grid, kNormThreads, 0, s>>>(p);
  });
  check_launch("rms_norm");
}

void silu_mul(const SiluMulParams& p, void* stream) {
  LT2_CHECK(p.hidden >= 1 && p.rows >= 0, "silu_mul: ", p.rows, " rows of hidden size ", p.hidden);
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.hidden % kVec == 0 && p.row_stride % kVec == 0 && aligned16(p.gate_up) && aligned16(p.out);
    const int64_t threads = p.rows * p.hidden / (vec ? kVec : 1);
    const int64_t blocks = (threads + kSiluMulThreads - 1) / kSiluMulThreads;
    LT2_CHECK(blocks <= INT32_MAX, "silu_mul: ", p.rows, " x ", p.hidden, " elements is too many for one launch");
    const auto s = static_cast<cudaStream_t>(stream);
    if (vec) silu_mul_vec_kernel<T><<<static_cast<unsigned>(blocks), kSiluMulThreads, 0, s>>>(p);
    else silu_mul_kernel<T><<<static_cast<unsigned>(blocks), kSiluMulThreads, 0, s>>>(p);
  });
  check_launch("silu_mul");
}

}  // namespace lt2::kernels
