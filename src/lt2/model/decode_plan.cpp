#include "lt2/model/decode_plan.h"

#include <algorithm>
#include <utility>

#include "lt2/model/looped_lm.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/util/error.h"

namespace lt2 {

namespace {

// The mixer's fused form for this application where the block is pre-norm (a sandwich norm's
// post-norm has nowhere to fold) and the descriptor's input projection takes the block's norm as
// its GEMV prologue.
std::optional<DecodeDescriptor> fused_form(BlockImpl& block, MixerState& state, int64_t batch) {
  if (block.mixer_post_norm) return std::nullopt;
  auto d = block.mixer->decode_descriptor(state, batch);
  if (!d) return std::nullopt;
  const auto x = torch::empty({batch, d->input_weight.size(1)}, d->input_weight.options());  // as step gives it
  if (!ops::normed_linear_applies(x, d->input_weight, block.mixer_norm->weight, block.mixer_norm->eps))
    return std::nullopt;
  return d;
}

}  // namespace

DecodePlan::DecodePlan(const std::vector<Block>& blocks, ModelState& state)
    : state_(&state), chained_tail_max_rows_(decode_options().chained_tail_max_rows) {
  torch::NoGradGuard no_grad;
  const size_t n_layers = blocks.size();
  for (size_t i = 0; i < state.mixers.size(); ++i) {
    const auto& block = blocks[i % n_layers].ptr();
    MixerState* s = state.mixers[i].get();
    entries_.push_back({block, s, fused_form(*block, *s, state.batch)});
  }
}

Tensor DecodePlan::step(int64_t index, const Tensor& x, const Positions& pos) const {
  const Entry& e = entries_.at(index);
  return e.fused ? fused_step(e, x, pos) : e.block->forward(x, pos, e.state);
}

Tensor DecodePlan::fused_step(const Entry& e, const Tensor& x, const Positions& pos) const {
  BlockImpl& block = *e.block;
  const DecodeDescriptor& d = *e.fused;
  const auto x2 = x.reshape({x.size(0), -1});  // [B, d]: the residual
  const auto projections = ops::normed_linear(x2, d.input_weight, block.mixer_norm->weight, block.mixer_norm->eps);
  LT2_CHECK(projections.defined(), "decode plan: the ", block.mixer->kind(), " input projection no longer runs fused");
  const auto parts = projections.split_with_sizes(d.part_sizes, -1);
  const PendingProjection mixer{d.core(parts, pos), d.output, d.gate_part >= 0 ? parts[d.gate_part] : Tensor(), x2};
  LT2_CHECK(mixer.y.defined(), "decode plan: the ", block.mixer->kind(), " decode core no longer runs fused");
  auto& ffn = *block.ffn;
  const auto& norm = block.ffn_norm;
  if (auto out = ops::swiglu_residual(ffn, mixer, norm->weight, norm->eps, chained_tail_max_rows_); out.defined())
    return out.view(x.sizes());
  const auto h = mixer.run().view(x.sizes());
  auto out = ops::swiglu_residual(ffn, h, norm->weight, norm->eps);
  return out.defined() ? out : h + ops::swiglu(ffn, ops::rms_norm(h, norm));
}

int64_t DecodePlan::fused_count() const {
  int64_t n = 0;
  for (const auto& e : entries_) n += e.fused.has_value();
  return n;
}

int64_t DecodePlan::fused_count(const std::string& kind) const {
  int64_t n = 0;
  for (const auto& e : entries_) n += e.fused.has_value() && e.block->mixer->kind() == kind;
  return n;
}

std::string DecodePlan::describe() const {
  std::vector<std::pair<std::string, int64_t>> kinds;  // kind, applications
  for (const auto& e : entries_) {
    const auto kind = e.block->mixer->kind();
    auto it = std::find_if(kinds.begin(), kinds.end(), [&kind](const auto& k) { return k.first == kind; });
    if (it == kinds.end()) kinds.emplace_back(kind, 1);
    else ++it->second;
  }
  std::string out = cat(fused_count(), "/", size(), " applications fused (");
  for (size_t i = 0; i < kinds.size(); ++i)
    out += cat(i ? ", " : "", kinds[i].first, " ", fused_count(kinds[i].first), "/", kinds[i].second);
  return out + ")";
}

}  // namespace lt2
