// Pieces shared by the tensor bindings of the CUDA kernels (ops/<family>/*.cpp): input checks,
// dtype mapping, the current stream, error helpers. Internal to those files.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "lt2/kernels/decode.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2::ops::detail {

// The activation dtypes the kernels are instantiated for.
inline bool kernel_dtype_ok(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16;
}

// A weight the kernels read whole with 16-byte loads: contiguous from a 16-byte aligned start.
inline bool contiguous_aligned(const torch::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Whether t's rows (last dim) are contiguous and 16-byte aligned, as the kernels' 16-byte loads
// need: its pointer and every stride a whole number of 16-byte vectors.
inline bool rows_aligned(const torch::Tensor& t) {
  const int64_t vec = 16 / t.element_size();
  if (t.stride(-1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.stride(d) % vec != 0) return false;
  return true;
}

// t when rows_aligned, else an aligned contiguous copy. A clone, not contiguous(): contiguous()
// returns a view that already counts as contiguous (size-1 dims) as it is, offset included.
inline torch::Tensor with_aligned_rows(const torch::Tensor& t) {
  return rows_aligned(t) ? t : t.clone(torch::MemoryFormat::Contiguous);
}

// Why the kernels cannot take a tensor (empty when they can): defined, on CUDA, a kernel dtype.
inline std::string activation_problem(const torch::Tensor& t, const char* name) {
  if (!t.defined()) return cat(name, " is undefined");
  if (!t.is_cuda()) return cat(name, " is on ", t.device(), ", not CUDA");
  if (!kernel_dtype_ok(t.scalar_type()))
    return cat(name, " is ", t.scalar_type(), " (the kernels take float32, bfloat16, float16)");
  return "";
}

// Why a recurrent state cannot go to the kernels with activations `like` (empty when it can):
// contiguous fp32 on like's CUDA device.
inline std::string state_problem(const torch::Tensor& state, const torch::Tensor& like) {
  if (!state.defined() || !state.is_cuda() || state.device() != like.device())
    return cat("the state must be a CUDA tensor on ", like.device());
  if (state.scalar_type() != torch::kFloat32 || !state.is_contiguous())
    return cat("the state must be contiguous float32, found ", state.scalar_type(),
               state.is_contiguous() ? "" : " (not contiguous)");
  return "";
}

// For t [B, T, n] with its columns packed and its tokens evenly strided across the batch (as a
// column slice of a packed [B, T, N] projection is): the elements from one token to the next, which
// the kernels that read such slices in place take. 0 where they need a copy.
inline int64_t token_stride(const torch::Tensor& t) {
  const bool even = t.stride(2) == 1 && t.stride(1) >= t.size(2) &&
                    (t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1));
  return even ? t.stride(1) : 0;
}

// t in dtype `dt` with a contiguous last dim (no copy when it already is).
inline torch::Tensor with_contiguous_rows(const torch::Tensor& t, torch::ScalarType dt) {
  auto c = t.to(dt);
  return c.stride(-1) == 1 ? c : c.contiguous();
}

// Whether a decode path takes a fused kernel on `tensors`: the fused kernels are enabled
// (fused_decode_enabled), no gradient is recorded (the kernels have no autograd) and the tensors
// are CUDA tensors of one kernel dtype and device with a contiguous last dim.
inline bool fused_elementwise_applies(const std::vector<torch::Tensor>& tensors) {
  if (!fused_decode_enabled() || torch::GradMode::is_enabled() || tensors.empty()) return false;
  const torch::Tensor& first = tensors.front();
  for (const auto& t : tensors)
    if (!activation_problem(t, "t").empty() || t.dim() == 0 || t.stride(-1) != 1 ||
        t.scalar_type() != first.scalar_type() || t.device() != first.device())
      return false;
  return true;
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

// The fp32 workspace of a split-K attention kernel whose splits leave partials for a combine:
// partial outputs [B, H, splits, D] and their log-sum-exps [B, H, splits]; undefined (nullptr)
// without `partials` (one split that writes out directly).
struct SplitWorkspace {
  torch::Tensor out, lse;
  SplitWorkspace(int64_t batch, int64_t heads, int splits, int64_t head_dim, const torch::TensorOptions& like,
                 bool partials) {
    if (!partials) return;
    out = torch::empty({batch, heads, splits, head_dim}, like.dtype(torch::kFloat32));
    lse = torch::empty({batch, heads, splits}, like.dtype(torch::kFloat32));
  }
  float* out_ptr() const { return out.defined() ? out.data_ptr<float>() : nullptr; }
  float* lse_ptr() const { return lse.defined() ? lse.data_ptr<float>() : nullptr; }
};

// The index of CUDA device `device`: its own, or the current device's where it names none.
inline int cuda_index(const torch::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

// The current CUDA stream of `on`'s device, as the launchers take it.
inline void* current_stream(const torch::Tensor& on) {
  return c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
}
#endif

}  // namespace lt2::ops::detail
