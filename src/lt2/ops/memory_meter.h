// Bytes the tensor allocators hand out on one device while a MemoryMeter lives: the net bytes of
// the blocks allocated since it started that are still held, and their peak. Tests and benchmarks
// compare the memory of two paths with it (what a forward keeps for backward, the peak of a
// step) without timing anything.
//
// It listens on c10's memory-reporting hook (the one the profiler's memory view uses): the CPU
// allocator and CUDA's caching allocator report every block allocated and freed on a thread that
// has a reporter installed. The meter installs itself for the calling thread; autograd's worker
// threads inherit it, so a backward on the GPU counts too. Blocks allocated before it started are
// not counted, nor their frees (c10's CPU allocator logs one warning when it frees such a block
// while a meter listens).
#pragma once
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/torch.h>

#include <memory>

namespace lt2::ops {

class MemoryMeter {
 public:
  // Counts the blocks of `device` (a device without an index: every device of its type).
  explicit MemoryMeter(torch::Device device);
  int64_t current() const;  // bytes held now, of blocks allocated since the meter started
  int64_t peak() const;     // the most current() has been since the start or reset_peak()
  void reset_peak();        // peak = current

 private:
  struct Reporter;
  std::shared_ptr<Reporter> reporter_;
  c10::DebugInfoGuard guard_;
};

}  // namespace lt2::ops
