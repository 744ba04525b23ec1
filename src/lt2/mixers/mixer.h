// The token-mixer contract (DESIGN.md, "The mixer contract"). Every mixer (full attention, GDN,
// window, ...) is a torch::nn::Module with a parallel `forward`, a one-token `step` and a state
// allocated once, up front, by `make_state`.
#pragma once
#include <torch/torch.h>

#include <optional>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lt2/nn/positions.h"
#include "lt2/ops/projections.h"

namespace lt2 {

using torch::Tensor;

// Decode state of one mixer for one (layer, loop) pair: a KV cache, a recurrent matrix + conv
// window, a ring buffer, ... Allocated once by make_state; updated in place.
struct MixerState {
  virtual ~MixerState() = default;
  // Bytes this state holds (the engine sums them for memory planning).
  virtual int64_t bytes() const = 0;
  // Forget every token (back to the empty state) without reallocating.
  virtual void reset() = 0;
  // Views of sequences [begin, begin + count) of this state (the same memory): the engine prefills
  // one sequence of a batched state through them.
  virtual std::unique_ptr<MixerState> slice(int64_t begin, int64_t count) const = 0;
  // Bytes one decode step reads and writes in this state when it holds `length` tokens per
  // sequence (bandwidth accounting for benchmarks).
  virtual int64_t decode_bytes(int64_t length) const = 0;
  // Every tensor of the state (benchmarks fill them with random values).
  virtual std::vector<torch::Tensor> tensors() const = 0;
  // Tokens consumed so far.
  int64_t length = 0;
};

class MixerImpl : public torch::nn::Module {
 public:
  // x: [B, T, d]. Parallel over the sequence (training, prefill). With a state, continue from it
  // and leave in it the state after the last token (chunked prefill, prompt continuation).
  // pos.start must equal state->length when a state is given.
  virtual Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr) = 0;
  // x: [B, 1, d]. One decode step for every sequence of the batch; updates the state in place.
  virtual Tensor step(const Tensor& x, const Positions& pos, MixerState& state) {
    return forward(x, pos, &state);
  }
  // A state for `batch` sequences of at most `max_len` tokens. `opts` carries the device and the
  // model dtype (KV caches use it; recurrent states are always fp32).
  virtual std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len,
                                                 torch::TensorOptions opts) const = 0;
  // The state of this mixer for loop iteration `loop` (0-based) of the looped stack. Mixers whose
  // behaviour depends on the loop (a window size per loop) size the state for it; the default is
  // the same state in every loop.
  virtual std::unique_ptr<MixerState> make_loop_state(int64_t batch, int64_t max_len,
                                                      torch::TensorOptions opts, int64_t loop) const {
    return make_state(batch, max_len, opts);
  }
  // Registered name ("full", "gdn", ...).
  virtual std::string kind() const = 0;
  // Inference: pack the projections that read the same input into one matrix (pack_linears in
  // model/layers.h) so a decode step runs one GEMV instead of several. Same values; no-op default.
  virtual void pack_for_inference() {}
  // The pre-norm block's decode half `x + step(rms_norm(x, norm_weight, eps))` with the norm and
  // the residual add folded into the mixer's own kernels (x: [B, 1, d], the residual stream), its
  // output projection (with the add) left pending so the block can chain it with the FFN's
  // products. nullopt, before anything ran, when the mixer has no such form for these inputs: the
  // block then runs the norm, step() and the add itself.
  virtual std::optional<PendingProjection> step_residual_pending(const Tensor& x, const Tensor& norm_weight,
                                                                 double norm_eps, const Positions& pos,
                                                                 MixerState& state) {
    return std::nullopt;
  }
  // step_residual_pending with the projection run: [B, 1, d], or undefined.
  Tensor step_residual(const Tensor& x, const Tensor& norm_weight, double norm_eps, const Positions& pos,
                       MixerState& state) {
    const auto pending = step_residual_pending(x, norm_weight, norm_eps, pos, state);
    return pending ? pending->run().view(x.sizes()) : Tensor();
  }
  // Whether `step` accepts per-sequence positions (Positions::seq_pos).
  virtual bool supports_seq_pos() const { return false; }
  // Softmax-attention mixers say true (they take the SDPA output gate, Ouro's import maps them).
  virtual bool is_attention() const { return false; }
  // Transient bytes of an inference forward of `rows` tokens per sequence over `keys` keys, beyond
  // the few activations per token every mixer makes (memory planning: dense score blocks).
  virtual int64_t prefill_workspace_bytes(int64_t batch, int64_t rows, int64_t keys) const { return 0; }
};

using Mixer = std::shared_ptr<MixerImpl>;

}  // namespace lt2
