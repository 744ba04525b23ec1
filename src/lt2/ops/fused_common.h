// Pieces shared by the tensor bindings of the fused kernels (ops/fused_*.cpp): dtype mapping, the
// current stream, error helpers. Internal to those files.
#pragma once
#include <torch/torch.h>

#include "lt2/kernels/decode.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2::ops::detail {

// The activation dtypes the kernels are instantiated for.
inline bool kernel_dtype_ok(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16;
}

// A tensor's sizes for an error message; empty when it is undefined.
inline torch::IntArrayRef sizes_of(const torch::Tensor& t) { return t.defined() ? t.sizes() : torch::IntArrayRef{}; }

[[noreturn]] inline void no_cuda(const char* op) {
  throw Error(cat(op, ": this build has no CUDA kernels (configured with LT2_CUDA=OFF or without nvcc)"));
}

#ifdef LT2_WITH_CUDA
inline kernels::DType kernel_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kBFloat16: return kernels::DType::BFloat16;
    case torch::kFloat16: return kernels::DType::Float16;
    default: return kernels::DType::Float32;
  }
}

// The current CUDA stream of `on`'s device, as the launchers take it.
inline void* current_stream(const torch::Tensor& on) {
  return c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
}
#endif

}  // namespace lt2::ops::detail
