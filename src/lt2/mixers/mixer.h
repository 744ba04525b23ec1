// The token-mixer contract (docs/architecture.md, "The mixer contract"). Every mixer (full attention, GDN,
// window, ...) is a torch::nn::Module with a parallel `forward`, a one-token `step`, a state
// allocated once, up front, by `make_state`, and its capabilities as data (MixerCaps). Registering
// a mixer (registry.h) puts it under the invariant suite (tests/mixers/test_mixer_invariants.cpp).
#pragma once
#include <torch/torch.h>

#include <optional>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lt2/nn/positions.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

using torch::Tensor;

// Decode state of one mixer for one (layer, loop) pair: a KV cache, a recurrent matrix + conv
// window, a ring buffer, ... Allocated once by make_state; updated in place.
class MixerImpl;

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
  // For each tensor of tensors(), the axis along which it holds one row per token, filled from
  // row 0 (a KV cache; a ring of S rows fills rows [0, min(length, S)) before it wraps), or -1 when
  // the whole tensor is state. Rows [0, min(length, size)) along these axes and the other tensors
  // whole are everything a sequence's state holds: the engine copies only those to move a
  // sequence between slots or to snapshot it (the prefix cache of `lt2 serve`).
  virtual std::vector<int64_t> token_axes() const { return std::vector<int64_t>(tensors().size(), -1); }
  // Tokens consumed so far.
  int64_t length = 0;
};

// What a mixer can do beyond forward / step / make_state, as data (set by its constructor, read
// through MixerImpl::caps()): callers decide from it instead of asking through more virtuals.
struct MixerCaps {
  // Softmax attention over the tokens (full, window, DSA): takes the SDPA output gate.
  bool attention_like = false;
  // `step` accepts per-sequence positions (Positions::seq_pos), so the Engine can decode sequences
  // of different lengths together.
  bool seq_pos = false;
  // Behaviour depends on per-loop settings (Positions::loop and Positions::slot, and the
  // LoopSettings given to make_state): a window size per loop, a drawn full/window slot.
  bool per_loop = false;
  // `forward` without a state serves Positions::documents itself, no token seeing another document
  // (the delta-rule family: one varlen scan over every document). For the others,
  // mixer_forward (mixers/documents.h) runs each document alone.
  bool packed_documents = false;
  // Records an auxiliary training loss in its parallel forward (MixerImpl::aux_loss()).
  bool aux_loss = false;
  // Its parallel forward reads x only through linear layers (and views), x's gradient coming from
  // one of them, so under autocast the block may hand x over in the autocast dtype
  // (ops::rms_norm_for_products): the products see the same values and x's gradient is the same
  // (several products would sum it in that dtype). Every built-in mixer does (its input projections
  // are one GEMM); a mixer that computes with x in its own dtype, or reads it through several
  // linears, sets it false. The invariant test checks every mixer that claims it.
  bool input_feeds_products = true;
  // Transient bytes of an inference forward of `rows` tokens per sequence over `keys` keys, beyond
  // the few activations per token every mixer makes (memory planning: dense score blocks). Empty
  // for mixers without such blocks.
  std::function<int64_t(const MixerImpl& self, int64_t batch, int64_t rows, int64_t keys)> prefill_workspace;
};

// A mixer's fused decode step in three parts, so that the block around it can fold its norm into
// the first and chain the last with its FFN (model/decode_plan.h):
//   input projection  rms_norm(x) input_weight^T, x [B, d] the block input: one GEMV with the
//                     block's norm as its prologue (ops::normed_linear), its output [B, N] split
//                     along the last dim into parts of part_sizes (N their sum);
//   core              the parts ([B, n_i] views) and the positions -> y [B, K]; advances the state
//                     the descriptor was made for;
//   output            x + (y * sigmoid(parts[gate_part]) when gate_part >= 0, else y) W_out^T,
//                     left pending (PendingProjection) for the block's tail.
struct DecodeDescriptor {
  Tensor input_weight;  // [N, d], the mixer's packed input projections
  std::vector<int64_t> part_sizes;
  std::function<Tensor(const std::vector<Tensor>& parts, const Positions& pos)> core;
  torch::nn::Linear output{nullptr};
  int64_t gate_part = -1;
};

// Training stage of a mixer's auxiliary loss (MixerCaps::aux_loss):
//   Off     nothing recorded (inference, or the auxiliary part fixed);
//   Warmup  the mixer runs its warm-up form and records the loss; only its auxiliary parameters
//           train, on that loss alone;
//   Joint   its normal form; the loss is recorded and added to the model's loss.
enum class AuxLossStage { Off, Warmup, Joint };

// The auxiliary-loss side of a mixer (MixerImpl::aux_loss()). Each parallel forward without a
// state records one loss (a scalar) while the stage is not Off, until taken.
class AuxLoss {
 public:
  virtual ~AuxLoss() = default;
  virtual void set_stage(AuxLossStage stage) = 0;
  // The recorded losses, in forward order; clears them.
  virtual std::vector<Tensor> take() = 0;
  // The parameters the auxiliary loss trains (all that the warm-up trains).
  virtual std::vector<Tensor> parameters() const = 0;
};

// The mixer contract: forward, step, make_state and kind, capabilities as data (caps()), an
// optional auxiliary loss, and the decode fast path (pack_for_inference, decode_descriptor).
// Per-loop settings reach the mixer through its arguments (Positions, LoopSettings); a mixer never
// changes behaviour because the model reconfigured it.
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
  // model dtype (KV caches use it; recurrent states are always fp32). `loop` says which (loop,
  // slot) the state serves: mixers with per-loop settings (caps().per_loop) size it for them;
  // the default (loop -1) serves every loop.
  virtual std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len, torch::TensorOptions opts,
                                                 const LoopSettings& loop = {}) const = 0;
  // Registered name ("full", "gdn", ...).
  virtual std::string kind() const = 0;
  const MixerCaps& caps() const { return caps_; }
  // The auxiliary loss (caps().aux_loss), or nullptr.
  virtual AuxLoss* aux_loss() { return nullptr; }
  // caps().prefill_workspace for these sizes, 0 when the mixer has none.
  int64_t prefill_workspace_bytes(int64_t batch, int64_t rows, int64_t keys) const {
    return caps_.prefill_workspace ? caps_.prefill_workspace(*this, batch, rows, keys) : 0;
  }
  // Inference: pack the projections that read the same input into one matrix (pack_linears in
  // model/layers.h) so a decode step runs one GEMV instead of several. Same values; no-op default.
  virtual void pack_for_inference() {}
  // The mixer's fused decode form for `state` (one decode token per sequence at per-sequence
  // positions, `batch` sequences, the packed weights of pack_for_inference, no gradient, the
  // DecodeOptions in force), decided once: a decode plan (model/decode_plan.h) compiles it for each
  // (loop, layer) application and runs it at every step without asking again. nullopt where the
  // mixer has no such form for these: the plan runs the block's forward (and so step()) there.
  virtual std::optional<DecodeDescriptor> decode_descriptor(MixerState& state, int64_t batch) { return std::nullopt; }

 protected:
  MixerCaps caps_;  // set by each mixer's constructor
};

using Mixer = std::shared_ptr<MixerImpl>;

}  // namespace lt2
