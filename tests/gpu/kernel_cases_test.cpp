// GPU (CTest label `gpu`): every case of the kernel-case table (tests/gpu/kernel_cases/), one test
// per op: the CUDA kernel on fresh random inputs against its float64 reference, each of the
// case's comparisons within its bound (outputs: relative RMS error below 1e-5 in fp32, 5e-3 in
// bf16 and fp16; recurrent states 1e-5; conv windows and untouched memory exactly). A case whose
// kernel form this device does not run is left out, as the launcher would never pick it. Skips
// where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <exception>

#include "gpu/kernel_cases/kernel_cases.h"

namespace {

using namespace lt2::kernel_cases;

const std::vector<KernelCase>& cases() {
  static const std::vector<KernelCase> table = kernel_cases(test_grid());
  return table;
}

class KernelCases : public ::testing::TestWithParam<std::string> {};

TEST_P(KernelCases, MatchTheReference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  int checked = 0;
  for (const auto& c : cases()) {
    if (c.op != GetParam()) continue;
    SCOPED_TRACE(::testing::Message() << c.name() << " (outputs within " << c.tolerance << ")");
    try {
      const auto run = c.setup(Purpose::Check);
      if (!run.skip.empty()) continue;
      for (const auto& check : run.check()) EXPECT_TRUE(check.passed) << check.what << ": " << check.detail;
      ++checked;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw: " << e.what();
    }
  }
  EXPECT_GT(checked, 0) << "no case of " << GetParam() << " ran on this device";
}

INSTANTIATE_TEST_SUITE_P(Table, KernelCases, ::testing::ValuesIn(kernel_ops()),
                         [](const auto& info) { return info.param; });

}  // namespace
