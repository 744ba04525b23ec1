#include "lt2/mixers/deltanet.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

DeltaNetImpl::DeltaNetImpl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.deltanet";
  const json opts = cfg.options_for("deltanet");
  json_reject_unknown(opts, {"num_heads", "expand_k", "expand_v", "conv_size", "chunk_size",
                             "use_gate", "allow_neg_eigval"}, where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", cfg.n_heads, where);
  const HeadDims dims = expand_head_dims(opts, d, num_heads, 1.0, 1.0, where);
  head_k_dim = dims.k;
  head_v_dim = dims.v;
  const int64_t key_dim = head_k_dim * num_heads, value_dim = head_v_dim * num_heads;
  conv_kernel = option_int(opts, "conv_size", 4, where);
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(conv_kernel >= 1 && chunk_size >= 1, where, ": conv_size and chunk_size must be >= 1");
  use_gate = option_bool(opts, "use_gate", false, where);
  allow_neg_eigval = option_bool(opts, "allow_neg_eigval", false, where);

  const double std = cfg.init_scale();
  q_proj = register_module("q_proj", make_linear(d, key_dim, std));
  k_proj = register_module("k_proj", make_linear(d, key_dim, std));
  v_proj = register_module("v_proj", make_linear(d, value_dim, std));
  b_proj = register_module("b_proj", make_linear(d, num_heads, std));
  if (use_gate) g_proj = register_module("g_proj", make_linear(d, value_dim, std));
  o_proj = register_module("o_proj", make_linear(value_dim, d, 1.0 / std::sqrt(double(value_dim))));
  q_conv1d = register_module("q_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
  k_conv1d = register_module("k_conv1d", ShortConv(key_dim, conv_kernel, false, true, kShortConvInitStd));
  v_conv1d = register_module("v_conv1d", ShortConv(value_dim, conv_kernel, false, true, kShortConvInitStd));
  o_norm = register_module("o_norm", RMSNorm(head_v_dim, norm_eps));

  delta_rule = true;
  state_heads = num_heads, state_k = head_k_dim, state_v = head_v_dim;
  conv_channels = {key_dim, key_dim, value_dim};
}

RecurrenceInputs DeltaNetImpl::project(const Tensor& x, RecurrentState* st, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto ct = accum_dtype(x);
  const auto p = project_inputs(x);
  RecurrenceInputs in;
  in.q = ops::l2_normalize(q_conv1d(p[0], st ? &st->conv[0] : nullptr, pos).view({B, T, num_heads, head_k_dim}));
  in.k = ops::l2_normalize(k_conv1d(p[1], st ? &st->conv[1] : nullptr, pos).view({B, T, num_heads, head_k_dim}));
  in.v = v_conv1d(p[2], st ? &st->conv[2] : nullptr, pos).view({B, T, num_heads, head_v_dim});
  in.beta = torch::sigmoid(p[3].to(ct));  // [B, T, H]
  if (use_gate) in.gate = p[4];
  if (allow_neg_eigval) in.beta = in.beta * 2;
  in.scale = 1.0 / std::sqrt(static_cast<double>(head_k_dim));
  return in;
}

Tensor DeltaNetImpl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) {
  const int64_t B = x.size(0), T = x.size(1);
  auto gate = use_gate ? in.gate.view({B, T, num_heads, head_v_dim}) : Tensor();
  auto y = ops::gated_rms_norm(o, o_norm->weight, norm_eps, gate,
                               use_gate ? ops::GateActivation::Swish : ops::GateActivation::None);
  return o_proj(for_linear(y.reshape({B, T, num_heads * head_v_dim}), x));
}

std::vector<torch::nn::Linear> DeltaNetImpl::input_projections() const {
  std::vector<torch::nn::Linear> layers{q_proj, k_proj, v_proj, b_proj};
  if (use_gate) layers.push_back(g_proj);
  return layers;
}

MixerInfo deltanet_info() {
  return {"deltanet", "DeltaNet: delta rule without decay, short convs, L2-normalised q/k, RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<DeltaNetImpl>(cfg); }};
}

}  // namespace lt2
