// Where the tokens of a mixer call sit in their sequences and in the looped stack.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <utility>

namespace lt2 {

// Where the tokens of a call sit: token t of the input has absolute position `start + t` (the same
// for every sequence of the batch), inside loop iteration `loop` (0-based) of the looped stack.
//
// Per-sequence positions (the inference Engine's decode of a batch of sequences of different
// lengths): when `seq_pos` ([B] int64, on the input's device) is defined, the call is one decode
// token per sequence and sequence b's token sits at position seq_pos[b]; `start` is ignored, and
// the mixer neither checks nor advances `MixerState::length` (the engine owns the lengths). Nothing
// on this path reads device values on the host, so a CUDA graph captures it and replays it with new
// positions. Mixers that cannot serve it say so (`supports_seq_pos`).
struct Positions {
  Positions() = default;
  Positions(int64_t start_, int64_t loop_ = 0, torch::Tensor seq_pos_ = {})
      : start(start_),
        loop(loop_),
        seq_pos(std::move(seq_pos_)),
        seq_lens(seq_pos.defined() ? seq_pos + 1 : torch::Tensor()) {}
  int64_t start = 0;
  int64_t loop = 0;
  torch::Tensor seq_pos;   // [B] int64, or undefined
  // [B] int64: seq_pos + 1, the tokens each sequence holds with the new one. Made once per pass
  // over the stack, not by each of its attention layers (one kernel each at decode).
  torch::Tensor seq_lens;
};

}  // namespace lt2
