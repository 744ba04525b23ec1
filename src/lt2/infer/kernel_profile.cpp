#include "lt2/infer/kernel_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <map>
#include <unordered_map>

#include "lt2/util/error.h"

namespace lt2 {

namespace {

bool identifier_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The identifier that ends at `end` in s, past a balanced template argument list before it:
// "...::index_kernel_impl<OpaqueType<2> >" -> "index_kernel_impl".
std::string identifier_before(const std::string& s, size_t end) {
  if (end > 0 && s[end - 1] == '>')
    for (int depth = 0; end-- > 0;) {
      if (s[end] == '>') ++depth;
      if (s[end] == '<' && --depth == 0) break;
    }
  size_t begin = end;
  while (begin > 0 && identifier_char(s[begin - 1])) --begin;
  return s.substr(begin, end - begin);
}

// What a generic libtorch or CUTLASS kernel runs, read from its template arguments: the
// TensorIterator kernel (silu_kernel, direct_copy_kernel_cuda), else the innermost functor
// (MulFunctor, sum_functor), else the CUTLASS configuration; then the element type. Empty when
// none is named.
std::string generic_kernel_operation(const std::string& s) {
  std::string op;
  // The first TensorIterator kernel that is not one of libtorch's launch wrappers (gpu_kernel_impl...).
  for (size_t p = s.find("(at::TensorIteratorBase"); op.empty() && p != std::string::npos;
       p = s.find("(at::TensorIteratorBase", p + 1)) {
    op = identifier_before(s, p);
    if (op.rfind("gpu_kernel", 0) == 0) op.clear();
  }
  for (size_t p = s.find("unctor"); op.empty() && p != std::string::npos; p = s.find("unctor", p + 1)) {
    size_t end = p;
    while (end < s.size() && identifier_char(s[end])) ++end;
    if (s.find("unctor", end) == std::string::npos) op = identifier_before(s, end);
  }
  if (const size_t p = s.find("cutlass_"); op.empty() && p != std::string::npos) {
    size_t end = p;
    while (end < s.size() && identifier_char(s[end])) ++end;
    op = s.substr(p, end - p);
  }
  if (op.empty()) return op;
  const char* type = s.find("c10::BFloat16") != std::string::npos ? " bf16"
                     : s.find("c10::Half") != std::string::npos   ? " fp16"
                     : s.find("float") != std::string::npos       ? " fp32"
                                                                  : "";
  return op + type;
}

}  // namespace

std::string short_kernel_name(const std::string& name) {
  std::string s = name;
  if (s.rfind("void ", 0) == 0) s = s.substr(5);
  // Drop the parameter list: the last top-level '(' ... ')'.
  if (!s.empty() && s.back() == ')') {
    int depth = 0;
    for (size_t i = s.size(); i-- > 0;) {
      if (s[i] == ')') ++depth;
      if (s[i] == '(' && --depth == 0) {
        s = s.substr(0, i);
        break;
      }
    }
  }
  // Drop template arguments (nested <...>) and anonymous namespaces.
  std::string out;
  int depth = 0;
  for (char c : s) {
    if (c == '<') ++depth;
    else if (c == '>') depth = std::max(0, depth - 1);
    else if (depth == 0) out += c;
  }
  const std::string anon = "(anonymous namespace)::";
  for (size_t p; (p = out.find(anon)) != std::string::npos;) out.erase(p, anon.size());
  while (!out.empty() && out.back() == ' ') out.pop_back();
  // libtorch's and CUTLASS's generic kernels are told apart by what they run.
  const bool generic = (out.rfind("at::native::", 0) == 0 && out.size() > 7 &&
                        out.compare(out.size() - 7, 7, "_kernel") == 0) ||
                       out.rfind("cutlass::Kernel", 0) == 0;
  if (const auto op = generic ? generic_kernel_operation(s) : std::string(); !op.empty()) out += " [" + op + "]";
  if (out.size() > 120) out = out.substr(0, 117) + "...";
  return out.empty() ? name.substr(0, 90) : out;
}

KernelProfile summarize_activity(const std::vector<DeviceActivity>& events, int64_t steps, double span_us) {
  LT2_CHECK(steps > 0, "kernel profile: steps must be > 0, found ", steps);
  std::map<std::string, KernelTime> by_name;
  KernelProfile p;
  p.steps = steps;
  p.span_us = span_us;
  for (const auto& [name, us, op] : events) {
    const auto short_name = short_kernel_name(name) + (op.empty() ? "" : " <- " + op);
    auto& k = by_name[short_name];
    k.name = short_name;
    ++k.calls;
    k.total_us += us;
    p.busy_us += us;
  }
  for (auto& [_, k] : by_name) p.kernels.push_back(k);
  std::sort(p.kernels.begin(), p.kernels.end(),
            [](const KernelTime& a, const KernelTime& b) { return a.total_us > b.total_us; });
  return p;
}

std::string operator_label(const std::string& name, const std::vector<std::vector<int64_t>>& shapes,
                           const std::vector<std::string>& dtypes) {
  std::string label = name;
  if (!shapes.empty() && !shapes[0].empty()) {
    label += " [";
    for (size_t i = 0; i < shapes[0].size(); ++i) label += (i ? ", " : "") + std::to_string(shapes[0][i]);
    label += "]";
  }
  if (!dtypes.empty() && !dtypes[0].empty()) label += " " + dtypes[0];
  return label;
}

KernelProfile profile_device_activity(const std::function<void()>& step, int64_t steps, bool by_op) {
  LT2_CHECK(steps > 0, "kernel profile: steps must be > 0, found ", steps);
  if (!torch::cuda::is_available()) return {};
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                     /*report_input_shapes=*/by_op);
  std::set<ActivityType> activities{ActivityType::CUDA};
  if (by_op) activities.insert(ActivityType::CPU);
  torch::cuda::synchronize();
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  for (int64_t i = 0; i < steps; ++i) step();
  torch::cuda::synchronize();
  const auto result = prof::disableProfiler();
  // The CPU operators by correlation id: a kernel's linked correlation id names the operator
  // that was innermost when it was launched. The CUDA runtime and driver calls (cudaLaunchKernel,
  // cuLaunchKernel, ...) are CPU events too, with ids of the kernels' own kind: left out.
  using Shapes = std::vector<std::vector<int64_t>>;
  std::unordered_map<uint64_t, std::string> ops;
  if (by_op)
    for (const auto& e : result->events())
      if (e.deviceType() == c10::DeviceType::CPU && e.correlationId() != 0 && e.name().rfind("cu", 0) != 0)
        ops[e.correlationId()] = operator_label(e.name(), e.hasShapes() ? e.shapes().vec() : Shapes{},
                                                e.hasTypes() ? e.dtypes().vec() : std::vector<std::string>{});
  std::vector<DeviceActivity> events;
  uint64_t first = std::numeric_limits<uint64_t>::max(), last = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA || e.durationNs() == 0) continue;
    const auto op = ops.find(e.linkedCorrelationId());
    events.push_back({e.name(), double(e.durationNs()) / 1e3, op == ops.end() ? std::string() : op->second});
    first = std::min(first, e.startNs());
    last = std::max(last, e.endNs());
  }
  if (events.empty()) return {};
  return summarize_activity(events, steps, double(last - first) / 1e3);
}

nlohmann::json KernelProfile::to_json(size_t top) const {
  nlohmann::json ks = nlohmann::json::array();
  for (size_t i = 0; i < kernels.size() && i < top; ++i)
    ks.push_back({{"name", kernels[i].name},
                  {"calls_per_step", double(kernels[i].calls) / double(steps)},
                  {"us_per_step", kernels[i].total_us / double(steps)}});
  return {{"steps", steps}, {"busy_us_per_step", busy_us / double(steps)},
          {"span_us_per_step", span_us / double(steps)}, {"kernels", ks}};
}

std::string kernel_profile_table(const KernelProfile& p, size_t top) {
  if (p.steps == 0) return "no device activity recorded\n";
  const double n = double(p.steps);
  int64_t calls = 0;
  for (const auto& k : p.kernels) calls += k.calls;
  char buf[512];
  // Kernels that overlap (programmatic dependent launch, several streams) are busy for longer
  // than the span: there are no gaps then, only overlap.
  const double idle = (p.span_us - p.busy_us) / n;
  char gaps[96];
  if (idle >= 0) std::snprintf(gaps, sizeof gaps, "%.1f us of gaps", idle);
  else std::snprintf(gaps, sizeof gaps, "kernels overlap by %.1f us", -idle);
  std::snprintf(buf, sizeof buf,
                "per step: %.1f us from first kernel start to last end, %.1f us busy (%.0f%%), %s; "
                "%.0f device activities\n\n| kernel | calls/step | us/step | %% of busy |\n|---|---:|---:|---:|\n",
                p.span_us / n, p.busy_us / n, 100.0 * p.busy_us / std::max(p.span_us, 1e-9), gaps,
                double(calls) / n);
  std::string out = buf;
  for (size_t i = 0; i < p.kernels.size() && i < top; ++i) {
    const auto& k = p.kernels[i];
    std::snprintf(buf, sizeof buf, "| %s | %.1f | %.1f | %.1f%% |\n", k.name.c_str(), double(k.calls) / n,
                  k.total_us / n, 100.0 * k.total_us / std::max(p.busy_us, 1e-9));
    out += buf;
  }
  return out;
}

}  // namespace lt2
