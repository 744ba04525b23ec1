// A model's decode step compiled for one batch of states (docs/decode.md, "The decode plan"). The
// Engine compiles one per batch bucket, over that bucket's views of its states, holds it and hands
// it to each decode forward (ForwardOptions::decode_plan); LoopedLM keeps its loop logic (loops,
// residual and exit gates, vote draws) and asks the plan to run each (loop, layer) application.
//
// One entry per application, i.e. per mixer state of the ModelState (index (draw * n_loops + loop)
// * n_layers + layer). Where the block is pre-norm and its mixer gives a DecodeDescriptor for that
// state whose input projection takes the block's norm as a GEMV prologue, the entry runs
//   parts = split(rms_norm(x) W_in^T)                 one GEMV (ops::normed_linear)
//   y     = core(parts, pos)                          the mixer's fused step, bound to the state
//   out   = h + ffn(rms_norm(h)),  h = x + out_proj(y [* sigmoid(gate)])
// with the output projection chained with the FFN's products (ops::swiglu_residual, up to
// DecodeOptions::chained_tail_max_rows the whole tail one chain), falling back product by product
// where a chain does not take them. Every other entry runs the block's forward (the mixer's step).
// Whether an application is fused is decided here, once, for the DecodeOptions in force, the
// batch, device and dtype; the step only runs what was decided.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lt2/model/block.h"

namespace lt2 {

struct ModelState;

class DecodePlan {
 public:
  // The plan for `state` (one mixer state per application) of a model whose layers are `blocks`,
  // packed for inference (LoopedLMImpl::pack_for_inference), under the DecodeOptions in force and
  // without gradients. The plan keeps pointers into `state`: it must outlive the plan.
  DecodePlan(const std::vector<Block>& blocks, ModelState& state);

  // Application `index` on x [B, 1, d] (the block input) at per-sequence positions: the block's
  // output [B, 1, d].
  Tensor step(int64_t index, const Tensor& x, const Positions& pos) const;

  const ModelState& state() const { return *state_; }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  // Applications that run fused, in all and of each mixer kind.
  int64_t fused_count() const;
  int64_t fused_count(const std::string& kind) const;
  // "12/16 applications fused (gdn 8/8, full 4/4, window 0/4)": kinds in layer order.
  std::string describe() const;

 private:
  struct Entry {
    std::shared_ptr<BlockImpl> block;
    MixerState* state;
    std::optional<DecodeDescriptor> fused;  // nullopt: the block's forward
  };
  Tensor fused_step(const Entry& e, const Tensor& x, const Positions& pos) const;

  std::vector<Entry> entries_;
  ModelState* state_;
  int64_t chained_tail_max_rows_;
};

}  // namespace lt2
