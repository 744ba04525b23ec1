// Activation checkpointing: run fn(x) without storing its activations and recompute it in the
// backward pass (libtorch's C++ API has no torch.utils.checkpoint). Gradients of parameters used by
// fn are accumulated into their .grad during backward, as PyTorch's reentrant checkpoint does.
// fn runs again in backward, after the caller's scope may have ended: it must own what it captures.
// The two passes run under RecomputePhase::CheckpointForward and ::Recompute (nn/recompute_phase.h),
// so a mixer's auxiliary loss is recorded once, by the first, with its own graph.
#pragma once
#include <torch/torch.h>

#include <functional>

namespace lt2 {

torch::Tensor checkpointed(std::function<torch::Tensor(const torch::Tensor&)> fn, const torch::Tensor& x);

}  // namespace lt2
