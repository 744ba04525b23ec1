// Device helpers shared by the decode kernels: dtype conversions, 16-byte vector unpacking,
// warp/block sums, launch-error checks and the dtype dispatch of the launchers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "lt2/kernels/decode.h"
#include "lt2/util/error.h"

namespace lt2::kernels {

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

// 16 bytes of T (4 floats or 8 halves) -> floats.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum of v over the whole block, returned to every thread. The block's thread count must be a
// multiple of 32; `scratch` holds at least 32 floats. Safe to call repeatedly with one scratch.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int n_warps = (blockDim.x * blockDim.y) / 32;
  __syncthreads();  // the previous call's readers are done with scratch
  if (tid % 32 == 0) scratch[tid / 32] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// torch.nn.functional.softplus with its default threshold 20.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// Throws lt2::Error naming the kernel when the last launch failed.
inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  LT2_CHECK(err == cudaSuccess, kernel, " launch failed: ", cudaGetErrorString(err));
}

// Programmatic dependent launch (sm_90; no-ops elsewhere). A kernel launched by launch_pdl may
// start while the kernel before it in the stream is still running, so that its blocks can issue the
// loads that depend on nothing earlier (weights, their own recurrent state) meanwhile. Every thread
// calls grid_dependency_wait() before it reads what an earlier kernel wrote or writes anything an
// earlier kernel may read; it returns once the previous kernel has completed and its writes are
// visible. launch_dependents() lets the next kernel launch; a kernel calls it only after its own
// wait, so each kernel still starts after everything two launches back has completed.
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

// The launch attribute that lets a kernel overlap the end of the previous one (see above).
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic dependent launch allowed.
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr = pdl_attribute();
  config.attrs = &attr;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  LT2_CHECK(err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
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
