#include "lt2/mixers/full_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/ops/attention/decode.h"
#include "lt2/ops/attention/rope.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

int64_t KVCache::bytes() const { return k.nbytes() + v.nbytes(); }

std::unique_ptr<MixerState> KVCache::slice(int64_t begin, int64_t count) const {
  auto s = std::make_unique<KVCache>();
  s->k = k.narrow(0, begin, count);
  s->v = v.narrow(0, begin, count);
  return s;
}

int64_t KVCache::decode_bytes(int64_t length) const {
  // Every cached key and value of every sequence, plus the new token's.
  return (k.nbytes() + v.nbytes()) / capacity() * std::min(length + 1, capacity());
}

void cache_write_at(const Tensor& cache, const Tensor& rows, const Tensor& seq_pos) {
  const int64_t B = cache.size(0), H = cache.size(1), D = cache.size(3);
  cache.scatter_(2, seq_pos.view({B, 1, 1, 1}).expand({B, H, 1, D}), rows.to(cache.scalar_type()));
}

std::pair<Tensor, Tensor> kv_cache_append(KVCache& cache, const Tensor& k_new, const Tensor& v_new) {
  const int64_t T = k_new.size(1), end = cache.length + T;
  LT2_CHECK(end <= cache.capacity(), "KV cache overflow: ", end, " tokens for a cache of ",
            cache.capacity(), " (raise max_len when making the state)");
  cache.k.narrow(2, cache.length, T).copy_(k_new.transpose(1, 2));
  cache.v.narrow(2, cache.length, T).copy_(v_new.transpose(1, 2));
  cache.length = end;
  return {cache.k.narrow(2, 0, end), cache.v.narrow(2, 0, end)};
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t past) {
  const int64_t T = q.size(2), L = k.size(2);
  const bool gqa = q.size(1) != k.size(1);
  Tensor o;
  if (past == 0) {
    o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, {}, gqa);
  } else if (T == 1) {  // one new token sees every cached key
    o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, {}, gqa);
  } else {  // query i (absolute past + i) sees keys j <= past + i
    auto qi = torch::arange(past, past + T, torch::TensorOptions().device(q.device()).dtype(torch::kLong));
    auto kj = torch::arange(L, torch::TensorOptions().device(q.device()).dtype(torch::kLong));
    auto mask = kj.unsqueeze(0) <= qi.unsqueeze(1);  // [T, L] bool, true = attend
    o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, {}, gqa);
  }
  return o.transpose(1, 2);  // [B, T, H, D]
}

FullAttentionImpl::FullAttentionImpl(const ModelConfig& cfg)
    : n_heads(cfg.n_heads),
      n_kv_heads(cfg.kv_heads()),
      head_dim(cfg.dim_head()),
      rope_theta(cfg.rope_theta),
      rope_style(cfg.rope_style) {
  caps_.attention_like = true;
  caps_.seq_pos = true;
  const int64_t d = cfg.d_model;
  const double std = cfg.init_scale();
  wq = register_module("wq", make_linear(d, n_heads * head_dim, std));
  wk = register_module("wk", make_linear(d, n_kv_heads * head_dim, std));
  wv = register_module("wv", make_linear(d, n_kv_heads * head_dim, std));
  wo = register_module("wo", make_linear(n_heads * head_dim, d,
                                         1.0 / std::sqrt(static_cast<double>(n_heads * head_dim))));
  if (cfg.attn_output_gate) wgate = register_module("wgate", make_linear(d, n_heads * head_dim, 0.0));
}

std::vector<Tensor> FullAttentionImpl::projections(const Tensor& x) {
  return ops::linear_group(x, packed_layers(), w_in);
}

FullAttentionImpl::Projections FullAttentionImpl::rotate(const std::vector<Tensor>& p, const Positions& pos) const {
  const int64_t B = p[0].size(0), T = p[0].size(1);
  return {ops::apply_rope(p[0].reshape({B, T, n_heads, head_dim}), pos, rope_theta, rope_style),
          ops::apply_rope(p[1].reshape({B, T, n_kv_heads, head_dim}), pos, rope_theta, rope_style),
          p[2].reshape({B, T, n_kv_heads, head_dim}), p.size() > 3 ? p[3] : Tensor()};
}

FullAttentionImpl::Projections FullAttentionImpl::project(const Tensor& x, const Positions& pos) {
  return rotate(projections(x), pos);
}

std::vector<torch::nn::Linear> FullAttentionImpl::packed_layers() const {
  std::vector<torch::nn::Linear> layers{wq, wk, wv};
  if (wgate) layers.push_back(wgate);
  return layers;
}

void FullAttentionImpl::pack_for_inference() {
  if (!w_in.defined()) w_in = pack_linears(packed_layers());
}

Tensor FullAttentionImpl::output(const Tensor& o, const Tensor& x, const Tensor& gate) {
  auto y = o.reshape({o.size(0), o.size(1), n_heads * head_dim});
  if (wgate) y = ops::sigmoid_gate(y, gate.defined() ? gate : wgate(x));
  return ops::linear(y, wo);
}

Tensor FullAttentionImpl::forward(const Tensor& x, const Positions& pos, MixerState* state) {
  return attend(projections(x), x, pos, state);
}

std::optional<DecodeDescriptor> FullAttentionImpl::decode_descriptor(MixerState& state, int64_t batch) {
  auto* cache = dynamic_cast<KVCache*>(&state);
  if (!cache || !use_packed(w_in)) return std::nullopt;
  // The decode token's projections as the plan makes them: views of one [B, N] GEMV output.
  const auto raw = unpack_outputs(torch::empty({batch, w_in.size(0)}, w_in.options()), packed_layers());
  const auto seq_pos = torch::empty({batch}, w_in.options().dtype(torch::kLong));
  if (!ops::rope_cache_attention_applies(raw[0].view({batch, n_heads, head_dim}),
                                         raw[1].view({batch, n_kv_heads, head_dim}),
                                         raw[2].view({batch, n_kv_heads, head_dim}), cache->k, cache->v, seq_pos))
    return std::nullopt;
  DecodeDescriptor d;
  d.input_weight = w_in;
  for (const auto& l : packed_layers()) d.part_sizes.push_back(l->weight.size(0));
  d.core = [this, cache](const std::vector<Tensor>& parts, const Positions& pos) {
    return fused_decode(parts, pos, *cache);
  };
  d.output = wo;
  if (wgate) d.gate_part = 3;  // the output gate folds into wo's GEMV
  return d;
}

Tensor FullAttentionImpl::attend(const std::vector<Tensor>& raw, const Tensor& x, const Positions& pos,
                                 MixerState* state) {
  auto* cache = dynamic_cast<KVCache*>(state);
  if (pos.seq_pos.defined() && cache && raw[0].size(1) == 1) {
    const int64_t B = raw[0].size(0);
    if (auto o = fused_decode(raw, pos, *cache); o.defined())
      return ops::gated_linear_residual(o, wo, wgate ? raw[3].view({B, -1}) : Tensor(), {}).view({B, 1, -1});
  }
  auto [q, k, v, gate] = rotate(raw, pos);
  Tensor o;  // [B, T, H, D]
  if (pos.seq_pos.defined()) {
    LT2_CHECK(cache && q.size(1) == 1, "attention with per-sequence positions takes one token [B, 1, d] and a KV cache");
    cache_write_at(cache->k, k.transpose(1, 2), pos.seq_pos);
    cache_write_at(cache->v, v.transpose(1, 2), pos.seq_pos);
    o = ops::attention_decode(q.squeeze(1), cache->k, cache->v, pos.seq_lens,
                              1.0 / std::sqrt(static_cast<double>(head_dim)))
            .unsqueeze(1);
  } else if (state) {
    LT2_CHECK(cache, "full attention takes a KV cache");
    LT2_CHECK(cache->length == pos.start, "attention state holds ", cache->length,
              " tokens but the call starts at position ", pos.start);
    auto [kc, vc] = kv_cache_append(*cache, k.to(cache->k.scalar_type()), v.to(cache->v.scalar_type()));
    o = causal_attention(q.transpose(1, 2), kc.to(q.scalar_type()), vc.to(q.scalar_type()), pos.start);
  } else {
    o = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0);
  }
  return output(o, x, gate);
}

Tensor FullAttentionImpl::fused_decode(const std::vector<Tensor>& raw, const Positions& pos, KVCache& cache) {
  const int64_t B = raw[0].size(0), H = n_heads, D = head_dim;
  const auto q = raw[0].view({B, H, D}), k = raw[1].view({B, n_kv_heads, D}), v = raw[2].view({B, n_kv_heads, D});
  const auto o = ops::rope_cache_attention_fused(q, k, v, cache.k, cache.v, pos.seq_pos, pos.seq_lens, rope_theta,
                                                 rope_style == RopeStyle::Interleaved,
                                                 1.0 / std::sqrt(static_cast<double>(D)));  // [B, H, D]
  return o.defined() ? o.view({B, H * D}) : o;
}

std::unique_ptr<MixerState> FullAttentionImpl::make_state(int64_t batch, int64_t max_len,
                                                          torch::TensorOptions opts, const LoopSettings& loop) const {
  auto s = std::make_unique<KVCache>();
  s->k = torch::zeros({batch, n_kv_heads, max_len, head_dim}, opts);
  s->v = torch::zeros({batch, n_kv_heads, max_len, head_dim}, opts);
  return s;
}

MixerInfo full_attention_info() {
  return {"full", "causal softmax attention (MHA/GQA), RoPE, optional SDPA output gate; KV cache",
          [](const ModelConfig& cfg, int64_t) -> Mixer {
            json_reject_unknown(cfg.options_for("full"), {}, "mixer.full");
            return std::make_shared<FullAttentionImpl>(cfg);
          }};
}

}  // namespace lt2
