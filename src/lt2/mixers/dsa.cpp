#include "lt2/mixers/dsa.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/recompute_phase.h"
#include "lt2/ops/attention/decode.h"
#include "lt2/ops/attention/rope.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/gemv.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"

namespace lt2 {

namespace {

Tensor arange_long(int64_t start, int64_t end, torch::Device device) {
  return torch::arange(start, end, torch::TensorOptions().dtype(torch::kLong).device(device));
}

}  // namespace

IndexerStage parse_indexer_stage(const std::string& s) {
  if (s == "off") return IndexerStage::Off;
  if (s == "dense_warmup") return IndexerStage::DenseWarmup;
  if (s == "sparse") return IndexerStage::Sparse;
  throw Error(cat("indexer stage '", s, "': expected 'off', 'dense_warmup' or 'sparse'"));
}

std::string to_string(IndexerStage s) {
  switch (s) {
    case IndexerStage::Off: return "off";
    case IndexerStage::DenseWarmup: return "dense_warmup";
    case IndexerStage::Sparse: return "sparse";
  }
  return "?";
}

int64_t DSAState::bytes() const {
  return k.nbytes() + (v.defined() ? v.nbytes() : 0) + index_keys.nbytes();
}

std::unique_ptr<MixerState> DSAState::slice(int64_t begin, int64_t count) const {
  auto s = std::make_unique<DSAState>();
  s->k = k.narrow(0, begin, count);
  if (v.defined()) s->v = v.narrow(0, begin, count);
  s->index_keys = index_keys.narrow(0, begin, count);
  s->topk = topk;
  return s;
}

int64_t DSAState::decode_bytes(int64_t length) const {
  const int64_t L = k.size(2), n = std::min(length + 1, L);
  const int64_t kv_row = (k.nbytes() + (v.defined() ? v.nbytes() : 0)) / L;  // one token, all sequences
  return index_keys.nbytes() / L * n + kv_row * std::min(n, topk);
}

std::vector<Tensor> DSAState::tensors() const {
  std::vector<Tensor> out{k, index_keys};
  if (v.defined()) out.push_back(v);
  return out;
}

std::vector<int64_t> DSAState::token_axes() const {
  std::vector<int64_t> out{2, 1};
  if (v.defined()) out.push_back(2);
  return out;
}

DSAImpl::DSAImpl(const ModelConfig& cfg, const json& o)
    : topk(2048),
      index_heads(64),
      index_head_dim(128),
      index_rope_dim(-1),
      latent(false),
      latent_dim(512),
      latent_rope_dim(64),
      n_heads(cfg.n_heads),
      n_kv_heads(cfg.kv_heads()),
      head_dim(cfg.dim_head()),
      rope_theta(cfg.rope_theta),
      rope_style(cfg.rope_style) {
  caps_.attention_like = true;
  caps_.seq_pos = true;
  caps_.aux_loss = true;
  caps_.prefill_workspace = [](const MixerImpl& self, int64_t batch, int64_t rows, int64_t keys) {
    return static_cast<const DSAImpl&>(self).workspace_bytes(batch, rows, keys);
  };
  const std::string where = "mixer.dsa";
  json_reject_unknown(o, {"topk", "index_heads", "index_head_dim", "index_rope_dim", "attention",
                          "latent_dim", "latent_rope_dim"}, where);
  std::string form = "gqa";
  json_get(o, "topk", topk, where);
  json_get(o, "index_heads", index_heads, where);
  json_get(o, "index_head_dim", index_head_dim, where);
  json_get(o, "attention", form, where);
  json_get(o, "latent_dim", latent_dim, where);
  json_get(o, "latent_rope_dim", latent_rope_dim, where);
  if (index_rope_dim < 0) index_rope_dim = index_head_dim / 2;
  json_get(o, "index_rope_dim", index_rope_dim, where);
  LT2_CHECK(form == "gqa" || form == "latent", where, ": 'attention' must be 'gqa' or 'latent', found '", form, "'");
  latent = form == "latent";
  LT2_CHECK(topk > 0 && index_heads > 0 && index_head_dim > 0, where,
            ": topk, index_heads and index_head_dim must be > 0");
  LT2_CHECK(index_rope_dim >= 0 && index_rope_dim <= index_head_dim && index_rope_dim % 2 == 0, where,
            ": index_rope_dim must be even and in [0, index_head_dim], found ", index_rope_dim);
  LT2_CHECK(!latent || (latent_dim > 0 && latent_rope_dim > 0 && latent_rope_dim % 2 == 0), where,
            ": latent_dim must be > 0 and latent_rope_dim even and > 0");

  const int64_t d = cfg.d_model;
  const double std = cfg.init_scale();
  if (!latent) {
    attn = register_module("attn", std::make_shared<FullAttentionImpl>(cfg));
  } else {
    const int64_t H = n_heads, D = head_dim;
    n_kv_heads = 1;
    wq = register_module("wq", make_linear(d, H * (D + latent_rope_dim), std));
    wkv_a = register_module("wkv_a", make_linear(d, latent_dim + latent_rope_dim, std));
    kv_norm = register_module("kv_norm", RMSNorm(latent_dim, cfg.norm_eps));
    wk_b = register_parameter("wk_b", torch::empty({H, D, latent_dim}));
    wv_b = register_parameter("wv_b", torch::empty({H, latent_dim, D}));
    trunc_normal_(wk_b, 1.0 / std::sqrt(static_cast<double>(D)));
    trunc_normal_(wv_b, 1.0 / std::sqrt(static_cast<double>(latent_dim)));
    if (cfg.attn_output_gate) wgate = register_module("wgate", make_linear(d, H * D, 0.0));
    wo = register_module("wo", make_linear(H * D, d, 1.0 / std::sqrt(static_cast<double>(H * D))));
  }
  index_wq = register_module("index_wq", make_linear(d, index_heads * index_head_dim, std));
  index_wk = register_module("index_wk", make_linear(d, index_head_dim, std));
  index_ww = register_module("index_ww", make_linear(d, index_heads, std));
  index_k_norm = register_module(
      "index_k_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({index_head_dim}).eps(1e-6)));
}

double DSAImpl::scale() const {
  return 1.0 / std::sqrt(static_cast<double>(head_dim + (latent ? latent_rope_dim : 0)));
}

double DSAImpl::index_weight_scale() const {
  return 1.0 / std::sqrt(static_cast<double>(index_heads * index_head_dim));
}

std::vector<torch::nn::Linear> DSAImpl::input_projections() const {
  std::vector<torch::nn::Linear> layers{wq, wkv_a, index_wq, index_wk, index_ww};
  if (wgate) layers.push_back(wgate);
  return layers;
}

void DSAImpl::pack_for_inference() {
  if (!latent) return attn->pack_for_inference();
  if (w_in.defined()) return;
  w_in = pack_linears(input_projections());
  torch::NoGradGuard ng;
  // The absorption GEMVs read wk_b, wv_b transposed. The parameters become transposed views of
  // those copies (one storage, as pack_linears does for w_in), so an update to a parameter after
  // packing (a loaded checkpoint, a training step) reaches the fused decode too.
  wk_b_t = wk_b.transpose(1, 2).contiguous();
  wv_b_t = wv_b.transpose(1, 2).contiguous();
  wk_b.set_data(wk_b_t.transpose(1, 2));
  wv_b.set_data(wv_b_t.transpose(1, 2));
}

DSAImpl::Heads DSAImpl::project(const Tensor& x, const Positions& pos) {
  if (!latent) {
    auto p = attn->project(x, pos);
    return {p.q.transpose(1, 2), p.k.transpose(1, 2), p.v.transpose(1, 2), p.gate};
  }
  const int64_t B = x.size(0), T = x.size(1), D = head_dim;
  // q, the latent kv and the output gate: one GEMM, x's gradient from one product.
  std::vector<torch::nn::Linear> layers{wq, wkv_a};
  if (wgate) layers.push_back(wgate);
  const auto p = ops::linear_group(x, layers, Tensor());
  auto qf = p[0].view({B, T, n_heads, D + latent_rope_dim});
  auto q_rope = ops::apply_rope(qf.narrow(-1, D, latent_rope_dim), pos, rope_theta, rope_style);
  auto q_latent = torch::einsum("bthd,hdc->bthc", {qf.narrow(-1, 0, D), wk_b});  // [B, T, H, d_c]
  const auto& kv = p[1];                                                                    // [B, T, d_c + d_r]
  auto c = ops::rms_norm(kv.narrow(-1, 0, latent_dim), kv_norm).unsqueeze(2);                  // [B, T, 1, d_c]
  auto k_rope = ops::apply_rope(kv.narrow(-1, latent_dim, latent_rope_dim).unsqueeze(2), pos,
                                rope_theta, rope_style);                        // [B, T, 1, d_r]
  auto k = torch::cat({c, k_rope}, -1).transpose(1, 2);                         // [B, 1, T, d_c + d_r]
  return {torch::cat({q_latent, q_rope}, -1).transpose(1, 2), k, k.narrow(-1, 0, latent_dim),
          wgate ? p[2] : Tensor()};
}

// The gate's pre-activation comes with the projections (one GEMM).
Tensor DSAImpl::output(const Tensor& o, const Tensor& x, const Heads& h) {
  if (!latent) return attn->output(o, x, h.gate);
  auto y = torch::einsum("bthc,hcd->bthd", {o, wv_b}).reshape({x.size(0), x.size(1), n_heads * head_dim});
  if (wgate) y = ops::sigmoid_gate(y, h.gate);
  return ops::linear(y, wo);
}

std::pair<Tensor, Tensor> DSAImpl::indexer_queries(const Tensor& x, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1);
  auto q = ops::linear(x, index_wq).view({B, T, index_heads, index_head_dim});
  q = ops::apply_rope_prefix_(q, index_rope_dim, pos, rope_theta, RopeStyle::Half);  // q: a fresh projection
  auto w = ops::linear(x, index_ww) * index_weight_scale();
  return {q, w};
}

Tensor DSAImpl::indexer_keys(const Tensor& x, const Positions& pos) {
  auto k = index_k_norm(ops::linear(x, index_wk)).unsqueeze(2);  // [B, T, 1, d_I]
  return ops::apply_rope_prefix_(k, index_rope_dim, pos, rope_theta, RopeStyle::Half).squeeze(2);
}

std::vector<Tensor> DSAImpl::indexer_parameters() const {
  std::vector<Tensor> out;
  for (const torch::nn::Module* m : std::initializer_list<const torch::nn::Module*>{
           index_wq.get(), index_wk.get(), index_ww.get(), index_k_norm.get()})
    for (const auto& p : m->parameters()) out.push_back(p);
  return out;
}

Tensor DSAImpl::forward(const Tensor& x, const Positions& pos, MixerState* state) {
  if (state && x.size(1) == 1) return step(x, pos, *state);
  const int64_t T = x.size(1), start = pos.start;
  // A checkpointed loop's backward runs this forward again: its loss was recorded by the first pass.
  const bool record = stage != IndexerStage::Off && !state && recompute_phase() != RecomputePhase::Recompute;
  auto h = project(x, pos);
  Tensor k = h.k, v = h.v;  // [B, H_kv, L, D] keys and values this call attends over
  DSAState* s = state ? &dynamic_cast<DSAState&>(*state) : nullptr;
  if (s) {
    LT2_CHECK(s->length == start, "dsa state holds ", s->length, " tokens but the call starts at ", start);
    LT2_CHECK(start + T <= s->k.size(2), "dsa state overflow: ", start + T, " tokens for ", s->k.size(2));
    s->k.narrow(2, start, T).copy_(h.k);
    if (!latent) s->v.narrow(2, start, T).copy_(h.v);
    k = s->k.narrow(2, 0, start + T).to(h.q.scalar_type());
    v = latent ? k.narrow(-1, 0, latent_dim) : s->v.narrow(2, 0, start + T).to(h.q.scalar_type());
  }
  const int64_t B = x.size(0), L = k.size(2);
  // Every visible key is attended in the dense warm-up, and where no query sees more than topk keys:
  // causal attention then (FlashAttention-2 where it serves), with no index scores for the output;
  // without the loss the index queries are then not needed (the keys still fill the state).
  const bool causal = stage == IndexerStage::DenseWarmup || L <= topk;
  auto x_index = x.detach();  // the indexer learns only from its own loss
  // The indexer's own graph: also in a checkpointed loop's first pass, which runs without a gradient
  // but whose recorded loss must still train the indexer (its input is detached, so the graph holds
  // only the indexer's pieces).
  const bool indexer_grad =
      record && (torch::GradMode::is_enabled() || recompute_phase() == RecomputePhase::CheckpointForward);
  Tensor iq, iw, index_k;  // [B, T, H_I, d_I], [B, T, H_I], [B, L, d_I]; the loss projects its own queries
  {
    torch::AutoGradMode indexer_mode(indexer_grad);
    if (!record && !causal) std::tie(iq, iw) = indexer_queries(x_index, pos);
    index_k = indexer_keys(x_index, pos);
    if (s) {
      s->index_keys.narrow(1, start, T).copy_(index_k);
      s->length = start + T;
      index_k = s->index_keys.narrow(1, 0, s->length);
      if (iq.defined()) index_k = index_k.to(iq.scalar_type());
    }
  }
  const int64_t select_topk = stage == IndexerStage::DenseWarmup ? 0 : topk;
  // The rows are independent, so blocks of them bound the dense tensors to ~query_block_bytes each:
  // the indexer's [n, H_I, L] logits (at 8192 rows of 32k keys and 64 index heads a chunk's are
  // 34 GB), then the masked attention's [H, n, L] scores (its math path: the latent head's 576
  // dims take no fused kernel; 96 GB at 32k in one block). The indexer loss sizes its own blocks
  // within the same budget (ops::indexer_loss_row_bytes).
  // The queries are the last T of the L key positions, so a block of rows [r0, r0 + n) sees only
  // the first L - T + r0 + n keys: it scores and attends over those alone.
  auto seen = [&](int64_t r0, int64_t n) { return L - T + r0 + n; };
  Tensor attend;  // [B, T, L] bool: the keys each query attends to, where not causal
  if (record) {
    torch::AutoGradMode indexer_mode(indexer_grad);
    // The module outlives the step whose backward calls the queries again.
    auto queries = [this, pos](const Tensor& x_rows) { return indexer_queries(x_rows, pos); };
    auto r = indexer_loss_blocked(queries, x_index, index_k, h.q, k, L - T, select_topk, scale(), query_block_bytes);
    indexer_losses.push_back(r.loss);
    attend = r.support;
  } else if (!causal) {
    // Without a gradient: selection and sparse attention over the k selected keys on the decode
    // kernels, blocks of rows bounded by their [n, L] fp32 scores.
    const auto o = indexer_topk_attention(iq, iw, index_k, h.q, k, v, L - T, topk, scale(),
                                          block_rows(B * L * 4, T));
    if (o.defined()) return output(o, x, h);
    std::vector<Tensor> parts;
    const int64_t index_rows = block_rows(index_row_bytes(B, L, indexer_kernels_serve(iq, index_k, topk)), T);
    for (int64_t r0 = 0; r0 < T; r0 += index_rows) {
      const int64_t n = std::min(index_rows, T - r0);
      auto support = indexer_select(iq.narrow(1, r0, n), iw.narrow(1, r0, n), index_k.narrow(1, 0, seen(r0, n)),
                                    L - T + r0, topk).support;
      parts.push_back(torch::constant_pad_nd(support, {0, L - seen(r0, n)}, 0));
    }
    attend = parts.size() == 1 ? parts[0] : torch::cat(parts, 1);
  }
  if (causal) return output(window_attention(h.q, k, v, 0, scale()), x, h);
  std::vector<Tensor> parts;
  // A fused SDPA kernel (the GQA form's head dims on CUDA: cuDNN's or the memory-efficient one) holds
  // no [H, n, L] scores, only the mask: blocks of kFusedAttentionRows, which score every key up to
  // their last row's (1024 / 2L of the square more than the causal triangle) in few launches and
  // few partial gradients of k and v to add. The math path (the latent form's 576-dim heads, the
  // CPU) by the byte budget.
  constexpr int64_t kFusedAttentionRows = 1024;
  const int64_t attention_rows = !latent && h.q.is_cuda()
                                     ? std::min(kFusedAttentionRows, std::max<int64_t>(T, 1))
                                     : block_rows(attention_row_bytes(B, L), T);
  for (int64_t r0 = 0; r0 < T; r0 += attention_rows) {
    const int64_t n = std::min(attention_rows, T - r0);
    const int64_t keys = seen(r0, n);
    parts.push_back(masked_attention(h.q.narrow(2, r0, n), k.narrow(2, 0, keys), v.narrow(2, 0, keys),
                                     attend.narrow(1, r0, n).narrow(2, 0, keys).unsqueeze(1), scale()));
  }
  return output(parts.size() == 1 ? parts[0] : torch::cat(parts, 1), x, h);  // [B, T, H, D_v] -> [B, T, d]
}

int64_t DSAImpl::index_row_bytes(int64_t batch, int64_t keys, bool kernels) const {
  // fp32-sized: the logits and their ReLU (H_I each), the scores, the visibility and top-k masks;
  // where the kernels score, the scores and the boolean masks (the selection, its padding and the
  // visibility: ~4 bytes).
  return batch * std::max<int64_t>(keys, 1) * (kernels ? 2 : 2 * index_heads + 4) * 4;
}

int64_t DSAImpl::attention_row_bytes(int64_t batch, int64_t keys) const {
  // fp32: the scores, their softmax and the additive mask per head.
  return batch * std::max<int64_t>(keys, 1) * n_heads * 3 * 4;
}

int64_t DSAImpl::block_rows(int64_t row_bytes, int64_t rows) const {
  return std::clamp<int64_t>(query_block_bytes / row_bytes, 1, std::max<int64_t>(rows, 1));
}

int64_t DSAImpl::workspace_bytes(int64_t batch, int64_t rows, int64_t keys) const {
  // The larger of the two blocks, and every row's top-k mask (a bool per score).
  auto block = [&](int64_t row_bytes) { return block_rows(row_bytes, rows) * row_bytes; };
  return std::max(block(index_row_bytes(batch, keys, false)), block(attention_row_bytes(batch, keys))) +
         batch * rows * keys;
}

std::optional<DecodeDescriptor> DSAImpl::decode_descriptor(MixerState& state, int64_t batch) {
  auto* s = dynamic_cast<DSAState*>(&state);
  if (!fused_decode_enabled() || !s || !latent || !use_packed(w_in) || stage == IndexerStage::DenseWarmup ||
      topk >= s->k.size(2))
    return std::nullopt;
  const int64_t B = batch, H = n_heads, D = head_dim, dc = latent_dim, dr = latent_rope_dim;
  const auto opts = w_in.options();
  // The tensors latent_decode makes, and its inputs as views of one [B, N] GEMV output.
  const auto q = torch::empty({B, H, dc + dr}, opts), index_q = torch::empty({B, index_heads, index_head_dim}, opts);
  const auto v_cache = s->k.narrow(-1, 0, dc);
  if (!ops::dsa_index_topk_supported(index_q, s->index_keys, topk) ||
      !ops::sparse_attention_decode_supported(q, s->k, v_cache))
    return std::nullopt;
  const auto parts = unpack_outputs(torch::empty({B, w_in.size(0)}, opts), input_projections());
  const auto q_raw = parts[0].view({B, H, D + dr});
  const auto gate = wgate ? parts[5].view({B, H, D}) : Tensor();
  // The absorptions q_latent[b, h] = q_nope[b, h] wk_b[h] and y[b, h] = (o[b, h] wv_b[h]) *
  // sigmoid(gate[b, h]) are folded into the prep and the attention's combine where their kernels
  // take them and B is within DecodeOptions::dsa_fold_q_max_rows / dsa_fold_o_max_rows (1 each:
  // folding saves time at one row and costs it at eight, where the batched GEMVs stream the
  // absorption weights once for every row), else batched GEMVs (the second's x is o [B, H, d_c],
  // shaped like q's latent part).
  const auto& options = decode_options();
  const bool fold_q = B <= options.dsa_fold_q_max_rows && ops::dsa_latent_prep_absorb_supported(q_raw, q, wk_b_t);
  const bool fold_o = B <= options.dsa_fold_o_max_rows &&
                      ops::sparse_attention_absorb_supported(q, s->k, v_cache, wv_b_t, gate);
  if ((!fold_q && !ops::gemv_batched_applies(q_raw.narrow(-1, 0, D), wk_b_t)) ||
      (!fold_o && !ops::gemv_batched_applies(q.narrow(-1, 0, dc), wv_b_t, gate)))
    return std::nullopt;
  DecodeDescriptor d;
  d.input_weight = w_in;
  for (const auto& l : input_projections()) d.part_sizes.push_back(l->weight.size(0));
  d.core = [this, s, fold_q, fold_o](const std::vector<Tensor>& parts, const Positions& pos) {
    return latent_decode(parts, pos, *s, fold_q, fold_o);
  };
  d.output = wo;
  return d;
}

Tensor DSAImpl::latent_decode(const std::vector<Tensor>& parts, const Positions& pos, DSAState& s, bool fold_q,
                              bool fold_o) {
  const int64_t B = parts[0].size(0), H = n_heads, D = head_dim, dc = latent_dim, dr = latent_rope_dim;
  const auto opts = parts[0].options();
  ops::DsaLatentPrepArgs a;
  a.q = torch::empty({B, H, dc + dr}, opts);  // per head [q_nope W_uk | RoPE(q_rope)]
  a.index_q = torch::empty({B, index_heads, index_head_dim}, opts);
  a.k_cache = s.k, a.index_keys = s.index_keys;
  const auto v_cache = s.k.narrow(-1, 0, dc);  // the values are the keys' latent part
  a.q_raw = parts[0].view({B, H, D + dr});
  a.kv_raw = parts[1];
  a.index_q_raw = parts[2].view({B, index_heads, index_head_dim});
  a.index_k_raw = parts[3], a.index_w_raw = parts[4];
  a.seq_pos = pos.seq_pos;
  a.kv_norm_weight = kv_norm->weight, a.kv_norm_eps = kv_norm->eps;
  a.index_norm_weight = index_k_norm->weight, a.index_norm_bias = index_k_norm->bias;
  a.index_norm_eps = index_k_norm->options.eps();
  a.rope_theta = rope_theta, a.rope_style = rope_style, a.index_rope_dim = index_rope_dim;
  a.index_weight_scale = index_weight_scale(), a.topk = topk;
  a.index_w = torch::empty({B, index_heads}, opts.dtype(torch::kFloat32));
  a.seq_lens = torch::empty({B}, pos.seq_pos.options()), a.counts = torch::empty({B}, pos.seq_pos.options());
  const auto q_nope = a.q_raw.narrow(-1, 0, D);                   // [B, H, D]
  const auto gate = wgate ? parts[5].view({B, H, D}) : Tensor();  // [B, H, D]
  if (fold_q) a.absorb = wk_b_t;
  ops::dsa_latent_prep(a);
  if (!fold_q) ops::gemv_batched(q_nope, wk_b_t, a.q.narrow(-1, 0, dc));
  auto idx = ops::dsa_index_topk(a.index_q, a.index_w, s.index_keys, a.seq_lens, topk);  // [B, k]
  Tensor y;                                                                               // [B, H, D]
  if (fold_o) {
    y = ops::sparse_attention_decode_fused(a.q, s.k, v_cache, idx, a.counts, scale(), wv_b_t, gate);
  } else {
    auto o = ops::sparse_attention_decode_fused(a.q, s.k, v_cache, idx, a.counts, scale());  // [B, H, d_c]
    y = torch::empty({B, H, D}, opts);
    ops::gemv_batched(o, wv_b_t, y, gate);
  }
  return y.view({B, H * D});
}

Tensor DSAImpl::step_at(const Tensor& x, const Positions& pos, DSAState& s) {
  const int64_t B = x.size(0), L = s.k.size(2);
  if (auto fused = decode_descriptor(s, B); fused && ops::gemv_fused_applies(x.reshape({B, -1}), w_in)) {
    const auto parts = unpack_outputs(ops::gemv_fused(x.reshape({B, -1}), w_in), input_projections());
    return ops::linear(fused->core(parts, pos), wo).view({B, 1, -1});
  }
  auto h = project(x, pos);  // q [B, H, 1, D_qk], k, v [B, H_kv, 1, D_qk | D_v]
  cache_write_at(s.k, h.k, pos.seq_pos);
  if (!latent) cache_write_at(s.v, h.v, pos.seq_pos);
  const auto& lens = pos.seq_lens;  // [B] tokens each sequence now holds
  Tensor k = s.k, v = s.v, k_lens = lens;
  Tensor iq, iw;  // the indexer's queries and weights: selection only, no gradient
  {
    torch::NoGradGuard no_grad;
    auto x_index = x.detach();
    std::tie(iq, iw) = indexer_queries(x_index, pos);
    auto index_k = indexer_keys(x_index, pos);  // [B, 1, d_I]
    cache_write_at(s.index_keys.unsqueeze(1), index_k.unsqueeze(1), pos.seq_pos);
  }
  if (stage != IndexerStage::DenseWarmup && topk < L) {
    // On the kernels where they apply: index scores over the whole cache (slots past a sequence's
    // length skipped), the top-k slots, attention over them where they lie in the cache. Outside
    // the no-grad block, since the kernels carry no gradient and so run only where none is recorded.
    const auto v_cache = latent ? s.k.narrow(-1, 0, latent_dim) : s.v;  // latent: values = keys' first d_c
    const auto o = ops::dsa_topk_attention_fused(iq.squeeze(1), iw.squeeze(1), s.index_keys, lens, topk,
                                                 h.q.squeeze(2), s.k, v_cache, scale());  // [B, H, D_v]
    if (o.defined()) return output(o.unsqueeze(1), x, h);
    {
      torch::NoGradGuard no_grad;  // selection only
      auto scores = lightning_indexer_scores(iq, iw, s.index_keys.to(iq.scalar_type()));  // [B, 1, L]
      auto valid = (arange_long(0, L, x.device()).unsqueeze(0) < lens.unsqueeze(1)).unsqueeze(1);
      // Visible slots come first in the selection, so the first min(len, k) selected are valid.
      auto idx = topk_indices(scores, valid, topk).squeeze(1);  // [B, k]
      auto gather = [&](const Tensor& cache) {  // [B, H_kv, L, D] -> [B, H_kv, k, D]
        return cache.gather(2, idx.view({B, 1, topk, 1}).expand({B, cache.size(1), topk, cache.size(3)}));
      };
      k = gather(k);
      if (!latent) v = gather(v);
      k_lens = lens.clamp_max(topk);
    }
  }
  if (latent) v = k.narrow(-1, 0, latent_dim);  // the values are the latent part of the keys
  return output(ops::attention_decode(h.q.squeeze(2), k, v, k_lens, scale()).unsqueeze(1), x, h);
}

Tensor DSAImpl::step(const Tensor& x, const Positions& pos, MixerState& state) {
  auto& s = dynamic_cast<DSAState&>(state);
  if (pos.seq_pos.defined()) return step_at(x, pos, s);
  const int64_t start = pos.start, B = x.size(0);
  LT2_CHECK(s.length == start, "dsa state holds ", s.length, " tokens but the call starts at ", start);
  LT2_CHECK(start < s.k.size(2), "dsa state overflow: ", start + 1, " tokens for ", s.k.size(2));
  auto h = project(x, pos);
  s.k.narrow(2, start, 1).copy_(h.k);
  if (!latent) s.v.narrow(2, start, 1).copy_(h.v);
  const int64_t L = start + 1;
  Tensor k = s.k.narrow(2, 0, L), v = latent ? Tensor() : s.v.narrow(2, 0, L);
  {
    torch::NoGradGuard no_grad;  // selection only
    auto x_index = x.detach();
    auto [iq, iw] = indexer_queries(x_index, pos);
    s.index_keys.narrow(1, start, 1).copy_(indexer_keys(x_index, pos));
    s.length = L;
    if (stage != IndexerStage::DenseWarmup && topk < L) {
      // Read only the top-k cached tokens (every cached token is visible to the new one).
      auto scores = lightning_indexer_scores(iq, iw, s.index_keys.narrow(1, 0, L).to(iq.scalar_type()));
      auto idx = topk_indices(scores, torch::ones_like(scores, torch::kBool), topk).squeeze(1);  // [B, k]
      auto gather = [&](const Tensor& cache) {  // [B, H_kv, L, D] -> [B, H_kv, k, D]
        return cache.gather(2, idx.view({B, 1, topk, 1}).expand({B, cache.size(1), topk, cache.size(3)}));
      };
      k = gather(k);
      if (!latent) v = gather(v);
    }
  }
  k = k.to(h.q.scalar_type());
  v = latent ? k.narrow(-1, 0, latent_dim) : v.to(h.q.scalar_type());
  auto all = torch::ones({1, k.size(2)}, torch::TensorOptions().dtype(torch::kBool).device(x.device()));
  return output(masked_attention(h.q, k, v, all, scale()), x, h);
}

std::unique_ptr<MixerState> DSAImpl::make_state(int64_t batch, int64_t max_len,
                                                torch::TensorOptions opts, const LoopSettings& loop) const {
  auto s = std::make_unique<DSAState>();
  if (latent) {
    s->k = torch::zeros({batch, 1, max_len, latent_dim + latent_rope_dim}, opts);
  } else {
    s->k = torch::zeros({batch, n_kv_heads, max_len, head_dim}, opts);
    s->v = torch::zeros({batch, n_kv_heads, max_len, head_dim}, opts);
  }
  s->index_keys = torch::zeros({batch, max_len, index_head_dim}, opts);
  s->topk = topk;
  return s;
}

void DSAImpl::IndexerAuxLoss::set_stage(AuxLossStage s) {
  self->stage = s == AuxLossStage::Warmup ? IndexerStage::DenseWarmup
                : s == AuxLossStage::Joint ? IndexerStage::Sparse
                                           : IndexerStage::Off;
}

std::vector<Tensor> DSAImpl::IndexerAuxLoss::take() {
  auto out = std::move(self->indexer_losses);
  self->indexer_losses.clear();
  return out;
}

std::vector<Tensor> DSAImpl::IndexerAuxLoss::parameters() const { return self->indexer_parameters(); }

void set_indexer_stage(torch::nn::Module& model, IndexerStage stage) {
  if (auto* d = dynamic_cast<DSAImpl*>(&model)) d->stage = stage;
  for (auto& m : model.modules(/*include_self=*/false))
    if (auto* d = dynamic_cast<DSAImpl*>(m.get())) d->stage = stage;
}

std::vector<Tensor> take_indexer_losses(torch::nn::Module& model) {
  std::vector<Tensor> out;
  auto take = [&out](DSAImpl* d) {
    for (auto& l : d->indexer_losses) out.push_back(l);
    d->indexer_losses.clear();
  };
  if (auto* d = dynamic_cast<DSAImpl*>(&model)) take(d);
  for (auto& m : model.modules(/*include_self=*/false))
    if (auto* d = dynamic_cast<DSAImpl*>(m.get())) take(d);
  return out;
}

MixerInfo dsa_info() {
  return {"dsa",
          "DeepSeek sparse attention: lightning indexer + top-k softmax attention (GQA or one "
          "shared latent KV head); KV cache + indexer-key cache",
          [](const ModelConfig& cfg, int64_t) -> Mixer {
            return std::make_shared<DSAImpl>(cfg, cfg.options_for("dsa"));
          }};
}

}  // namespace lt2
