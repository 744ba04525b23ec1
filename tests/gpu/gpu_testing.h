// Skips shared by the GPU test programs (CTest label `gpu`): they run where a CUDA GPU is present
// and skip themselves elsewhere.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lt2/ops/fused_decode.h"

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU"

#define REQUIRE_FUSED_DECODE()                                         \
  if (!torch::cuda::is_available() || !lt2::fused_decode_available()) \
  GTEST_SKIP() << "no CUDA GPU or no CUDA kernels in this build"
