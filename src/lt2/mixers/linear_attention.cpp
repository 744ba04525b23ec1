#include "lt2/mixers/linear_attention.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/norms/norms.h"

namespace lt2 {

LinearAttentionImpl::LinearAttentionImpl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.linear";
  const json opts = cfg.options_for("linear");
  json_reject_unknown(opts, {"num_heads", "expand_k", "expand_v", "chunk_size"}, where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", cfg.n_heads, where);
  const HeadDims dims = expand_head_dims(opts, d, num_heads, 1.0, 1.0, where);
  head_k_dim = dims.k;
  head_v_dim = dims.v;
  const int64_t key_dim = head_k_dim * num_heads, value_dim = head_v_dim * num_heads;
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(chunk_size >= 1, where, ": chunk_size must be >= 1");

  const double std = cfg.init_scale();
  q_proj = register_module("q_proj", make_linear(d, key_dim, std));
  k_proj = register_module("k_proj", make_linear(d, key_dim, std));
  v_proj = register_module("v_proj", make_linear(d, value_dim, std));
  norm = register_module("norm", RMSNorm(head_v_dim, norm_eps));
  o_proj = register_module("o_proj", make_linear(value_dim, d, 1.0 / std::sqrt(double(value_dim))));

  delta_rule = false;
  state_heads = num_heads, state_k = head_k_dim, state_v = head_v_dim;
}

RecurrenceInputs LinearAttentionImpl::project(const Tensor& x, RecurrentState*, const Positions&) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto p = project_inputs(x);
  RecurrenceInputs in;
  in.q = (torch::elu(p[0]) + 1).view({B, T, num_heads, head_k_dim});
  in.k = (torch::elu(p[1]) + 1).view({B, T, num_heads, head_k_dim});
  in.v = p[2].view({B, T, num_heads, head_v_dim});
  in.scale = 1.0 / std::sqrt(static_cast<double>(head_k_dim));
  return in;
}

Tensor LinearAttentionImpl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs&) {
  const int64_t B = x.size(0), T = x.size(1);
  auto y = ops::gated_rms_norm(o, norm->weight, norm_eps, Tensor(), ops::GateActivation::None);
  return o_proj(for_linear(y.reshape({B, T, num_heads * head_v_dim}), x));
}

MixerInfo linear_attention_info() {
  return {"linear", "linear attention: elu+1 feature map, no decay, per-head RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<LinearAttentionImpl>(cfg); }};
}

}  // namespace lt2
