#include "lt2/mixers/nsa.h"

#include <algorithm>
#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/mixers/full_attention.h"
#include "lt2/ops/attention/rope.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"

namespace lt2 {

int64_t NSAState::bytes() const {
  int64_t n = k_cmp.nbytes() + v_cmp.nbytes();
  for (size_t i = 0; i < k.size(); ++i) n += k[i].nbytes() + v[i].nbytes();
  return n;
}

std::unique_ptr<MixerState> NSAState::slice(int64_t begin, int64_t count) const {
  auto s = std::make_unique<NSAState>();
  for (size_t i = 0; i < k.size(); ++i) {
    s->k.push_back(k[i].narrow(0, begin, count));
    s->v.push_back(v[i].narrow(0, begin, count));
  }
  s->k_cmp = k_cmp.narrow(0, begin, count);
  s->v_cmp = v_cmp.narrow(0, begin, count);
  s->branch_rows = branch_rows;
  return s;
}

int64_t NSAState::decode_bytes(int64_t length) const {
  int64_t n = k_cmp.nbytes() + v_cmp.nbytes();
  const int64_t L = k[0].size(2), held = std::min(length + 1, L);
  for (size_t set = 0; set < k.size(); ++set) {
    // One shared set serves the three branches; separate sets one branch each.
    int64_t rows = 0;
    for (size_t b = 0; b < branch_rows.size(); ++b)
      if (k.size() == 1 || b == set) rows += std::min(branch_rows[b], held);
    n += (k[set].nbytes() + v[set].nbytes()) / L * std::min(rows, held);
  }
  return n;
}

std::vector<Tensor> NSAState::tensors() const {
  std::vector<Tensor> out{k_cmp, v_cmp};
  out.insert(out.end(), k.begin(), k.end());
  out.insert(out.end(), v.begin(), v.end());
  return out;
}

std::vector<int64_t> NSAState::token_axes() const {
  std::vector<int64_t> out{-1, -1};  // compressed blocks: whole
  out.insert(out.end(), k.size() + v.size(), 2);
  return out;
}

NSAImpl::NSAImpl(const ModelConfig& cfg, const json& o)
    : n_heads(cfg.n_heads),
      n_kv_heads(cfg.kv_heads()),
      head_dim(cfg.dim_head()),
      rope_theta(cfg.rope_theta),
      rope_style(cfg.rope_style) {
  caps_.seq_pos = true;
  const std::string where = "mixer.nsa";
  json_reject_unknown(o, {"form", "compress_block", "compress_stride", "select_block", "select_count",
                          "local_blocks", "window", "compression", "compress_hidden", "shared_kv"},
                      where);
  std::string form = "simplified";
  json_get(o, "form", form, where);
  LT2_CHECK(form == "simplified" || form == "paper", where, ": 'form' must be 'simplified' or 'paper', found '",
            form, "'");
  const bool paper = form == "paper";
  compress_block = paper ? 32 : 64;
  compress_stride = paper ? 16 : 64;
  select_block = 64;
  select_count = 16;
  local_blocks = 2;
  window = 512;
  std::string compression = paper ? "mlp" : "mean";
  shared_kv = !paper;
  compress_hidden = 4 * head_dim;
  json_get(o, "compress_block", compress_block, where);
  json_get(o, "compress_stride", compress_stride, where);
  json_get(o, "select_block", select_block, where);
  json_get(o, "select_count", select_count, where);
  json_get(o, "local_blocks", local_blocks, where);
  json_get(o, "window", window, where);
  json_get(o, "compression", compression, where);
  json_get(o, "compress_hidden", compress_hidden, where);
  json_get(o, "shared_kv", shared_kv, where);
  LT2_CHECK(compression == "mean" || compression == "mlp", where,
            ": 'compression' must be 'mean' or 'mlp', found '", compression, "'");
  mlp_compression = compression == "mlp";
  LT2_CHECK(compress_stride > 0 && compress_block >= compress_stride && select_block > 0, where,
            ": need 0 < compress_stride <= compress_block and select_block > 0");
  LT2_CHECK(compress_block % compress_stride == 0 && select_block % compress_stride == 0, where,
            ": compress_stride (", compress_stride, ") must divide compress_block (", compress_block,
            ") and select_block (", select_block, ")");
  LT2_CHECK(local_blocks >= 0 && select_count >= local_blocks + 1, where,
            ": select_count must cover block 0 and the local blocks (select_count >= local_blocks + 1)");
  LT2_CHECK(window > 0 && compress_hidden > 0, where, ": window and compress_hidden must be > 0");

  const int64_t d = cfg.d_model, H = n_heads, D = head_dim;
  const double std = cfg.init_scale();
  wq = register_module("wq", make_linear(d, H * D, std));
  const int n_sets = shared_kv ? 1 : 3;
  const char* set_names[] = {"cmp", "slc", "win"};
  for (int i = 0; i < n_sets; ++i) {
    const std::string suffix = shared_kv ? "" : std::string("_") + set_names[i];
    wk.push_back(register_module("wk" + suffix, make_linear(d, n_kv_heads * D, std)));
    wv.push_back(register_module("wv" + suffix, make_linear(d, n_kv_heads * D, std)));
  }
  if (mlp_compression) {
    const int64_t l = compress_block;
    pos_k = register_parameter("pos_k", torch::zeros({l, D}));
    pos_v = register_parameter("pos_v", torch::zeros({l, D}));
    auto mlp = [&] {
      return torch::nn::Sequential(make_linear(l * D, compress_hidden, 1.0 / std::sqrt(double(l * D))),
                                   torch::nn::ReLU(),
                                   make_linear(compress_hidden, D, 1.0 / std::sqrt(double(compress_hidden))));
    };
    mlp_k = register_module("mlp_k", mlp());
    mlp_v = register_module("mlp_v", mlp());
  }
  wg = register_module("wg", make_linear(d, 3 * H, 0.0, /*bias=*/true));
  {
    torch::NoGradGuard ng;
    wg->bias.view({H, 3}).copy_(torch::tensor({-2.0, -2.0, 2.0}));
  }
  wo = register_module("wo", make_linear(H * D, d, 1.0 / std::sqrt(static_cast<double>(H * D))));
}

NSAImpl::Projected NSAImpl::project(const Tensor& x, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1), sets = static_cast<int64_t>(wk.size());
  std::vector<torch::nn::Linear> layers{wq};  // wq, the keys', the values', wg
  layers.insert(layers.end(), wk.begin(), wk.end());
  layers.insert(layers.end(), wv.begin(), wv.end());
  layers.push_back(wg);
  const auto p = ops::linear_group(x, layers, Tensor());
  auto rotated = [&](const Tensor& t, int64_t heads) {
    return ops::apply_rope(t.view({B, T, heads, head_dim}), pos, rope_theta, rope_style);
  };
  Projected out;
  out.q = rotated(p[0], n_heads);
  for (int64_t set = 0; set < sets; ++set) {
    out.k.push_back(rotated(p[1 + set], n_kv_heads));
    out.v.push_back(p[1 + sets + set].view({B, T, n_kv_heads, head_dim}));
  }
  out.gate_logits = p.back().view({B, T, n_heads, 3});
  return out;
}

std::pair<Tensor, Tensor> NSAImpl::compress(const Tensor& k, const Tensor& v) {
  auto kb = nsa_unfold_blocks(k, compress_block, compress_stride);  // [B, NC, H_kv, l, D]
  auto vb = nsa_unfold_blocks(v, compress_block, compress_stride);
  if (!mlp_compression) return {kb.mean(3), vb.mean(3)};
  return {mlp_k->forward((kb + pos_k.to(kb.scalar_type())).flatten(-2)),
          mlp_v->forward((vb + pos_v.to(vb.scalar_type())).flatten(-2))};
}

Tensor NSAImpl::compressed_visible(const Tensor& q_pos, int64_t NC) const {
  return torch::arange(NC, q_pos.options()) * compress_stride + (compress_block - 1) <= q_pos.unsqueeze(-1);
}

Tensor NSAImpl::block_importance(const Tensor& p_cmp, int64_t NS) const {
  const int64_t B = p_cmp.size(0), T = p_cmp.size(2), NC = p_cmp.size(3);
  auto p_group = p_cmp.view({B, n_kv_heads, n_heads / n_kv_heads, T, NC}).sum(2);  // [B, H_kv, T, NC]
  return torch::matmul(p_group, nsa_overlap_matrix(NC, NS, compress_block, compress_stride, select_block,
                                                   p_group.options()));
}

Tensor NSAImpl::combine(const Tensor& gate_logits, const Tensor& o_cmp, const Tensor& o_slc, const Tensor& o_win) {
  static_assert(kCmp == 0 && kSlc == 1 && kWin == 2, "the branches in the gates' order");
  const auto o = ops::sigmoid_gated_sum(gate_logits, {o_cmp, o_slc, o_win});
  return wo(o.reshape({gate_logits.size(0), gate_logits.size(1), n_heads * head_dim}));
}

Tensor NSAImpl::forward(const Tensor& x, const Positions& pos, MixerState* state) {
  const int64_t T = x.size(1), start = pos.start, L = start + T;
  LT2_CHECK(!pos.seq_pos.defined(), "nsa: per-sequence positions are a decode step (step with a state)");
  LT2_CHECK(state || start == 0, "nsa: a call at position ", start,
            " needs the state holding the tokens before it");
  const auto proj = project(x, pos);
  auto q = proj.q.transpose(1, 2);  // [B, H, T, D]
  auto* s = state ? &dynamic_cast<NSAState&>(*state) : nullptr;
  if (s) {
    LT2_CHECK(s->length == start, "nsa state holds ", s->length, " tokens but the call starts at ", start);
    LT2_CHECK(L <= s->k[0].size(2), "nsa state overflow: ", L, " tokens for ", s->k[0].size(2));
  }
  // Keys and values of every position 0..L-1, per K/V set: [B, H_kv, L, D].
  std::vector<Tensor> ks, vs;
  for (size_t set = 0; set < wk.size(); ++set) {
    const auto &k = proj.k[set], &v = proj.v[set];
    if (s) {
      s->k[set].narrow(2, start, T).copy_(k.transpose(1, 2));
      s->v[set].narrow(2, start, T).copy_(v.transpose(1, 2));
      ks.push_back(s->k[set].narrow(2, 0, L).to(q.scalar_type()));
      vs.push_back(s->v[set].narrow(2, 0, L).to(q.scalar_type()));
    } else {
      ks.push_back(k.transpose(1, 2));
      vs.push_back(v.transpose(1, 2));
    }
  }
  // Compressed blocks complete within the first L tokens: [B, H_kv, NC, D].
  const int64_t l = compress_block, d = compress_stride, NC = nsa_num_blocks(L, l, d);
  const int64_t cs = kv_set(kCmp);
  Tensor kc, vc;
  if (s) {
    const int64_t first = nsa_num_blocks(start, l, d);  // blocks the state already holds
    if (NC > first) {  // compress the blocks completed by this call
      const int64_t from = first * d, len = (NC - 1) * d + l - from;
      auto [kn, vn] = compress(ks[cs].narrow(2, from, len).transpose(1, 2), vs[cs].narrow(2, from, len).transpose(1, 2));
      s->k_cmp.narrow(2, first, NC - first).copy_(kn.transpose(1, 2));
      s->v_cmp.narrow(2, first, NC - first).copy_(vn.transpose(1, 2));
    }
    s->length = L;
    kc = s->k_cmp.narrow(2, 0, NC).to(q.scalar_type());
    vc = s->v_cmp.narrow(2, 0, NC).to(q.scalar_type());
  } else {
    auto [kn, vn] = compress(ks[cs].transpose(1, 2), vs[cs].transpose(1, 2));
    kc = kn.transpose(1, 2);
    vc = vn.transpose(1, 2);
  }
  auto lopts = torch::TensorOptions().dtype(torch::kLong).device(x.device());
  auto q_pos = torch::arange(start, L, lopts);

  // Compression branch: block i is visible once complete.
  auto [o_cmp, p_cmp] = masked_attention_probs(q, kc, vc, compressed_visible(q_pos, NC));  // [B, T, H, D], [B, H, T, NC]

  // Selection branch: importance summed over the query heads of each group, top-n blocks.
  const int64_t NS = (L + select_block - 1) / select_block;
  Tensor blocks;  // [B, H_kv, T, NS] selected blocks
  {
    torch::NoGradGuard no_grad;
    blocks = nsa_select_blocks(block_importance(p_cmp, NS), q_pos, select_block, select_count, local_blocks);
  }
  auto o_slc = selected_block_attention(q, ks[kv_set(kSlc)], vs[kv_set(kSlc)], blocks, select_block);

  // Sliding-window branch (the queries are the last T of the L keys' positions).
  auto o_win = window_attention(q, ks[kv_set(kWin)], vs[kv_set(kWin)], window);
  return combine(proj.gate_logits, o_cmp, o_slc, o_win);
}

Tensor NSAImpl::step(const Tensor& x, const Positions& pos, MixerState& state) {
  auto& s = dynamic_cast<NSAState&>(state);
  if (pos.seq_pos.defined()) return step_at(x, pos, s);
  return forward(x, pos, &s);
}

Tensor NSAImpl::step_at(const Tensor& x, const Positions& pos, NSAState& s) {
  const int64_t B = x.size(0), H = n_heads, H_kv = n_kv_heads, G = H / H_kv, D = head_dim;
  const int64_t L = s.k[0].size(2), NC = s.k_cmp.size(2), l = compress_block, d = compress_stride;
  const auto& p = pos.seq_pos;  // [B]
  LT2_CHECK(x.size(1) == 1 && p.numel() == B, "nsa: a decode step with per-sequence positions takes x [B, 1, d] "
            "and seq_pos [B]; found x ", x.sizes(), ", seq_pos ", p.sizes());
  const auto proj = project(x, pos);
  const auto& q = proj.q;  // [B, 1, H, D]
  for (size_t set = 0; set < wk.size(); ++set) {  // keys and values [B, 1, H_kv, D]
    cache_write_at(s.k[set], proj.k[set].transpose(1, 2), p);
    cache_write_at(s.v[set], proj.v[set].transpose(1, 2), p);
  }
  const auto lopts = p.options();
  // Compression: the block ending at p_b completes when p_b + 1 >= l and (p_b + 1 - l) % d == 0.
  // Every sequence compresses its last l tokens (fixed shapes); only a completed block is written.
  if (NC > 0) {
    const int64_t cs = kv_set(kCmp);
    auto from = (p + 1 - l).clamp_min(0);  // [B] first token of the block ending at p_b
    auto rows = (from.unsqueeze(1) + torch::arange(l, lopts)).view({B, 1, l, 1}).expand({B, H_kv, l, D});
    auto [kn, vn] = compress(s.k[cs].gather(2, rows).to(q.scalar_type()).transpose(1, 2),
                             s.v[cs].gather(2, rows).to(q.scalar_type()).transpose(1, 2));  // [B, 1, H_kv, D]
    auto done = ((p + 1 >= l) & ((p + 1 - l).remainder(d) == 0)).view({B, 1, 1, 1});
    auto block = torch::div(from, d, "floor");  // [B] its index (<= NC - 1: p_b < L)
    auto slot = block.view({B, 1, 1, 1}).expand({B, H_kv, 1, D});
    for (auto [cache, c] : {std::pair{s.k_cmp, kn}, std::pair{s.v_cmp, vn}})
      cache_write_at(cache, torch::where(done, c.transpose(1, 2).to(cache.scalar_type()), cache.gather(2, slot)), block);
  }
  auto q_pos = p.view({B, 1, 1});  // one query per sequence, broadcast like forward's [T]

  // Compression branch over every compressed row, those not complete by p_b masked.
  auto [o_cmp, p_cmp] = masked_attention_probs(q.transpose(1, 2), s.k_cmp.to(q.scalar_type()),
                                               s.v_cmp.to(q.scalar_type()), compressed_visible(q_pos, NC));  // [B, 1, H, D], [B, H, 1, NC]
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  // Selection branch. Selected blocks in ascending order: the visible ones first (the own block,
  // the only one partly past p_b, last among them), so each kv head's tokens <= p_b are a prefix
  // of its token list. Each (sequence, kv head) is one row of the attention: per-head index sets.
  const int64_t ls = select_block, NS = (L + ls - 1) / ls;
  Tensor blocks;  // [B, H_kv, n]
  {
    torch::NoGradGuard no_grad;
    auto picked = nsa_select_block_indices(block_importance(p_cmp, NS), q_pos, ls, select_count, local_blocks);
    blocks = std::get<0>(picked.squeeze(2).sort(-1));
  }
  const int64_t n = blocks.size(-1), ss = kv_set(kSlc);
  auto first = blocks * ls;                                                                         // [B, H_kv, n]
  auto tokens = (first.unsqueeze(-1) + torch::arange(ls, lopts)).view({B * H_kv, n * ls});          // [B H_kv, n l']
  auto counts = (q_pos + 1 - first).clamp(0, ls).sum(-1).view({B * H_kv});                          // [B H_kv]
  auto per_head = [&](const Tensor& cache) { return cache.view({B * H_kv, 1, L, cache.size(3)}); };  // a free view
  auto o_slc = ops::sparse_attention_decode(q.reshape({B * H_kv, G, D}), per_head(s.k[ss]), per_head(s.v[ss]),
                                           tokens, counts, scale)
                   .view({B, 1, H, D});

  // Sliding-window branch: the rows (p_b - w, p_b], clamped at 0, shared by the kv heads. A range
  // of the cache, not a prefix: the sparse kernel reads it in place (flash-decoding's
  // attention_decode would need a gathered copy of the window).
  const int64_t w = std::min(window, L), ws = kv_set(kWin);
  auto win_rows = (p + 1 - w).clamp_min(0).unsqueeze(1) + torch::arange(w, lopts);  // [B, w]
  auto o_win = ops::sparse_attention_decode(q.reshape({B, H, D}), s.k[ws], s.v[ws], win_rows,
                                           (p + 1).clamp_max(w), scale)
                   .view({B, 1, H, D});
  return combine(proj.gate_logits, o_cmp, o_slc, o_win);
}

std::unique_ptr<MixerState> NSAImpl::make_state(int64_t batch, int64_t max_len,
                                                torch::TensorOptions opts, const LoopSettings& loop) const {
  auto s = std::make_unique<NSAState>();
  for (size_t set = 0; set < wk.size(); ++set) {
    s->k.push_back(torch::zeros({batch, n_kv_heads, max_len, head_dim}, opts));
    s->v.push_back(torch::zeros({batch, n_kv_heads, max_len, head_dim}, opts));
  }
  const int64_t max_blocks = nsa_num_blocks(max_len, compress_block, compress_stride);
  s->k_cmp = torch::zeros({batch, n_kv_heads, max_blocks, head_dim}, opts);
  s->v_cmp = torch::zeros({batch, n_kv_heads, max_blocks, head_dim}, opts);
  s->branch_rows = {max_blocks > 0 ? compress_block : 0, select_count * select_block, window};
  return s;
}

MixerInfo nsa_info() {
  return {"nsa",
          "native sparse attention: gated compression, top-n block selection and sliding-window "
          "branches (paper or simplified form); KV cache + compressed KV",
          [](const ModelConfig& cfg, int64_t) -> Mixer {
            return std::make_shared<NSAImpl>(cfg, cfg.options_for("nsa"));
          }};
}

}  // namespace lt2
