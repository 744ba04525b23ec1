#include "lt2/mixers/gdn.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/delta_rule/decode.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

GatedDeltaNetImpl::GatedDeltaNetImpl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.gdn";
  const json opts = cfg.options_for("gdn");
  json_reject_unknown(opts, {"num_heads", "head_dim", "num_v_heads", "expand_v", "conv_size",
                             "chunk_size", "use_gate", "allow_neg_eigval"}, where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", cfg.n_heads, where);
  LT2_CHECK(num_heads > 0, where, ": num_heads must be > 0, found ", num_heads);
  LT2_CHECK(opts.contains("head_dim") || (3 * d) % (4 * num_heads) == 0, where,
            ": the default head_dim 0.75 * d_model / num_heads is not an integer (d_model ", d,
            ", num_heads ", num_heads, "); set head_dim");
  head_k_dim = option_int(opts, "head_dim", 3 * d / (4 * num_heads), where);
  num_v_heads = option_int(opts, "num_v_heads", num_heads, where);
  const double expand_v = option_double(opts, "expand_v", 2.0, where);
  head_v_dim = std::llround(head_k_dim * expand_v);
  LT2_CHECK(head_k_dim > 0 && std::abs(head_k_dim * expand_v - head_v_dim) < 1e-9, where,
            ": head_dim * expand_v must be a positive integer, found ", head_k_dim, " * ", expand_v);
  LT2_CHECK(num_v_heads % num_heads == 0, where, ": num_v_heads (", num_v_heads,
            ") must be a multiple of num_heads (", num_heads, ")");
  conv_kernel = option_int(opts, "conv_size", 4, where);
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(conv_kernel >= 1 && chunk_size >= 1, where, ": conv_size and chunk_size must be >= 1");
  use_gate = option_bool(opts, "use_gate", true, where);
  allow_neg_eigval = option_bool(opts, "allow_neg_eigval", false, where);

  const int64_t key_dim = num_heads * head_k_dim, value_dim = num_v_heads * head_v_dim;
  const double std = cfg.init_scale();
  q_proj = register_module("q_proj", make_linear(d, key_dim, std));
  k_proj = register_module("k_proj", make_linear(d, key_dim, std));
  v_proj = register_module("v_proj", make_linear(d, value_dim, std));
  a_proj = register_module("a_proj", make_linear(d, num_v_heads, std));
  b_proj = register_module("b_proj", make_linear(d, num_v_heads, std));
  if (use_gate) g_proj = register_module("g_proj", make_linear(d, value_dim, std));
  o_proj = register_module("o_proj", make_linear(value_dim, d, 1.0 / std::sqrt(double(value_dim))));
  q_conv1d = register_module("q_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
  k_conv1d = register_module("k_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
  v_conv1d = register_module("v_conv1d", ShortConv(value_dim, conv_kernel, false, true, kShortConvInitStd));
  A_log = register_parameter("A_log", log_uniform_A_init(num_v_heads, 0.0, 16.0));
  dt_bias = register_parameter("dt_bias", inverse_softplus_dt_init(num_v_heads));
  o_norm = register_module("o_norm", RMSNorm(head_v_dim, norm_eps));

  delta_rule = true;
  state_heads = num_v_heads, state_k = head_k_dim, state_v = head_v_dim;
  conv_channels = {key_dim, key_dim, value_dim};
}

RecurrenceInputs GatedDeltaNetImpl::project(const Tensor& x, RecurrentState* st, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1), groups = num_v_heads / num_heads;
  RecurrenceInputs in;
  // q, k, v, the output gate, a and b: one GEMM whose parts are column slices, which the
  // convolutions and the output norm read in place.
  const auto p = project_inputs(x);
  if (use_gate) in.gate = p[3];
  auto q = q_conv1d(p[0], st ? &st->conv[0] : nullptr, pos).view({B, T, num_heads, head_k_dim});
  auto k = k_conv1d(p[1], st ? &st->conv[1] : nullptr, pos).view({B, T, num_heads, head_k_dim});
  in.q = repeat_heads(ops::l2_normalize(q), groups);                   // [B, T, HV, K]
  in.k = repeat_heads(ops::l2_normalize(k), groups);                   // [B, T, HV, K]
  in.v = v_conv1d(p[2], st ? &st->conv[2] : nullptr, pos).view({B, T, num_v_heads, head_v_dim});
  auto gates = ops::delta_rule_gates(p[a_part_index()], p[a_part_index() + 1], A_log, dt_bias,
                                     allow_neg_eigval ? 2.0 : 1.0);
  in.g = gates.g;        // [B, T, HV]
  in.beta = gates.beta;  // [B, T, HV]
  in.scale = scale();
  return in;
}

RecurrentState* GatedDeltaNetImpl::fused_state(const Tensor& x, MixerState& state) const {
  auto* st = dynamic_cast<RecurrentState*>(&state);
  const bool fused = st && x.dim() == 3 && x.size(1) == 1 && num_v_heads == num_heads &&
                     ops::gdn_decode_applies(x, st->S, st->conv[0], A_log, head_k_dim);
  return fused ? st : nullptr;
}

Tensor GatedDeltaNetImpl::fused_core(const std::vector<Tensor>& p, const Positions& pos, RecurrentState& st) {
  LT2_CHECK(pos.seq_pos.defined() || st.length == pos.start, kind(), " state holds ", st.length,
            " tokens but the call starts at position ", pos.start);
  ops::GdnDecodeArgs a;
  a.q = p[0], a.k = p[1], a.v = p[2], a.a = p[a_part_index()], a.b = p[a_part_index() + 1];
  if (use_gate) a.gate = p[3];
  a.q_conv_weight = q_conv1d->weight;
  a.k_conv_weight = k_conv1d->weight;
  a.v_conv_weight = v_conv1d->weight;
  a.A_log = A_log;
  a.dt_bias = dt_bias;
  a.norm_weight = o_norm->weight;
  a.num_heads = num_heads, a.head_k_dim = head_k_dim, a.head_v_dim = head_v_dim;
  a.scale = scale(), a.norm_eps = norm_eps, a.allow_neg_eigval = allow_neg_eigval;
  a.state_settled = true;  // the kernels just before are this layer's projections (p)
  auto y = ops::gdn_decode_fused(a, st.S, st.conv[0], st.conv[1], st.conv[2]);  // [B, H*V]
  if (!pos.seq_pos.defined()) st.length += 1;
  return y;
}

Tensor GatedDeltaNetImpl::step(const Tensor& x, const Positions& pos, MixerState& state) {
  auto* st = fused_state(x, state);
  if (!st) return RecurrentMixerImpl::step(x, pos, state);
  const int64_t B = x.size(0);
  // One GEMV for every input projection when packed (the parts are strided views of its output).
  std::vector<Tensor> parts;
  if (use_packed(w_in)) {
    parts = unpack_outputs(ops::linear(x.view({B, -1}), w_in), input_projections());
  } else {
    for (const auto& l : input_projections()) parts.push_back(ops::linear(x, l).view({B, -1}));
  }
  return ops::linear(fused_core(parts, pos, *st).view({B, 1, -1}), o_proj);
}

std::optional<DecodeDescriptor> GatedDeltaNetImpl::decode_descriptor(MixerState& state, int64_t batch) {
  if (!use_packed(w_in)) return std::nullopt;
  auto* st = fused_state(torch::empty({batch, 1, w_in.size(1)}, w_in.options()), state);  // x as decode gives it
  if (!st) return std::nullopt;
  DecodeDescriptor d;
  d.input_weight = w_in;
  for (const auto& l : input_projections()) d.part_sizes.push_back(l->weight.size(0));
  d.core = [this, st](const std::vector<Tensor>& parts, const Positions& pos) { return fused_core(parts, pos, *st); };
  d.output = o_proj;
  return d;
}

std::vector<torch::nn::Linear> GatedDeltaNetImpl::input_projections() const {
  // The output gate (H V columns) before a and b (H each): its slice then starts 16 bytes aligned
  // wherever q, k and v do, which the output norm's 16-byte loads need.
  std::vector<torch::nn::Linear> layers{q_proj, k_proj, v_proj};
  if (use_gate) layers.push_back(g_proj);
  layers.push_back(a_proj);
  layers.push_back(b_proj);
  return layers;
}

Tensor GatedDeltaNetImpl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) {
  const int64_t B = x.size(0), T = x.size(1);
  auto gate = use_gate ? in.gate.view({B, T, num_v_heads, head_v_dim}) : Tensor();
  auto y = ops::gated_rms_norm(o, o_norm->weight, norm_eps, gate,
                               use_gate ? ops::GateActivation::Swish : ops::GateActivation::None);
  return o_proj(for_linear(y.reshape({B, T, num_v_heads * head_v_dim}), x));
}

MixerInfo gdn_info() {
  return {"gdn", "Gated DeltaNet: gated delta rule, short convs, L2-normalised q/k, swish-gated RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<GatedDeltaNetImpl>(cfg); }};
}

}  // namespace lt2
