// The gradient reducer of a data-parallel job (lt2/train/distributed.h): sums the gradients over
// the ranks in buckets while backward still runs.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lt2/train/rendezvous.h"

namespace lt2 {

// Sums the gradients of `params` over the ranks in buckets of about `bucket_bytes`, each
// launched as soon as all its gradients are final, while backward still runs.
//
// Readiness. A hook after each parameter's AccumulateGrad node counts how often that node runs
// in the step's last backward. The count is not 1: the model is weight-shared across its T
// loops, and with per-loop activation checkpointing each loop's parameters get their gradient
// from a separate, re-entrant backward (T runs of the node); without it the engine sums the T
// contributions first (one run). The first step therefore only counts, reduces after backward,
// and orders the buckets by when each gradient became final on rank 0 (broadcast, so every rank
// launches the same buckets in the same order); from the second step on, a parameter is ready
// when its node has run as often as in the first step. Parameters that got no gradient in the
// first step (a frozen branch, an exit gate the objective ignores) are left out, as a single
// process leaves their .grad undefined; one that later gets more gradient runs than in the first
// step throws lt2::Error (the graph changed, which this scheme cannot follow).
//
// Why not c10d::Reducer (what PyTorch's DDP runs): it marks a parameter ready at its first hook
// unless put in static-graph mode, which counts hooks in the first iteration — the scheme above
// — but it is an internal class whose set-up Python's DDP wrapper does (parameter broadcast,
// bucket rebuilding, no_sync for accumulation) and which finalises the step from a callback
// queued on the autograd engine. The trainer here already owns the backward calls, so the end of
// the step's last backward is a point in its own code; the hooks, the counts and the buckets are
// all that is needed, and they stay readable.
class GradientBuckets {
 public:
  GradientBuckets(std::shared_ptr<ProcessGroup> group,
                  const std::vector<std::pair<std::string, torch::Tensor>>& params, int64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // Call right before the step's last local backward: gradients become final during it.
  void begin_last_backward();
  // Call after that backward: reduces what is left and leaves every rank's .grad = the sum over
  // the ranks. `step` names the step in error messages.
  void finish(int64_t step);
  // Buckets in use (0 until the first step has finished).
  int64_t num_buckets() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace lt2
