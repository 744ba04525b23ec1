#include "lt2/ops/memory_meter.h"

#include <c10/core/Allocator.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace lt2::ops {

struct MemoryMeter::Reporter : c10::MemoryReportingInfoBase {
  explicit Reporter(torch::Device d) : device(d) {}
  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t, size_t, c10::Device d) override {
    if (d.type() != device.type() || (device.has_index() && d.index() != device.index())) return;
    std::lock_guard<std::mutex> lock(mutex);
    if (alloc_size > 0) {
      held[ptr] = alloc_size;
      current += alloc_size;
      peak = std::max(peak, current);
    } else if (auto it = held.find(ptr); it != held.end()) {  // a free of a block it saw allocated
      current -= it->second;
      held.erase(it);
    }
  }
  bool memoryProfilingEnabled() const override { return true; }

  const torch::Device device;
  mutable std::mutex mutex;
  std::unordered_map<void*, int64_t> held;  // blocks allocated since the start, by address
  int64_t current = 0, peak = 0;
};

MemoryMeter::MemoryMeter(torch::Device device)
    : reporter_(std::make_shared<Reporter>(device)), guard_(c10::DebugInfoKind::PROFILER_STATE, reporter_) {}

int64_t MemoryMeter::current() const {
  std::lock_guard<std::mutex> lock(reporter_->mutex);
  return reporter_->current;
}

int64_t MemoryMeter::peak() const {
  std::lock_guard<std::mutex> lock(reporter_->mutex);
  return reporter_->peak;
}

void MemoryMeter::reset_peak() {
  std::lock_guard<std::mutex> lock(reporter_->mutex);
  reporter_->peak = reporter_->current;
}

}  // namespace lt2::ops
