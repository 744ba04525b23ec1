// Skips shared by the GPU test programs (CTest label `gpu`): they run where a CUDA GPU is present
// and skip themselves elsewhere.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "gpu/kernel_cases/kernel_cases.h"
#include "lt2/ops/decode_options.h"

// CUDA graphs, streams and device guards, which the graph-replay tests use.
#ifdef LT2_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU"

#define REQUIRE_FUSED_DECODE()                                         \
  if (!torch::cuda::is_available() || !lt2::fused_decode_available()) \
  GTEST_SKIP() << "no CUDA GPU or no CUDA kernels in this build"

namespace lt2::gpu_testing {

// CUDA tensor options, invariant 5's tolerance per dtype and dtype names, as the kernel-case
// table defines them.
using kernel_cases::gpu;
using kernel_cases::name;
using kernel_cases::tolerance;

// Decode options with the fused kernels on or off (and any other field set on `options`), in
// force on this thread while the object lives.
struct FusedDecode {
  explicit FusedDecode(bool on) { options.fused = on; }
  lt2::DecodeOptions options;
  lt2::DecodeOptionsGuard guard{options};
};

}  // namespace lt2::gpu_testing
