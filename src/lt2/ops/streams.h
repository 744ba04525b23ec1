// Work on two CUDA streams of one device: a branch that does not depend on the work beside it runs
// on a second stream, so a captured graph holds both as parallel branches.
#pragma once
#include <torch/torch.h>

#include <functional>

namespace lt2::ops {

// Runs `main` on the current stream of `device` and `side` on a second stream beside it: `side`
// starts after everything the current stream had enqueued, and whatever the current stream enqueues
// after run_beside starts after both. Neither may read what the other writes. The second stream and
// its two events are made on the first call for a device and kept (a graph capture may run either
// call, and makes no stream of its own). `side` runs under a stream guard, so what it allocates
// from the caching allocator belongs to the second stream. Without `fork`, on a CPU device or in a
// build without CUDA, `side` then `main` on the current stream.
void run_beside(torch::Device device, const std::function<void()>& side, const std::function<void()>& main,
                bool fork = true);

}  // namespace lt2::ops
