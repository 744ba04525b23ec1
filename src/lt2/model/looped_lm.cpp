#include "lt2/model/looped_lm.h"

#include <cmath>

#include "lt2/model/checkpointing.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/model/pattern.h"

namespace lt2 {

int64_t ModelState::bytes() const {
  int64_t n = 0;
  for (const auto& m : mixers) n += m->bytes();
  return n;
}

std::unique_ptr<ModelState> ModelState::slice(int64_t begin, int64_t count) const {
  LT2_CHECK(begin >= 0 && count > 0 && begin + count <= batch, "state slice [", begin, ", ", begin + count,
            ") is outside the batch of ", batch);
  auto s = std::make_unique<ModelState>();
  s->batch = count;
  s->max_len = max_len;
  for (const auto& m : mixers) s->mixers.push_back(m->slice(begin, count));
  return s;
}

void ModelState::reset() {
  for (auto& m : mixers) {
    m->reset();
    m->length = 0;
  }
  length = 0;
}

Tensor exit_distribution(const Tensor& gate_logits) {
  auto lambda = torch::sigmoid(gate_logits.to(accum_dtype(gate_logits)));  // [..., T]
  const int64_t T = lambda.size(-1);
  // survive_t = prod_{j<t} (1 - lambda_j), survive_0 = 1
  auto log_keep = torch::log1p(-lambda.narrow(-1, 0, T - 1).clamp_max(1.0 - 1e-7));
  auto survive = torch::cat({torch::ones_like(lambda.narrow(-1, 0, 1)),
                             torch::exp(torch::cumsum(log_keep, -1))}, -1);
  auto p = survive * lambda;
  // The last loop takes all the remaining mass.
  return torch::cat({p.narrow(-1, 0, T - 1), survive.narrow(-1, T - 1, 1)}, -1);
}

LoopedLMImpl::LoopedLMImpl(const ModelConfig& cfg) : cfg_(cfg) {
  cfg_.validate();
  LT2_CHECK(cfg_.vocab_size > 0, "model config '", cfg_.name,
            "': vocab_size is 0 (= from the data); set it before building a model");
  layer_mixers_ = resolve_pattern(cfg_);
  random_slots_ = random_slots(cfg_);
  if (random_slots_) {
    LT2_CHECK(!cfg_.exit_gate, "model config '", cfg_.name, "': layer_pattern '", cfg_.layer_pattern,
              "' votes over draws, which the exit gate does not support");
    vote_draws_ = random_slots_->vote_draws(cfg_.n_loops, cfg_.n_layers);
  }
  const int64_t d = cfg_.d_model;
  tok_embeddings = register_module("tok_embeddings", torch::nn::Embedding(cfg_.vocab_size, d));
  trunc_normal_(tok_embeddings->weight, cfg_.init_scale());
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.n_layers; ++i) {
    blocks_.push_back(Block(cfg_, i, layer_mixers_[i]));
    layers->push_back(blocks_.back());
  }
  norm = register_module("norm", RMSNorm(d, cfg_.norm_eps));
  if (!cfg_.tie_embeddings) output = register_module("output", make_linear(d, cfg_.vocab_size, cfg_.init_scale()));
  if (cfg_.form == ModelForm::LT2 && cfg_.loop_gate)
    rho = register_parameter("rho", torch::zeros({cfg_.n_loops, d}));
  if (cfg_.exit_gate) {
    exit_gate = register_module("exit_gate", make_linear(d, 1, cfg_.init_scale(), /*bias=*/true));
  }
}

std::string LoopedLMImpl::first_mixer_without_seq_pos() const {
  for (const auto& b : blocks_)
    if (!b->mixer->caps().seq_pos) return b->mixer->kind();
  return "";
}

Tensor LoopedLMImpl::run_stack(const Tensor& h, int64_t loop, int64_t start, ModelState* state,
                               const Tensor& seq_pos, const Tensor& draw, const MixerTap& tap,
                               const std::shared_ptr<const PackedDocuments>& documents, const DecodePlan* plan,
                               int64_t first_layer, int64_t end_layer) {
  Positions pos{start, loop, seq_pos};
  pos.documents = documents;
  Tensor x = h, pending;  // the stream is x + pending: each block's FFN output is added by the next one's norm
  const int64_t N = cfg_.n_layers, end = end_layer < 0 ? N : end_layer;
  LT2_CHECK(0 <= first_layer && first_layer <= end && end <= N, "run_stack: layers [", first_layer, ", ", end,
            ") of ", N);
  const int64_t first = (state_group_ * cfg_.n_loops + loop) * N;  // this loop's states
  for (int64_t l = first_layer; l < end; ++l) {
    pos.slot = slot_draw(draw, loop, l);
    if (plan) {
      x = plan->step(first + l, x, pos);
      continue;
    }
    MixerObserver observe;
    if (tap) observe = [&tap, l, loop](const Tensor& in, const Tensor& out) { tap(l, loop, in, out); };
    auto out = blocks_[l]->forward_parts(x, pending, pos, state ? state->mixers[first + l].get() : nullptr, observe);
    x = out.h, pending = out.f;
  }
  return pending.defined() ? x + pending : x;
}

Tensor LoopedLMImpl::head(const Tensor& normed_hidden) { return ops::linear(normed_hidden, head_weight()); }

const Tensor& LoopedLMImpl::head_weight() const { return output ? output->weight : tok_embeddings->weight; }

bool LoopedLMImpl::logits_from_hidden(const ForwardOptions& opts) const {
  const int64_t T = opts.n_loops > 0 ? opts.n_loops : cfg_.n_loops;
  const bool exit_picks_loop = cfg_.form == ModelForm::Ouro && exit_gate && opts.exit_at_loop != T;
  const bool votes = random_slots_ && !is_training();
  return !exit_picks_loop && !votes && !opts.last_logits_only;
}

std::vector<Mixer> LoopedLMImpl::mixers() const {
  std::vector<Mixer> out;
  for (const auto& b : blocks_) out.push_back(b->mixer);
  return out;
}

ModelOutput LoopedLMImpl::forward(const Tensor& tokens, ModelState* state, const ForwardOptions& opts) {
  if (!random_slots_) return forward_once(tokens, state, opts, {});
  if (!is_training()) return vote(tokens, state, opts);
  last_draw_ = random_slots_->draw(cfg_.n_loops, cfg_.n_layers);
  return forward_once(tokens, state, opts, last_draw_);
}

ModelOutput LoopedLMImpl::vote(const Tensor& tokens, ModelState* state, const ForwardOptions& opts) {
  const int64_t start = state ? state->length : 0, K = vote_draws_.size();
  std::vector<ModelOutput> draws;
  for (int64_t k = 0; k < K; ++k) {
    state_group_ = k;
    if (state) state->length = start;
    draws.push_back(forward_once(tokens, state, opts, vote_draws_[k]));
  }
  state_group_ = 0;
  // log(mean_k softmax(logits_k)), in the accumulation dtype.
  auto average = [&](auto logits_of) {
    std::vector<Tensor> lp;
    for (auto& d : draws) lp.push_back(torch::log_softmax(logits_of(d).to(accum_dtype(logits_of(d))), -1));
    return (torch::logsumexp(torch::stack(lp), 0) - std::log(static_cast<double>(K))).to(logits_of(draws[0]).scalar_type());
  };
  ModelOutput out;
  std::vector<Tensor> hidden;
  for (auto& d : draws) hidden.push_back(d.hidden);
  out.hidden = torch::stack(hidden).mean(0);
  if (!opts.compute_logits) return out;
  out.logits = average([](const ModelOutput& d) { return d.logits; });
  for (size_t l = 0; l < draws[0].loop_logits.size(); ++l)
    out.loop_logits.push_back(average([l](const ModelOutput& d) { return d.loop_logits[l]; }));
  return out;
}

ModelOutput LoopedLMImpl::forward_once(const Tensor& tokens, ModelState* state, const ForwardOptions& opts,
                                       const Tensor& draw) {
  LT2_CHECK(tokens.dim() == 2, "tokens must be [B, T], found ", tokens.dim(), " dims");
  const bool per_seq = opts.seq_pos.defined();
  const int64_t start = state && !per_seq ? state->length : 0;
  LT2_CHECK(opts.n_loops == -1 || (opts.n_loops >= 1 && opts.n_loops <= cfg_.n_loops), "n_loops ", opts.n_loops,
            " must be in [1, ", cfg_.n_loops, "] (the model's loops)");
  const int64_t T = opts.n_loops > 0 ? opts.n_loops : cfg_.n_loops;
  if (per_seq) {
    LT2_CHECK(state && tokens.size(1) == 1 && opts.seq_pos.numel() == tokens.size(0), "decode with per-sequence "
              "positions takes tokens [B, 1], seq_pos [B] and a state; found tokens ", tokens.sizes(),
              ", seq_pos ", opts.seq_pos.sizes());
    const auto missing = first_mixer_without_seq_pos();
    LT2_CHECK(missing.empty(), "mixer '", missing, "' does not decode with per-sequence positions");
  }
  const DecodePlan* plan = opts.decode_plan;
  LT2_CHECK(!plan || (per_seq && &plan->state() == state && !opts.mixer_tap), "a decode plan runs decode with "
            "per-sequence positions over the state it was compiled for, without a mixer tap");
  std::shared_ptr<const PackedDocuments> documents;
  if (opts.documents) {
    LT2_CHECK(!state && !per_seq, "packed documents run in a forward without a state");
    LT2_CHECK(opts.documents->rows() == tokens.size(0) && opts.documents->T == tokens.size(1), "packed documents of ",
              opts.documents->rows(), " rows of ", opts.documents->T, " tokens, but tokens are ", tokens.sizes());
    auto on_device = std::make_shared<PackedDocuments>(*opts.documents);  // offsets once on the model's device
    on_device->offsets = on_device->offsets.to(tokens.device());
    documents = std::move(on_device);
  }
  if (state) {
    LT2_CHECK(tokens.size(0) == state->batch, "state was made for batch ", state->batch,
              ", tokens have batch ", tokens.size(0));
    LT2_CHECK(start + tokens.size(1) <= state->max_len, "state holds at most ", state->max_len,
              " tokens; ", start, " + ", tokens.size(1), " requested");
  }
  const bool ouro = cfg_.form == ModelForm::Ouro;
  LT2_CHECK(opts.stored_loops >= 1, "stored_loops must be >= 1 (the last loop always keeps its activations), found ",
            opts.stored_loops);
  LT2_CHECK(opts.partial_loop_layers >= 0 && opts.partial_loop_layers < cfg_.n_layers, "partial_loop_layers must be "
            "in [0, ", cfg_.n_layers, ") (the layers of a loop), found ", opts.partial_loop_layers);
  const bool recompute = opts.checkpoint_loops && !state && torch::GradMode::is_enabled();
  ModelOutput out;
  std::vector<Tensor> exits;  // Ouro: normed hidden of each loop
  Tensor h = tok_embeddings(tokens);
  for (int64_t loop = 0; loop < T; ++loop) {
    // Captures by value: with recompute it runs again in backward, after the caller's `opts` is gone.
    auto layers = [this, loop, start, state, seq_pos = opts.seq_pos, draw, tap = opts.mixer_tap, documents,
                   plan](const Tensor& x, int64_t first_layer, int64_t end_layer) {
      return run_stack(x, loop, start, state, seq_pos, draw, tap, documents, plan, first_layer, end_layer);
    };
    auto finish = [this, loop, ouro](Tensor next, const Tensor& prev) {
      if (ouro) return ops::rms_norm(next, norm);
      if (rho.defined()) next = next + rho[loop] * prev;
      return next;
    };
    auto one_loop = [layers, finish](const Tensor& prev) { return finish(layers(prev, 0, -1), prev); };
    // The last loop keeps its activations: its backward comes first, right after the forward, so
    // recomputing it would redo a whole loop to rebuild what is still at hand; the peak stays about
    // the same (the backward of a checkpointed loop holds one loop's activations too). The last
    // stored_loops keep theirs: where memory allows some loops but not all, fewer are recomputed,
    // and the last recomputed loop keeps its last partial_loop_layers layers' too.
    const int64_t N = cfg_.n_layers, kept = opts.partial_loop_layers;
    if (!recompute || loop + opts.stored_loops >= T) {
      h = one_loop(h);
    } else if (loop + opts.stored_loops + 1 == T && kept > 0) {
      const Tensor mid = checkpointed([layers, N, kept](const Tensor& x) { return layers(x, 0, N - kept); }, h);
      h = finish(layers(mid, N - kept, N), h);
    } else {
      h = checkpointed(one_loop, h);
    }
    if (ouro) exits.push_back(h);
    if (opts.loop_hidden || (opts.loop_logits && opts.compute_logits)) {
      const Tensor normed = ouro ? h : ops::rms_norm(h, norm);
      if (opts.loop_hidden) out.loop_hidden.push_back(normed);
      if (opts.loop_logits && opts.compute_logits) out.loop_logits.push_back(head(normed));
    }
  }
  if (state && !per_seq) {
    state->length = start + tokens.size(1);
    const int64_t group_size = cfg_.n_loops * cfg_.n_layers;
    for (int64_t i = 0; i < group_size; ++i)
      state->mixers[state_group_ * group_size + i]->length = state->length;
  }
  out.hidden = ouro ? h : ops::rms_norm(h, norm);
  if (!opts.compute_logits) return out;
  // Prefill needs only the last position's logits (a 32k-token prompt's would be 8 GB at a 128k vocab).
  LT2_CHECK(!(opts.last_logits_only && opts.loop_logits), "last_logits_only and loop_logits exclude each other");
  const int64_t L = opts.last_logits_only ? 1 : tokens.size(1);  // positions that get logits
  auto last = [&](const Tensor& hid) { return hid.narrow(1, hid.size(1) - L, L); };
  if (!ouro || !exit_gate) {
    out.logits = opts.loop_logits ? out.loop_logits.back() : head(last(out.hidden));
    return out;
  }
  for (auto& e : exits) e = last(e);
  // Ouro exit distribution and the exit loop of each token.
  std::vector<Tensor> gate_logits;
  for (auto& e : exits) gate_logits.push_back(exit_gate(e).squeeze(-1));
  out.exit_logits = torch::stack(gate_logits, -1);                  // [B, T, n_loops]
  out.exit_probs = exit_distribution(out.exit_logits);
  if (opts.exit_at_loop > 0) {
    LT2_CHECK(opts.exit_at_loop <= T, "exit_at_loop ", opts.exit_at_loop, " > n_loops ", T);
    out.exit_loop = torch::full({tokens.size(0), L}, opts.exit_at_loop, tokens.options().dtype(torch::kLong));
  } else {
    const double q = opts.exit_threshold > 0 ? opts.exit_threshold : cfg_.early_exit_threshold;
    if (opts.exit_rule_published) {
      // Ouro's released code: lambda_t, p_t and their running sum in the model dtype.
      auto lambda = torch::sigmoid(out.exit_logits.to(exits[0].scalar_type()));  // [B, L, T]
      auto remaining = torch::ones_like(lambda.select(-1, 0));
      std::vector<Tensor> p;
      for (int64_t t = 0; t + 1 < T; ++t) {
        p.push_back(lambda.select(-1, t) * remaining);
        remaining = remaining * (1 - lambda.select(-1, t));
      }
      p.push_back(remaining);
      auto reached = torch::cumsum(torch::stack(p, -1), -1) >= q;
      reached.select(-1, T - 1).fill_(true);
      out.exit_loop = reached.to(torch::kLong).argmax(-1) + 1;
    } else if (q >= 1.0) {
      out.exit_loop = torch::full({tokens.size(0), L}, T, tokens.options().dtype(torch::kLong));
    } else {
      auto reached = torch::cumsum(out.exit_probs, -1) >= q;  // [B, T, n_loops]
      reached.select(-1, T - 1).fill_(true);
      out.exit_loop = reached.to(torch::kLong).argmax(-1) + 1;
    }
  }
  // Logits: every token takes the logits of its exit loop. (The shortcut reads a device value: not
  // on the engine's graph-captured decode.)
  if (opts.exit_at_loop > 0 || (!per_seq && (out.exit_loop == T).all().item<bool>())) {
    int64_t l = opts.exit_at_loop > 0 ? opts.exit_at_loop : T;
    out.logits = opts.loop_logits ? out.loop_logits[l - 1] : head(exits[l - 1]);
  } else {
    auto stacked = torch::stack(exits, 2);  // [B, T, n_loops, d]
    auto idx = (out.exit_loop - 1).unsqueeze(-1).unsqueeze(-1).expand({-1, -1, 1, cfg_.d_model});
    out.logits = head(stacked.gather(2, idx).squeeze(2));
  }
  return out;
}

std::unique_ptr<ModelState> LoopedLMImpl::make_state(int64_t batch, int64_t max_len,
                                                     torch::TensorOptions opts) const {
  LT2_CHECK(batch > 0 && max_len > 0, "make_state: batch and max_len must be > 0");
  auto s = std::make_unique<ModelState>();
  s->batch = batch;
  s->max_len = max_len;
  const int64_t groups = random_slots_ ? static_cast<int64_t>(vote_draws_.size()) : 1;
  for (int64_t k = 0; k < groups; ++k) {
    const Tensor draw = random_slots_ ? vote_draws_[k] : Tensor();  // states sized for draw k
    for (int64_t loop = 0; loop < cfg_.n_loops; ++loop)
      for (int64_t l = 0; l < cfg_.n_layers; ++l)
        s->mixers.push_back(blocks_[l]->mixer->make_state(batch, max_len, opts, {loop, slot_draw(draw, loop, l)}));
  }
  return s;
}

void LoopedLMImpl::pack_for_inference() {
  for (auto& b : blocks_) {
    b->ffn->pack();
    b->mixer->pack_for_inference();
  }
}

int64_t LoopedLMImpl::num_parameters(bool exclude_embeddings) const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  if (exclude_embeddings) n -= tok_embeddings->weight.numel();
  return n;
}

}  // namespace lt2
