// Sliding-window softmax attention (Longformer / Mistral style): the full-attention block (same projections,
// RoPE, GQA and SDPA output gate, so its weights are interchangeable with `full`) whose query at
// position i sees the W keys [i - W + 1, i], itself included. W may differ per loop iteration
// (LT2's loop-level windows, e.g. 128 -> 256 -> 512 -> full); W = 0 means full causal attention.
//
// Options (mixer.window): "window" (int, default 2048), "windows" (one W per loop, n_loops entries;
// overrides "window").
//
// Decode state: a ring buffer of the last min(W, max_len) tokens per (layer, loop): token p lives in
// slot p mod S, so memory does not grow with the context.
#pragma once
#include "lt2/mixers/full_attention.h"

namespace lt2 {

struct RingKVCache : MixerState {
  Tensor k, v;          // [B, H_kv, S, D], token at absolute position p in slot p mod S
  int64_t window = 0;   // W this state serves (0 = full)
  int64_t max_len = 0;  // tokens the state was made for
  int64_t bytes() const override;
  void reset() override { length = 0; }
  std::unique_ptr<MixerState> slice(int64_t begin, int64_t count) const override;
  int64_t decode_bytes(int64_t length) const override;
  std::vector<Tensor> tensors() const override { return {k, v}; }
  std::vector<int64_t> token_axes() const override { return {2, 2}; }
  int64_t slots() const { return k.size(2); }
};

class WindowAttentionImpl : public FullAttentionImpl {
 public:
  // window: the configured W; loop_windows: W per loop iteration (0 = full), one per loop. Fixed
  // for the mixer's life: a random pattern's draws arrive in Positions::slot and LoopSettings.
  WindowAttentionImpl(const ModelConfig& cfg, int64_t window, std::vector<int64_t> loop_windows);
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr) override;
  Tensor step(const Tensor& x, const Positions& pos, MixerState& state) override;
  // A state sized for the window of `loop` (LoopSettings::loop -1: for every loop, the widest).
  std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len, torch::TensorOptions opts,
                                         const LoopSettings& loop = {}) const override;
  std::string kind() const override { return "window"; }

  // The configured W of loop `loop` (option "windows", else "window"; 0 = full).
  int64_t window_at(int64_t loop) const;
  // The W a call with these settings uses: a random pattern's drawn slot (Full: 0; Window: the
  // configured "window") or, for SlotDraw::Configured, window_at(loop). Loop -1 (a state for
  // every loop): the widest configured W.
  int64_t window_for(const LoopSettings& s) const;
  const std::vector<int64_t>& loop_windows() const { return loop_windows_; }
  // The configured W (option "window"): what a "window" slot of a random pattern uses.
  const int64_t base_window;

 private:
  std::unique_ptr<RingKVCache> make_ring(int64_t batch, int64_t max_len, torch::TensorOptions opts,
                                         int64_t window) const;
  RingKVCache& ring_for(MixerState& state, const Positions& pos) const;
  // Decode at per-sequence positions (Positions::seq_pos): sequence b's token goes to slot
  // p mod S (p = seq_pos[b]); slot j then holds that sequence's latest position p - ((p - j) mod S),
  // attended when it is >= 0 and within the window.
  Tensor step_at(const Tensor& x, const Positions& pos, RingKVCache& ring);
  std::vector<int64_t> loop_windows_;
};

}  // namespace lt2
