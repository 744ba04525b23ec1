// The token-mixer contract (DESIGN.md, "The mixer contract"). Every mixer (full attention, GDN,
// window, ...) is a torch::nn::Module with a parallel `forward`, a one-token `step` and a state
// allocated once, up front, by `make_state`.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

namespace lt2 {

using torch::Tensor;

// Where the tokens of a call sit: token t of the input has absolute position `start + t` (the same
// for every sequence of the batch), inside loop iteration `loop` (0-based) of the looped stack.
struct Positions {
  int64_t start = 0;
  int64_t loop = 0;
};

// Decode state of one mixer for one (layer, loop) pair: a KV cache, a recurrent matrix + conv
// window, a ring buffer, ... Allocated once by make_state; updated in place.
struct MixerState {
  virtual ~MixerState() = default;
  // Bytes this state holds (the engine sums them for memory planning).
  virtual int64_t bytes() const = 0;
  // Forget every token (back to the empty state) without reallocating.
  virtual void reset() = 0;
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
  // Softmax-attention mixers say true (they take the SDPA output gate, Ouro's import maps them).
  virtual bool is_attention() const { return false; }
};

using Mixer = std::shared_ptr<MixerImpl>;

}  // namespace lt2
