#include "lt2/mixers/gla.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/gated_linear/gated_linear.h"  // log_sigmoid_gates
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

GatedLinearAttentionImpl::GatedLinearAttentionImpl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.gla";
  const json opts = cfg.options_for("gla");
  json_reject_unknown(opts, {"num_heads", "expand_k", "expand_v", "gate_low_rank_dim",
                             "gate_logit_normalizer", "use_short_conv", "conv_size", "chunk_size"},
                      where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", cfg.n_heads, where);
  const HeadDims dims = expand_head_dims(opts, d, num_heads, 0.5, 1.0, where);
  head_k_dim = dims.k;
  head_v_dim = dims.v;
  const int64_t key_dim = head_k_dim * num_heads, value_dim = head_v_dim * num_heads;
  const int64_t low_rank = option_int(opts, "gate_low_rank_dim", 16, where);
  gate_logit_normalizer = option_double(opts, "gate_logit_normalizer", 16.0, where);
  use_short_conv = option_bool(opts, "use_short_conv", false, where);
  conv_kernel = use_short_conv ? option_int(opts, "conv_size", 4, where) : 0;
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(chunk_size >= 1 && low_rank >= 1 && gate_logit_normalizer > 0 &&
                (!use_short_conv || conv_kernel >= 1),
            where, ": chunk_size, gate_low_rank_dim, conv_size and gate_logit_normalizer must be positive");

  const double std = cfg.init_scale();
  q_proj = register_module("q_proj", make_linear(d, key_dim, std));
  k_proj = register_module("k_proj", make_linear(d, key_dim, std));
  v_proj = register_module("v_proj", make_linear(d, value_dim, std));
  g_proj = register_module("g_proj", make_linear(d, value_dim, std));
  gk_proj = register_module("gk_proj", torch::nn::Sequential(
                                           make_linear(d, low_rank, std),
                                           make_linear(low_rank, key_dim, 1.0 / std::sqrt(double(low_rank)), true)));
  o_proj = register_module("o_proj", make_linear(value_dim, d, 1.0 / std::sqrt(double(value_dim))));
  if (use_short_conv) {
    q_conv1d = register_module("q_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
    k_conv1d = register_module("k_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
    v_conv1d = register_module("v_conv1d", ShortConv(value_dim, conv_kernel, false, true, kShortConvInitStd));
    conv_channels = {key_dim, key_dim, value_dim};
  }
  g_norm_swish_gate = register_module("g_norm_swish_gate", RMSNorm(head_v_dim, norm_eps));

  delta_rule = false;
  state_heads = num_heads, state_k = head_k_dim, state_v = head_v_dim;
}

RecurrenceInputs GatedLinearAttentionImpl::project(const Tensor& x, RecurrentState* st, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto ct = accum_dtype(x);
  const auto p = project_inputs(x);
  auto q = p[0], k = p[1], v = p[2];
  if (use_short_conv) {
    q = q_conv1d(q, st ? &st->conv[0] : nullptr, pos);
    k = k_conv1d(k, st ? &st->conv[1] : nullptr, pos);
    v = v_conv1d(v, st ? &st->conv[2] : nullptr, pos);
  }
  RecurrenceInputs in;
  in.q = q.view({B, T, num_heads, head_k_dim});
  in.k = k.view({B, T, num_heads, head_k_dim});
  in.v = v.view({B, T, num_heads, head_v_dim});
  in.gate = p[3];
  in.g = ops::log_sigmoid_gates(linear_at(gk_proj, 1)(p[4]), gate_logit_normalizer, ct, std::nullopt)
             .g.view({B, T, num_heads, head_k_dim});  // [B, T, H, K]
  in.scale = 1.0 / std::sqrt(static_cast<double>(head_k_dim));
  return in;
}

Tensor GatedLinearAttentionImpl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) {
  const int64_t B = x.size(0), T = x.size(1);
  auto gate = in.gate.view({B, T, num_heads, head_v_dim});
  auto y = ops::gated_rms_norm(o, g_norm_swish_gate->weight, norm_eps, gate, ops::GateActivation::Swish);
  return o_proj(for_linear(y.reshape({B, T, num_heads * head_v_dim}), x));
}

std::vector<torch::nn::Linear> GatedLinearAttentionImpl::input_projections() const {
  return {q_proj, k_proj, v_proj, g_proj, linear_at(gk_proj, 0)};
}

MixerInfo gla_info() {
  return {"gla", "Gated Linear Attention: per-channel data-dependent decay (low-rank gate), swish-gated RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<GatedLinearAttentionImpl>(cfg); }};
}

}  // namespace lt2
