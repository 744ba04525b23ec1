// The error measure of the numeric tests, free of GoogleTest so that the kernel-case table
// (tests/gpu/kernel_cases/) and the benchmarks that link it can use it too.
#pragma once
#include <torch/torch.h>

#include <algorithm>

namespace lt2::testing {

// ||a - b|| / max(||b||, tiny), in float64.
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return (a64 - b64).norm().item<double>() / std::max(b64.norm().item<double>(), 1e-300);
}

}  // namespace lt2::testing
