#include "lt2/nn/recompute_phase.h"

namespace lt2 {

namespace {
thread_local RecomputePhase current_phase = RecomputePhase::None;
}  // namespace

RecomputePhase recompute_phase() { return current_phase; }

RecomputePhaseScope::RecomputePhaseScope(RecomputePhase phase) : previous_(current_phase) { current_phase = phase; }

RecomputePhaseScope::~RecomputePhaseScope() { current_phase = previous_; }

}  // namespace lt2
