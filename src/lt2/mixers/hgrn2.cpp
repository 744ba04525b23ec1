#include "lt2/mixers/hgrn2.h"

#include <algorithm>
#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/gated_linear/gated_linear.h"  // log_sigmoid_gates
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

HGRN2Impl::HGRN2Impl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.hgrn2";
  const json opts = cfg.options_for("hgrn2");
  json_reject_unknown(opts, {"num_heads", "chunk_size"}, where);
  const int64_t d = cfg.d_model;
  num_heads = option_int(opts, "num_heads", std::max<int64_t>(1, d / 128), where);
  LT2_CHECK(num_heads > 0 && d % num_heads == 0, where, ": num_heads (", num_heads,
            ") must divide d_model (", d, ")");
  expand_ratio = head_i_dim = d / num_heads;
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(chunk_size >= 1, where, ": chunk_size must be >= 1");

  const int64_t forget_dim = num_heads * expand_ratio;
  const double std = cfg.init_scale();
  q_proj = register_module("q_proj", make_linear(d, forget_dim, std));
  f_proj = register_module("f_proj", make_linear(d, forget_dim, std));
  i_proj = register_module("i_proj", make_linear(d, d, std));
  g_norm = register_module("g_norm", RMSNorm(d, norm_eps));
  o_proj = register_module("o_proj", make_linear(d, d, 1.0 / std::sqrt(double(d))));

  delta_rule = false;
  state_heads = num_heads, state_k = expand_ratio, state_v = head_i_dim;
}

RecurrenceInputs HGRN2Impl::project(const Tensor& x, RecurrentState*, const Positions&) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto ct = accum_dtype(x);
  const auto p = project_inputs(x);
  RecurrenceInputs in;
  in.q = torch::silu(p[0]).view({B, T, num_heads, expand_ratio});
  // g = log_sigmoid(f) [B, T, H * F] and k = 1 - exp(g) in the weights' dtype, whatever x's (under
  // autocast the block may hand x in bf16), from the forget gate's logits read in place.
  const auto gates = ops::log_sigmoid_gates(p[1], 1.0, ct, q_proj->weight.scalar_type());
  in.k = gates.complement.view({B, T, num_heads, expand_ratio});
  in.g = gates.g.view({B, T, num_heads, expand_ratio});
  in.v = p[2].view({B, T, num_heads, head_i_dim});
  in.scale = 1.0 / std::sqrt(static_cast<double>(expand_ratio));
  return in;
}

Tensor HGRN2Impl::output(const Tensor& o, const Tensor& x, const RecurrenceInputs&) {
  const int64_t B = x.size(0), T = x.size(1);
  auto y = ops::gated_rms_norm(o.reshape({B, T, num_heads * head_i_dim}), g_norm->weight, norm_eps,
                               Tensor(), ops::GateActivation::None);
  return o_proj(for_linear(y, x));
}

MixerInfo hgrn2_info() {
  return {"hgrn2", "HGRN2: gated linear attention with key 1 - forget gate, per-channel decay, RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<HGRN2Impl>(cfg); }};
}

}  // namespace lt2
