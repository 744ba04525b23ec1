// Where the tokens of a mixer call sit in their sequences and in the looped stack.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace lt2 {

// A random full/window layer pattern's draw for one (layer, loop) slot ("random:a:b",
// model/pattern.h): Configured = the mixer's own setting for the loop; Full = attend to every key;
// Window = the mixer's configured window (option "window").
enum class SlotDraw : uint8_t { Configured, Full, Window };

// The per-loop settings a mixer receives (caps().per_loop mixers read them): in Positions for
// forward and step, alone for make_state.
struct LoopSettings {
  int64_t loop = -1;  // loop iteration (0-based); -1 (make_state only): a state for every loop
  SlotDraw slot = SlotDraw::Configured;
};

// Documents packed into the rows of a parallel forward (training on packed documents): no token
// sees a token of another document. Row b of [B, T] holds documents starting at starts[b] (0 first,
// ascending, each < T); a document runs to the next start or to the end of its row.
struct PackedDocuments {
  // Throws lt2::Error naming what is wrong when `starts` does not describe B rows of T tokens.
  PackedDocuments(std::vector<std::vector<int64_t>> starts, int64_t T);
  // Documents start at t = 0 and at every t > 0 where tokens[b][t] == separator (the separator
  // opens the document it precedes, as a BOS token; the previous one ends just before it).
  // tokens: [B, T] int64 on the CPU.
  static PackedDocuments at_separator(const torch::Tensor& tokens, int64_t separator);
  int64_t rows() const { return static_cast<int64_t>(starts.size()); }
  std::vector<std::vector<int64_t>> starts;  // per row, as given
  int64_t T;
  // The rows one after another as one row of B * T tokens (flash-linear-attention's cu_seqlens):
  // document d holds flat tokens cu_seqlens[d] .. cu_seqlens[d + 1] - 1; the last is B * T.
  std::vector<int64_t> cu_seqlens;
  // [B, T] int64: each token's position inside its document (on the CPU as made; LoopedLM moves
  // it to the model's device).
  torch::Tensor offsets;
};

// Where the tokens of a call sit: token t of the input has absolute position `start + t` (the same
// for every sequence of the batch), inside loop iteration `loop` (0-based) of the looped stack.
//
// Per-sequence positions (the inference Engine's decode of a batch of sequences of different
// lengths): when `seq_pos` ([B] int64, on the input's device) is defined, the call is one decode
// token per sequence and sequence b's token sits at position seq_pos[b]; `start` is ignored, and
// the mixer neither checks nor advances `MixerState::length` (the engine owns the lengths). Nothing
// on this path reads device values on the host, so a CUDA graph captures it and replays it with new
// positions. Mixers that cannot serve it say so (MixerCaps::seq_pos).
struct Positions {
  Positions() = default;
  Positions(int64_t start_, int64_t loop_ = 0, torch::Tensor seq_pos_ = {}, SlotDraw slot_ = SlotDraw::Configured)
      : start(start_),
        loop(loop_),
        slot(slot_),
        seq_pos(std::move(seq_pos_)),
        seq_lens(seq_pos.defined() ? seq_pos + 1 : torch::Tensor()) {}
  int64_t start = 0;
  int64_t loop = 0;
  SlotDraw slot = SlotDraw::Configured;  // this (layer, loop) slot's draw (random patterns)
  LoopSettings loop_settings() const { return {loop, slot}; }
  torch::Tensor seq_pos;   // [B] int64, or undefined
  // [B] int64: seq_pos + 1, the tokens each sequence holds with the new one. Made once per pass
  // over the stack, not by each of its attention layers (one kernel each at decode).
  torch::Tensor seq_lens;
  // Packed documents of a parallel forward without a state (start 0), or null: one sequence. A
  // mixer serves them itself when MixerCaps::packed_documents says so; otherwise the caller runs
  // each document alone (mixers/documents.h).
  std::shared_ptr<const PackedDocuments> documents;
};

}  // namespace lt2
