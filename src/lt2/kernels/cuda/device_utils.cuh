// Device helpers shared by the decode kernels: dtype conversions, 16-byte vector unpacking,
// tensor-core mma fragments, warp/block sums, launch-error checks and the dtype dispatch of the launchers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lt2/kernels/decode.h"
#include "lt2/util/error.h"

namespace lt2::kernels {

// Integer ceil(a / b) and a rounded up to a multiple of b (a >= 0, b > 0), for grids and layouts.
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }
// Whether a pointer allows 16-byte vector accesses.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// Element i of a parameter stored in fp32 or in the activations' type T (an inference model's
// weights, read as they are without a conversion pass), as a float.
template <typename T>
__device__ __forceinline__ float param_as_float(const void* base, DType dtype, int64_t i) {
  return dtype == DType::Float32 ? static_cast<const float*>(base)[i] : to_float(static_cast<const T*>(base)[i]);
}

// 16 bytes of T (4 floats or 8 halves) -> floats. By value: bound by reference to a dereferenced
// global pointer, the pair reads below compiled to four 4-byte loads instead of one 16-byte load.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 raw, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    const T2* pairs = reinterpret_cast<const T2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) f = __bfloat1622float2(pairs[i]);
      else f = __half22float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

// Two floats rounded to one 32-bit register of T pairs (an mma operand); T bf16 or fp16.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// acc += A B for one tensor-core m16n8k16 product (A row-major 16 x 16, B column-major 16 x 8, fp32
// accumulators; T bf16 or fp16). Fragments (lane = 4 g + t): a0 = A[g][2t, 2t + 1],
// a1 = A[g + 8][2t, ..], a2 = A[g][2t + 8, ..], a3 = A[g + 8][2t + 8, ..]; b0 = B[2t, 2t + 1][g],
// b1 = B[2t + 8, 2t + 9][g]; acc0, 1 = C[g][2t, 2t + 1], acc2, 3 = C[g + 8][2t, 2t + 1].
template <typename T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// x = big + small, each a TF32 operand (3xTF32). big is x with its 13 low mantissa bits cleared,
// small the exact remainder; the mma reads a TF32 operand's top 19 bits, so small loses its own low
// bits (2^-22 of x, as rounding would). Bit operations, not cvt.rna.tf32.f32: on sm_90 that
// conversion is a dozen integer and compare instructions.
struct SplitTf32 {
  uint32_t big, small;
};
__device__ __forceinline__ SplitTf32 split_tf32(float x) {
  const uint32_t big = __float_as_uint(x) & 0xffffe000u;
  return {big, __float_as_uint(x - __uint_as_float(big))};
}

// acc += A B for one m16n8k8 TF32 product. Fragments (lane = 4 g + t): a0 = A[g][t],
// a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]; b0 = B[t][g], b1 = B[t + 4][g];
// acc0, 1 = C[g][2t, 2t + 1], acc2, 3 = C[g + 8][2t, 2t + 1].
__device__ __forceinline__ void mma_tf32(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix.x4 of fp32 rows in shared memory: an 8 x 8 b16 matrix is 8 rows of 4 floats, and lane
// 4 g + t receives row g's float t of each of the four, the m16n8k8 TF32 fragment layout. Lanes
// 8q .. 8q + 7 give the row addresses of matrix q (16-byte aligned).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const float* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
}

// ldmatrix.x4.trans of 16-bit rows in shared memory: lanes 8q .. 8q + 7 give the row addresses of
// 8 x 8 matrix q (16-byte aligned), and lane 4 g + t receives elements [2t][g] and [2t + 1][g] of
// each, packed: from a row-major [k][n] tile, the "col" B fragment (b0, b1) of m16n8k16 for two
// n-tiles (matrices 0, 1: rows k0 .. k0 + 15 of n-tile 0; 2, 3: of n-tile 1).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
}

// x rounded to TF32 (to nearest, ties away from zero) as an mma operand: two integer instructions
// where cvt.rna.tf32.f32 is a dozen on sm_90.
__device__ __forceinline__ uint32_t tf32_round(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// A fragment (4 registers of fp32 bits) rounded to TF32 in place, or split into big and small.
__device__ __forceinline__ void round_fragment_tf32(uint32_t (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = tf32_round(__uint_as_float(a[r]));
}
__device__ __forceinline__ void split_fragment_tf32(const uint32_t (&a)[4], uint32_t (&big)[4], uint32_t (&small)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const SplitTf32 s = split_tf32(__uint_as_float(a[r]));
    big[r] = s.big, small[r] = s.small;
  }
}

// hi + lo += A B in 3xTF32 for one m16n8k8 product (A and B split): hi the big products, lo the
// corrections, a second accumulator so each dependent chain is one product long.
__device__ __forceinline__ void mma_3xtf32(float (&hi)[4], float (&lo)[4], const uint32_t (&a_big)[4],
                                           const uint32_t (&a_small)[4], SplitTf32 b0, SplitTf32 b1) {
  mma_tf32(lo, a_small, b0.big, b1.big);
  mma_tf32(lo, a_big, b0.small, b1.small);
  mma_tf32(hi, a_big, b0.big, b1.big);
}

// acc[j] += A[m0 : m0 + 16, x0 : x1] B[x0 : x1, 8 (nt0 + j) : + 8] for the warp's n-tiles j < tiles, as
// mma.sync m16n8k8 (3xTF32 into the same accumulator, or one TF32 product with kTf32), operands in
// shared memory read element by element: A(i, x) = a[i * a_i + x * a_x], B(x, c) = b[x * b_x + c * b_c]
// (either layout each). x0 and x1 multiples of 8.
template <int Tiles, bool kTf32>
__device__ __forceinline__ void warp_product(float (&acc)[Tiles][4], const float* a, int a_i, int a_x, const float* b,
                                             int b_x, int b_c, int m0, int nt0, int tiles, int x0, int x1) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* a_rows = a + (m0 + g) * a_i;
  for (int x = x0; x < x1; x += 8) {
    uint32_t frag[4] = {__float_as_uint(a_rows[(x + t) * a_x]), __float_as_uint(a_rows[8 * a_i + (x + t) * a_x]),
                        __float_as_uint(a_rows[(x + t + 4) * a_x]),
                        __float_as_uint(a_rows[8 * a_i + (x + t + 4) * a_x])};
    uint32_t big[4], small[4];
    if constexpr (kTf32) round_fragment_tf32(frag);
    else split_fragment_tf32(frag, big, small);
    const float* b_rows = b + (x + t) * b_x + (8 * nt0 + g) * b_c;
#pragma unroll
    for (int j = 0; j < Tiles; ++j) {
      if (j >= tiles) break;
      const float b0 = b_rows[8 * j * b_c], b1 = b_rows[4 * b_x + 8 * j * b_c];
      if constexpr (kTf32) mma_tf32(acc[j], frag, tf32_round(b0), tf32_round(b1));
      else mma_3xtf32(acc[j], acc[j], big, small, split_tf32(b0), split_tf32(b1));
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float2 warp_sum(float2 v) { return make_float2(warp_sum(v.x), warp_sum(v.y)); }
__device__ __forceinline__ void add_to(float& a, float b) { a += b; }
__device__ __forceinline__ void add_to(float2& a, float2 b) { a.x += b.x, a.y += b.y; }

// Sum of v (a float, or a float2: two sums for one pair of barriers) over the whole block,
// returned to every thread. The block's thread count must be a multiple of 32; `scratch` holds at
// least 32 values. Safe to call repeatedly with one scratch.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  v = warp_sum(v);
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int n_warps = (blockDim.x * blockDim.y) / 32;
  __syncthreads();  // the previous call's readers are done with scratch
  if (tid % 32 == 0) scratch[tid / 32] = v;
  __syncthreads();
  V total{};
  for (int w = 0; w < n_warps; ++w) add_to(total, scratch[w]);
  return total;
}

// RoPE of the n dims at `in` into `out` at position pos, the block's threads striding over the
// n / 2 pairs: interleaved (2i, 2i + 1) or halves (i, i + n / 2), angle pos theta^(-2i / n) in
// float64 (a float32 angle is off by ~1e-2 rad at 128k positions), the rotation in fp32.
template <typename In, typename Out>
__device__ void rope_rotate(const In* in, Out* out, int n, bool interleaved, int64_t pos, double theta) {
  for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + n / 2;
    double s, c;
    sincos(static_cast<double>(pos) * pow(theta, -static_cast<double>(2 * i) / n), &s, &c);
    const float xa = to_float(in[a]), xb = to_float(in[b]), cf = static_cast<float>(c), sf = static_cast<float>(s);
    out[a] = from_float<Out>(xa * cf - xb * sf);
    out[b] = from_float<Out>(xb * cf + xa * sf);
  }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

// 16 bytes global -> shared by cp.async through L2 only (.cg: no stale L1 line of what another
// block wrote), no registers held while in flight; 16-byte aligned ends.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// 4 bytes global -> shared by cp.async (.ca: 4-byte copies cannot bypass L1); 4-byte aligned ends.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
// cp.async groups: commit this thread's copies issued since the last commit as one group; wait
// until at most Pending of its committed groups are still in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// ops/sparse_attention's topk_indices' order-preserving map of fp32 to uint32 (negative: bits inverted;
// others: sign bit set), with -0 mapped as +0: the top-k kernels rank by it as the reference does.
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t bits = __float_as_uint(x);
  if (bits == 0x80000000u) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// torch.nn.functional.softplus with its default threshold 20.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// Throws lt2::Error naming the kernel when the last launch failed.
inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  LT2_CHECK(err == cudaSuccess, kernel, " launch failed: ", cudaGetErrorString(err));
}

// Programmatic dependent launch (sm_90; no-ops elsewhere). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start once every block of the kernel
// before it has called launch_dependents() (or exited), and must call grid_dependency_wait()
// before it reads what that kernel writes: the wait returns once it has completed and its writes
// are visible. A kernel that calls launch_dependents() must itself have been launched without the
// attribute (or after its own wait), so that a dependent still starts only after everything two
// launches back has completed.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The start of a kernel launched through launch_dependent that has nothing to do before its
// inputs are ready: wait for the kernel before it, then let the kernel after it launch, so that
// kernel's blocks are placed and its launch paid while this one runs.
__device__ __forceinline__ void dependent_kernel_start() {
  grid_dependency_wait();
  launch_dependents();
}

// Attribute `attr` of CUDA device `device` (the SM count, the compute capability, ...); `op` names
// the caller in the error.
inline int device_attribute(cudaDeviceAttr attr, int device, const char* op) {
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, attr, device);
  LT2_CHECK(err == cudaSuccess, op, ": cannot query CUDA device ", device, ": ", cudaGetErrorString(err));
  return value;
}

// Dynamic shared memory a kernel may use without opting in.
constexpr size_t kMaxDefaultSharedBytes = 48 * 1024;

// Raises Kernel's dynamic shared memory limit on the current device when it needs more than the
// default 48 KiB; once per size and device, so a graph-captured launch after an eager one makes
// no call. `name` names the kernel in the error when the device cannot give that much.
template <auto Kernel>
void reserve_shared(size_t bytes, const char* name) {
  if (bytes <= kMaxDefaultSharedBytes) return;
  constexpr int kMaxDevices = 64;
  static std::atomic<size_t> reserved[kMaxDevices];
  int device = 0, optin = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices && bytes <= reserved[device].load()) return;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  LT2_CHECK(bytes <= static_cast<size_t>(optin), name, ": needs ", bytes,
            " bytes of shared memory, the device allows ", optin);
  const cudaError_t err =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  LT2_CHECK(err == cudaSuccess, name, ": cannot reserve shared memory: ", cudaGetErrorString(err));
  if (device < kMaxDevices) reserved[device].store(bytes);
}

// Whether a grid of `blocks` blocks leaves most SMs of CUDA device `device` idle (fewer blocks than
// half of them). The decode kernels with one block per (sequence, head) have nothing to do before
// their wait, so an early launch can only hide the launch latency: they launch as programmatic
// dependents only on such grids. On fuller grids (the GDN step and DSA's prep, index scores and
// sparse attention at batch 8) the ordinary launch is the faster one (bench/notes/decode_engine.md,
// the launch policy).
inline bool grid_leaves_sms_idle(int64_t blocks, int device) {
  return 2 * blocks < device_attribute(cudaDevAttrMultiProcessorCount, device, "grid size");
}

// Launch attributes for launch_dependent's `extra`.
inline cudaLaunchAttribute cooperative_launch() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeCooperative;
  a.val.cooperative = 1;
  return a;
}
inline cudaLaunchAttribute cluster_launch(unsigned x) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = x, a.val.clusterDim.y = 1, a.val.clusterDim.z = 1;
  return a;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the `extra` attributes, launched as a
// programmatic dependent of the kernel before it on the stream where `as_dependent`: it may start before that kernel ends, so it must call
// grid_dependency_wait() before it touches memory an earlier kernel may still use, and
// launch_dependents() only after that wait (dependent_kernel_start does both). Otherwise an
// ordinary launch, after which the kernel's wait returns at once.
template <typename... Params, typename... Args>
void launch_maybe_dependent(bool as_dependent, const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                            size_t smem, cudaStream_t stream, std::initializer_list<cudaLaunchAttribute> extra,
                            Args&&... args) {
  cudaLaunchAttribute attrs[4]{};
  LT2_CHECK(extra.size() < 4, name, ": at most 3 extra launch attributes");
  unsigned n = 0;
  for (const cudaLaunchAttribute& a : extra) attrs[n++] = a;
  if (as_dependent) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  LT2_CHECK(err == cudaSuccess, name, " launch failed: ", cudaGetErrorString(err));
}

// launch_maybe_dependent as a programmatic dependent where `pdl` (the params' pdl field, which the
// ops set from DecodeOptions::pdl_for).
template <typename... Params, typename... Args>
void launch_dependent(bool pdl, const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, std::initializer_list<cudaLaunchAttribute> extra, Args&&... args) {
  launch_maybe_dependent(pdl, name, kernel, grid, block, smem, stream, extra, std::forward<Args>(args)...);
}

// launch_maybe_dependent for the decode kernels that start with nothing to do before their wait:
// a programmatic dependent only where the grid leaves most SMs of the current device idle
// (grid_leaves_sms_idle), and `pdl`.
template <typename... Params, typename... Args>
void launch_dependent_on_small_grid(bool pdl, const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, std::initializer_list<cudaLaunchAttribute> extra,
                                    Args&&... args) {
  int device = 0;
  cudaGetDevice(&device);
  const bool small = grid_leaves_sms_idle(static_cast<int64_t>(grid.x) * grid.y * grid.z, device);
  launch_maybe_dependent(pdl && small, name, kernel, grid, block, smem, stream, extra, std::forward<Args>(args)...);
}

// Calls f(T{}) with T the CUDA type of dtype.
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: f(float{}); break;
    case DType::BFloat16: f(__nv_bfloat16{}); break;
    case DType::Float16: f(__half{}); break;
  }
}

}  // namespace lt2::kernels
