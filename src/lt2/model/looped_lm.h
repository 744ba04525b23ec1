// LoopedLM = embedding -> T loops over N weight-shared blocks -> final norm -> LM head
// (docs/architecture.md, "The looped model"; the LT2 and Ouro papers).
//   LT2:  h_0 = Emb(x); h_tau = F(h_{tau-1}) + rho_tau * h_{tau-1}; logits = W_out(norm(h_T))
//   Ouro: h = Emb(x); per loop: h = norm(F(h)); exit_t = h; logits_t = lm_head(exit_t);
//         lambda_t = sigmoid(exit_gate(exit_t)); p_t = lambda_t prod_{j<t}(1 - lambda_j), p_T = rest
// Weights are shared across loops; state is not: each (loop, layer) pair has its own mixer state.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"
#include "lt2/model/block.h"
#include "lt2/model/decode_plan.h"
#include "lt2/model/pattern.h"

namespace lt2 {

// Decode state of a whole model: one mixer state per (loop, layer), index loop * N + layer
// (random patterns: one such group per vote draw k, index (k * n_loops + loop) * N + layer).
struct ModelState {
  std::vector<std::unique_ptr<MixerState>> mixers;
  int64_t length = 0;  // tokens consumed
  int64_t batch = 0, max_len = 0;
  int64_t bytes() const;
  void reset();
  // Views of sequences [begin, begin + count) of every mixer state (the same memory), empty
  // (length 0): the engine prefills one sequence of a batched state through it.
  std::unique_ptr<ModelState> slice(int64_t begin, int64_t count) const;
};

// Sees every mixer call of a forward: layer and loop (0-based), the mixer's input (the normed
// residual stream) and its output (before any post-norm), both [B, T, d]. Distillation aligns a
// student's mixers to these pairs (lt2/distill).
using MixerTap = std::function<void(int64_t layer, int64_t loop, const Tensor& input, const Tensor& output)>;

struct ForwardOptions {
  bool loop_logits = false;       // also return every loop's logits (Ouro objective, per-loop KD)
  bool loop_hidden = false;       // also return every loop's normed hidden state (per-loop KD)
  MixerTap mixer_tap;             // called after every mixer call of a parallel forward
  bool checkpoint_loops = false;  // recompute loops in backward instead of storing their activations:
  int64_t stored_loops = 1;       // with checkpoint_loops, all but the last this many (>= 1) of them
  // With checkpoint_loops and a loop recomputed: the last recomputed loop keeps the activations of
  // its last this many layers (0 .. n_layers - 1) and recomputes only the layers before them, so
  // memory can be spent a layer application at a time.
  int64_t partial_loop_layers = 0;
  int64_t exit_at_loop = -1;      // Ouro inference: take logits of this loop (1-based); -1 = use threshold
  double exit_threshold = -1;     // Ouro inference: exit at first cumulative p >= q; -1 = config value
  // Ouro inference: compare as Ouro's released code does (p_t and their cumulative sum in the model
  // dtype), so a token may exit early at q = 1 where the remaining mass rounds away; false: in fp32,
  // and q >= 1 always takes the last loop.
  bool exit_rule_published = false;
  int64_t n_loops = -1;           // run only the first n loops (1 <= n <= config n_loops); -1 = all
  bool compute_logits = true;     // false: return only hidden states (distillation of hidden states)
  bool last_logits_only = false;  // logits (and Ouro exit gates) of the last position only: prefill
  // Decode with per-sequence positions (the engine): tokens [B, 1], sequence b's token at position
  // seq_pos[b] ([B] int64 on the model's device). The state's lengths are neither checked nor
  // advanced, and nothing reads device values on the host (CUDA-graph capturable). Every mixer
  // must support it (MixerCaps::seq_pos).
  Tensor seq_pos;
  // Decode through a plan compiled for `state` (compile_decode_plan; the engine's, with seq_pos):
  // each (loop, layer) application runs the plan's entry, fused where the plan found a fused form.
  const DecodePlan* decode_plan = nullptr;
  // Documents packed into the rows of tokens (training on packed documents; no state): every
  // (layer, loop) runs each document as if alone, so the outputs equal each document's own forward.
  std::shared_ptr<const PackedDocuments> documents;
};

struct ModelOutput {
  Tensor logits;                   // [B, T, V] of the chosen exit (LT2: last loop)
  std::vector<Tensor> loop_logits; // T x [B, T, V] when requested
  std::vector<Tensor> loop_hidden; // T x [B, T, d] when requested: what head() of each loop reads
  Tensor hidden;                   // [B, T, d] final normed hidden state (of the last loop)
  Tensor exit_logits;              // [B, T, n_loops] Ouro exit-gate logits (lambda_t = sigmoid)
  Tensor exit_probs;               // [B, T, n_loops] Ouro exit distribution p_t (sums to 1)
  Tensor exit_loop;                // [B, T] int64, 1-based loop each token exited at (Ouro)
};

class LoopedLMImpl : public torch::nn::Module {
 public:
  explicit LoopedLMImpl(const ModelConfig& cfg);
  // tokens: [B, T] int64. With a state, continues from it (prefill chunk or decode step) and
  // advances it; without, runs the whole sequence from position 0.
  // A "random:a:b" pattern (model/pattern.h) re-draws its full/window slots at every forward in
  // training mode; in eval mode it returns the average distribution over the K fixed vote draws
  // (logits = log of the mean softmax, hidden = mean hidden; each draw has its own states).
  ModelOutput forward(const Tensor& tokens, ModelState* state = nullptr,
                      const ForwardOptions& opts = {});
  std::unique_ptr<ModelState> make_state(int64_t batch, int64_t max_len,
                                         torch::TensorOptions opts = {}) const;
  // The decode step compiled for `state` (a make_state of this model, or a slice of one) under the
  // DecodeOptions in force: model/decode_plan.h. Call after pack_for_inference.
  DecodePlan compile_decode_plan(ModelState& state) const { return DecodePlan(blocks_, state); }
  // The stack F applied once (loop index `loop`, 0-based) to h: [B, T, d]. `draw` (random
  // patterns, [n_loops, n_layers] bool, true = full) gives each layer's mixer its slot's draw.
  // With a state it uses the states of the current vote draw (random patterns). `documents`: the
  // packed documents of h's rows (ForwardOptions::documents), offsets on h's device, or null.
  // `plan` (ForwardOptions::decode_plan, for `state`) runs each application instead of its block.
  // Layers [first_layer, end_layer) only (end -1: through the last): a loop split in two runs the
  // second part on the first's output.
  Tensor run_stack(const Tensor& h, int64_t loop, int64_t start, ModelState* state,
                   const Tensor& seq_pos = {}, const Tensor& draw = {}, const MixerTap& tap = {},
                   const std::shared_ptr<const PackedDocuments>& documents = nullptr,
                   const DecodePlan* plan = nullptr, int64_t first_layer = 0, int64_t end_layer = -1);
  Tensor head(const Tensor& normed_hidden);  // [B, T, d] -> [B, T, V]
  // The LM head's weight [V, d]: the embedding's when tied.
  const Tensor& head_weight() const;
  // Whether forward(tokens, nullptr, opts)'s logits are head(hidden) at every position, so a loss
  // can take the hidden state and head_weight() instead of the logits (ops/loss/lm_head_loss.h).
  // Not where an exit gate picks each token's loop, nor where an eval-mode random pattern averages
  // its vote draws, nor with last_logits_only.
  bool logits_from_hidden(const ForwardOptions& opts) const;

  int64_t num_parameters(bool exclude_embeddings = false) const;
  // Inference: packs every layer's projections that share an input (FFN w1/w3, attention q/k/v/gate,
  // GDN's input projections) into one matrix each; same values, parameters become views of them.
  void pack_for_inference();
  const ModelConfig& config() const { return cfg_; }
  const std::vector<std::string>& layer_mixers() const { return layer_mixers_; }
  // Whether every layer's mixer decodes with per-sequence positions (ForwardOptions::seq_pos), and
  // the first that does not ("" when all do).
  std::string first_mixer_without_seq_pos() const;

  torch::nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear output{nullptr};  // null when tied to tok_embeddings
  Tensor rho;                          // [n_loops, d] LT2 loop residual gate (zero-init)
  torch::nn::Linear exit_gate{nullptr};// Ouro: Linear(d, 1) with bias

  std::vector<Mixer> mixers() const;  // each layer's mixer (shared by the loops), in order
  // The slot draw of the last training forward (random patterns; undefined before one).
  const Tensor& last_draw() const { return last_draw_; }

 private:
  ModelOutput forward_once(const Tensor& tokens, ModelState* state, const ForwardOptions& opts,
                           const Tensor& draw);
  ModelOutput vote(const Tensor& tokens, ModelState* state, const ForwardOptions& opts);

  ModelConfig cfg_;
  std::vector<std::string> layer_mixers_;
  std::vector<Block> blocks_;
  std::optional<RandomSlots> random_slots_;  // "random:a:b" patterns
  std::vector<Tensor> vote_draws_;           // their K inference draws
  Tensor last_draw_;                         // the last training forward's draw
  int64_t state_group_ = 0;                  // states of vote draw k: mixers[k T N ...]
};
TORCH_MODULE(LoopedLM);

// Ouro exit distribution from per-loop gate logits [..., T]: p_t = lambda_t prod_{j<t}(1-lambda_j)
// for t < T and p_T = prod_{j<T}(1 - lambda_j). Computed in accum_dtype (fp32; float64 stays float64).
Tensor exit_distribution(const Tensor& gate_logits);

}  // namespace lt2
