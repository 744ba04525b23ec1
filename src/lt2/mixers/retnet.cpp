#include "lt2/mixers/retnet.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/attention/rope.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

Tensor retention_log_decay(int64_t num_heads, torch::ScalarType dt, const torch::Device& device) {
  auto h = torch::arange(num_heads, torch::TensorOptions().dtype(dt).device(device));
  return torch::log1p(-torch::pow(2.0, -5.0 - h));  // log(1 - 2^(-5-h))
}

RetNetImpl::RetNetImpl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.retnet";
  const json opts = cfg.options_for("retnet");
  json_reject_unknown(opts, {"num_heads", "expand_k", "expand_v", "chunk_size"}, where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", cfg.n_heads, where);
  const int64_t key_dim = std::llround(d * option_double(opts, "expand_k", 1.0, where));
  const int64_t value_dim = std::llround(d * option_double(opts, "expand_v", 2.0, where));
  LT2_CHECK(num_heads > 0 && key_dim % num_heads == 0 && value_dim % num_heads == 0 &&
                (key_dim / num_heads) % 2 == 0,
            where, ": key dim ", key_dim, " and value dim ", value_dim,
            " must split evenly into num_heads (", num_heads, ") heads, with an even key head dim");
  head_k_dim = key_dim / num_heads;
  head_v_dim = value_dim / num_heads;
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(chunk_size >= 1, where, ": chunk_size must be >= 1");

  const double std = cfg.init_scale();
  q_proj = register_module("q_proj", make_linear(d, key_dim, std));
  k_proj = register_module("k_proj", make_linear(d, key_dim, std));
  v_proj = register_module("v_proj", make_linear(d, value_dim, std));
  g_proj = register_module("g_proj", make_linear(d, value_dim, std));
  o_proj = register_module("o_proj", make_linear(value_dim, d, 1.0 / std::sqrt(double(value_dim))));
  g_norm_swish_gate = register_module("g_norm_swish_gate", RMSNorm(head_v_dim, norm_eps));

  delta_rule = false;
  state_heads = num_heads, state_k = head_k_dim, state_v = head_v_dim;
}

RecurrenceInputs RetNetImpl::project(const Tensor& x, RecurrentState*, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto ct = accum_dtype(x);
  const auto p = project_inputs(x);
  RecurrenceInputs in;
  in.q = ops::apply_rope(p[0].view({B, T, num_heads, head_k_dim}), pos, 1e4, RopeStyle::Half);  // [B, T, H, K]
  in.k = ops::apply_rope(p[1].view({B, T, num_heads, head_k_dim}), pos, 1e4, RopeStyle::Half);  // [B, T, H, K]
  in.v = p[2].view({B, T, num_heads, head_v_dim});                                               // [B, T, H, V]
  in.gate = p[3];
  in.g = retention_log_decay(num_heads, ct, x.device()).expand({B, T, num_heads});
  in.scale = 1.0 / std::sqrt(static_cast<double>(head_k_dim));
  return in;
}

Tensor RetNetImpl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) {
  const int64_t B = x.size(0), T = x.size(1);
  auto gate = in.gate.view({B, T, num_heads, head_v_dim});
  auto y = ops::gated_rms_norm(o, g_norm_swish_gate->weight, norm_eps, gate, ops::GateActivation::Swish);
  return o_proj(for_linear(y.reshape({B, T, num_heads * head_v_dim}), x));
}

MixerInfo retnet_info() {
  return {"retnet", "RetNet retention: fixed per-head decay 1 - 2^(-5-h), RoPE q/k, swish-gated RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<RetNetImpl>(cfg); }};
}

}  // namespace lt2
