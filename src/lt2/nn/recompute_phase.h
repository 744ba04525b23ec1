// Where a forward runs with respect to per-loop activation checkpointing (model/checkpointing.h),
// for mixers that record auxiliary losses (DSA's indexer loss): a checkpointed forward runs without
// a gradient, and its backward runs the same forward again. Thread-local: the backward's recompute
// runs on autograd's thread, which sets its own phase.
#pragma once

namespace lt2 {

enum class RecomputePhase {
  None,                // an ordinary forward
  CheckpointForward,   // the first pass of a checkpointed forward (no gradient; losses recorded now must carry their own)
  Recompute,           // the backward's second pass (its auxiliary losses were recorded by the first)
};

RecomputePhase recompute_phase();

// Sets the phase for its scope.
class RecomputePhaseScope {
 public:
  explicit RecomputePhaseScope(RecomputePhase phase);
  ~RecomputePhaseScope();
  RecomputePhaseScope(const RecomputePhaseScope&) = delete;
  RecomputePhaseScope& operator=(const RecomputePhaseScope&) = delete;

 private:
  RecomputePhase previous_;
};

}  // namespace lt2
