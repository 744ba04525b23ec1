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

// Profiles `steps` calls of `step` (each one step's work; the device is synchronised after each).
// Returns an empty profile (steps = 0) when no device activity was recorded, and without running
// `step` at all when no CUDA device is present.
KernelProfile profile_device_activity(const std::function<void()>& step, int64_t steps);

// Sums per-event (name, duration) records into a profile; names are shortened first.
KernelProfile summarize_activity(const std::vector<std::pair<std::string, double>>& events, int64_t steps,
                                 double span_us);

// "void at::native::(anonymous namespace)::foo<float, 4>(int, float*)" -> "at::native::foo";
// libtorch's generic kernels and CUTLASS's name what they run:
// "at::native::vectorized_elementwise_kernel [silu_kernel bf16]", "cutlass::Kernel2 [cutlass_80_...]".
std::string short_kernel_name(const std::string& name);

// Markdown: per-step busy / span / gaps, then the `top` kernels (us per step, calls per step, %).
std::string kernel_profile_table(const KernelProfile& p, size_t top);

}  // namespace lt2
