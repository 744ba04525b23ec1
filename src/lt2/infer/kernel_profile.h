// Where a decode step's GPU time goes: runs a step under the Kineto profiler (CUPTI records the
// kernels of CUDA-graph replays too) and sums the device activity (kernels, copies, sets) by name.
//   busy = the sum of every activity's duration;  span = first start to last end;
//   span - busy = the gaps between kernels (launch latency, tails, dependencies) — at decode, with
//   hundreds of short kernels per step, often the largest single item.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt2 {

struct KernelTime {
  std::string name;  // shortened (short_kernel_name)
  int64_t calls = 0;
  double total_us = 0;
};

struct KernelProfile {
  int64_t steps = 0;
  double busy_us = 0;  // summed over the steps
  double span_us = 0;  // summed over the steps
  std::vector<KernelTime> kernels;  // by total time, descending
  nlohmann::json to_json(size_t top) const;
};

// One device activity: its full name, its duration and, where attributed, the operator that
// launched it (e.g. "aten::copy_ [8, 4096, 16, 192] BFloat16").
struct DeviceActivity {
  std::string name;
  double us = 0;
  std::string op;
};

// Profiles `steps` calls of `step` (each one step's work; the device is synchronised after each).
// With `by_op` the CPU operators are recorded too (with their input shapes) and each kernel is
// listed per launching operator: "kernel <- aten::op [first input's sizes] dtype" (the innermost
// operator, which libtorch's profiler links to the kernel's launch). Returns an empty profile
// (steps = 0) when no device activity was recorded, and without running `step` at all when no
// CUDA device is present.
KernelProfile profile_device_activity(const std::function<void()>& step, int64_t steps, bool by_op = false);

// Sums the activities into a profile by shortened name (and operator, where given).
KernelProfile summarize_activity(const std::vector<DeviceActivity>& events, int64_t steps, double span_us);

// "aten::mul [8, 4096, 2048] BFloat16": an operator's name with its first input's sizes and dtype.
std::string operator_label(const std::string& name, const std::vector<std::vector<int64_t>>& shapes,
                           const std::vector<std::string>& dtypes);

// "void at::native::(anonymous namespace)::foo<float, 4>(int, float*)" -> "at::native::foo";
// libtorch's generic kernels and CUTLASS's name what they run:
// "at::native::vectorized_elementwise_kernel [silu_kernel bf16]", "cutlass::Kernel2 [cutlass_80_...]".
std::string short_kernel_name(const std::string& name);

// Markdown: per-step busy / span / gaps, then the `top` kernels (us per step, calls per step, %).
std::string kernel_profile_table(const KernelProfile& p, size_t top);

}  // namespace lt2
