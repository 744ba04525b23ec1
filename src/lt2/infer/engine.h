// The inference Engine (docs/decode.md): `max_batch` sequence slots over one preallocated
// ModelState (a mixer state per (loop, layer) pair, N x T of them), each slot with its own length.
//
//   prefill(slot, prompt)  resets the slot and runs the prompt through it in chunks (the parallel
//                          forms: SDPA, chunked scans), through views of that slot's states;
//   decode(tokens [n])     one token for each of slots 0..n-1 at its own position (sequences of
//                          different lengths decode together; Positions::seq_pos).
//
// Each batch-size bucket (1, 2, 4, ... up to max_batch) gets its decode step compiled at
// construction: a DecodePlan (model/decode_plan.h) over views of the bucket's slots, which decides
// once which (loop, layer) applications run their fused forms. On CUDA that step is then captured
// once as a CUDA graph and replayed: a step allocates nothing and launches one graph. Inputs
// (tokens, positions) live in static device buffers the step reads; logits come back in the
// graph's static output. A decode of n sequences replays the smallest bucket >= n, so
// it also advances slots n..bucket-1: the caller keeps its live sequences in slots 0..n-1, and a
// slot past n holds no sequence that must survive (prefill resets a slot before using it).
//
// Rows beyond the decode slots: `staging_rows` more rows of the same state that no decode step
// touches. A server prefills a prompt there a chunk at a time (extend) between decode steps, then
// moves the sequence into a decode slot (copy_row). A row's state can also be copied out
// (snapshot) and back (restore): the prefix cache of `lt2 serve`.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "lt2/model/looped_lm.h"
#include "lt2/ops/decode_options.h"

namespace lt2 {

struct EngineOptions {
  int64_t max_batch = 1;        // sequence slots
  int64_t max_len = 4096;       // tokens per sequence: prompt + generated
  int64_t prefill_chunk = 2048; // prompt tokens per prefill forward
  int64_t staging_rows = 0;     // rows after the max_batch decode slots that decode never touches
  bool cuda_graphs = true;      // capture and replay the decode step (CUDA only)
  bool every_bucket = true;     // buckets 1, 2, 4, ..., max_batch; false: max_batch only
  DecodeOptions decode;         // the kernels and launch settings of everything the engine runs
  // Models in bf16/fp16 on CUDA: the prefill's fp32 chunk products (the linear recurrences'
  // chunked forms) on TF32 tensor cores (nn/precision.h).
  bool tf32 = true;
  // Options of every forward (loops, Ouro exit control); the engine sets last_logits_only and
  // seq_pos itself.
  ForwardOptions forward;
};

class Engine {
 public:
  // The model must be in eval mode on its final device and dtype; every mixer must decode with
  // per-sequence positions (MixerCaps::seq_pos), else an error names the one that does not.
  // The engine packs the model's projections (LoopedLMImpl::pack_for_inference; same values).
  Engine(LoopedLM model, EngineOptions opts);
  ~Engine();

  // Resets `slot` and prefills `prompt` ([T] int64, 1 <= T <= max_len, any device) into it.
  // Returns the logits of the prompt's last token, [V] in the model dtype. Any row (staging too).
  Tensor prefill(int64_t slot, const Tensor& prompt);
  // Runs `tokens` ([T] int64, T >= 1, length(row) + T <= max_len) through `row`, continuing from
  // the tokens it holds, in forwards of at most prefill_chunk tokens. Returns the last token's
  // logits [V]. prefill(row, p) is reset(row) then extend(row, p).
  Tensor extend(int64_t row, const Tensor& tokens);
  // Forgets every token of `row` (an empty state, length 0).
  void reset(int64_t row);
  // Copies the sequence of row `src` (its state and length) into row `dst`; src keeps it.
  void copy_row(int64_t src, int64_t dst);

  // A copy of one row's state: the tensors its mixer states hold for the sequence (along token
  // axes only the rows of its `length` tokens; MixerState::token_axes), in state order.
  struct Snapshot {
    std::vector<Tensor> tensors;
    int64_t length = 0;
    int64_t bytes() const;
    torch::Device device() const { return tensors.empty() ? torch::Device(torch::kCPU) : tensors.front().device(); }
    Snapshot to(torch::Device device) const;  // a copy on `device`
  };
  // The state of `row` copied to `device` (default: the model's device).
  Snapshot snapshot(int64_t row, std::optional<torch::Device> device = std::nullopt) const;
  // Makes `row` hold the snapshot's sequence (from any device); restore(r, snapshot(s)) makes r
  // decode exactly as s would.
  void restore(int64_t row, const Snapshot& snap);
  // One decode step for slots 0..n-1: tokens [n] int64 (any device), n <= max_batch; each slot's
  // length advances by one (it must be < max_len). Returns logits [n, V] in the model dtype, valid
  // until the next decode.
  Tensor decode(const Tensor& tokens);

  int64_t length(int64_t slot) const;
  // Decode slots plus staging rows.
  int64_t rows() const { return opts_.max_batch + opts_.staging_rows; }
  // Declares that every slot holds `length` tokens and fills every state with random values, as if
  // they had been consumed (decode cost does not depend on the values): decode benchmarks at long
  // contexts without prefilling them.
  void fill_random(int64_t length, uint64_t seed);

  const EngineOptions& options() const { return opts_; }
  const ModelState& state() const { return *state_; }
  LoopedLMImpl& model() { return *model_; }
  bool graphs_captured() const;
  // The batch-size buckets, ascending (the last is max_batch).
  const std::vector<int64_t>& buckets() const { return buckets_; }
  // The decode plan of the bucket that decodes `n` sequences (1 <= n <= max_batch).
  const DecodePlan& decode_plan(int64_t n) const;

 private:
  struct Bucket;
  struct Steps;
  int64_t bucket_for(int64_t n) const;
  // The eager decode step of one bucket on its static inputs (graph capture records exactly this).
  Tensor decode_eager(const Bucket& bucket);
  void check_row(int64_t row) const;
  // Every tensor of the row's state with the part that holds its sequence: along a token axis
  // only rows [0, min(length, size)).
  std::vector<Tensor> row_parts(int64_t row, int64_t length) const;
  void set_length(int64_t row, int64_t length);

  LoopedLM model_;
  EngineOptions opts_;
  torch::TensorOptions state_opts_;
  std::unique_ptr<ModelState> state_;
  std::vector<int64_t> lengths_;  // tokens each slot holds
  Tensor device_lengths_;         // the same on the model's device: a decode step reads its positions
                                  // there, so no host-to-device copy waits for the previous step
  std::vector<int64_t> buckets_;
  std::unique_ptr<Steps> steps_;
};

}  // namespace lt2
