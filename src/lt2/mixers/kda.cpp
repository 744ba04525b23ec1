#include "lt2/mixers/kda.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

KimiDeltaAttentionImpl::KimiDeltaAttentionImpl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.kda";
  const json opts = cfg.options_for("kda");
  json_reject_unknown(opts, {"num_heads", "head_dim", "num_v_heads", "expand_v", "conv_size",
                             "chunk_size", "allow_neg_eigval"}, where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", cfg.n_heads, where);
  LT2_CHECK(num_heads > 0, where, ": num_heads must be > 0, found ", num_heads);
  head_k_dim = option_int(opts, "head_dim", d / num_heads, where);
  num_v_heads = option_int(opts, "num_v_heads", num_heads, where);
  const double expand_v = option_double(opts, "expand_v", 1.0, where);
  head_v_dim = std::llround(head_k_dim * expand_v);
  LT2_CHECK(head_k_dim > 0 && std::abs(head_k_dim * expand_v - head_v_dim) < 1e-9, where,
            ": head_dim * expand_v must be a positive integer, found ", head_k_dim, " * ", expand_v);
  LT2_CHECK(num_v_heads % num_heads == 0, where, ": num_v_heads (", num_v_heads,
            ") must be a multiple of num_heads (", num_heads, ")");
  conv_kernel = option_int(opts, "conv_size", 4, where);
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(conv_kernel >= 1 && chunk_size >= 1, where, ": conv_size and chunk_size must be >= 1");
  allow_neg_eigval = option_bool(opts, "allow_neg_eigval", false, where);

  const int64_t key_dim = num_heads * head_k_dim, value_dim = num_v_heads * head_v_dim;
  const int64_t gate_dim = num_v_heads * head_k_dim;
  const double std = cfg.init_scale(), low_std = 1.0 / std::sqrt(double(head_v_dim));
  q_proj = register_module("q_proj", make_linear(d, key_dim, std));
  k_proj = register_module("k_proj", make_linear(d, key_dim, std));
  v_proj = register_module("v_proj", make_linear(d, value_dim, std));
  b_proj = register_module("b_proj", make_linear(d, num_v_heads, std));
  f_proj = register_module("f_proj", torch::nn::Sequential(make_linear(d, head_v_dim, std),
                                                           make_linear(head_v_dim, gate_dim, low_std)));
  g_proj = register_module("g_proj", torch::nn::Sequential(make_linear(d, head_v_dim, std),
                                                           make_linear(head_v_dim, value_dim, low_std, true)));
  o_proj = register_module("o_proj", make_linear(value_dim, d, 1.0 / std::sqrt(double(value_dim))));
  q_conv1d = register_module("q_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
  k_conv1d = register_module("k_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
  v_conv1d = register_module("v_conv1d", ShortConv(value_dim, conv_kernel, false, true, kShortConvInitStd));
  A_log = register_parameter("A_log", log_uniform_A_init(num_v_heads, 1.0, 16.0));
  dt_bias = register_parameter("dt_bias", inverse_softplus_dt_init(gate_dim));
  o_norm = register_module("o_norm", RMSNorm(head_v_dim, norm_eps));

  delta_rule = true;
  state_heads = num_v_heads, state_k = head_k_dim, state_v = head_v_dim;
  conv_channels = {key_dim, key_dim, value_dim};
}

RecurrenceInputs KimiDeltaAttentionImpl::project(const Tensor& x, RecurrentState* st, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1), groups = num_v_heads / num_heads;
  const auto p = project_inputs(x);
  RecurrenceInputs in;
  auto q = q_conv1d(p[0], st ? &st->conv[0] : nullptr, pos).view({B, T, num_heads, head_k_dim});
  auto k = k_conv1d(p[1], st ? &st->conv[1] : nullptr, pos).view({B, T, num_heads, head_k_dim});
  in.q = repeat_heads(ops::l2_normalize(q), groups);                   // [B, T, HV, K]
  in.k = repeat_heads(ops::l2_normalize(k), groups);                   // [B, T, HV, K]
  in.v = v_conv1d(p[2], st ? &st->conv[2] : nullptr, pos).view({B, T, num_v_heads, head_v_dim});
  auto gates = ops::delta_rule_gates(linear_at(f_proj, 1)(p[3]), p[5], A_log, dt_bias, allow_neg_eigval ? 2.0 : 1.0);
  in.gate = linear_at(g_proj, 1)(p[4]);
  in.g = gates.g.view({B, T, num_v_heads, head_k_dim});  // [B, T, HV, K]
  in.beta = gates.beta;                                   // [B, T, HV]
  in.scale = 1.0 / std::sqrt(static_cast<double>(head_k_dim));
  return in;
}

Tensor KimiDeltaAttentionImpl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) {
  const int64_t B = x.size(0), T = x.size(1);
  auto gate = in.gate.view({B, T, num_v_heads, head_v_dim});
  auto y = ops::gated_rms_norm(o, o_norm->weight, norm_eps, gate, ops::GateActivation::Sigmoid);
  return o_proj(for_linear(y.reshape({B, T, num_v_heads * head_v_dim}), x));
}

std::vector<torch::nn::Linear> KimiDeltaAttentionImpl::input_projections() const {
  // b (one column a head) last: the low-rank layers' inputs then start 16-byte aligned within a row where q, k
  // and v's widths are multiples of 8 (every preset's), which cuBLAS's Hopper GEMMs need of an operand (after
  // b, lt-100m/kda's started at column 2,316 and took sm80 align2 kernels).
  return {q_proj, k_proj, v_proj, linear_at(f_proj, 0), linear_at(g_proj, 0), b_proj};
}

MixerInfo kda_info() {
  return {"kda", "Kimi Delta Attention: delta rule with per-channel decay, low-rank gates, sigmoid-gated RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<KimiDeltaAttentionImpl>(cfg); }};
}

}  // namespace lt2
