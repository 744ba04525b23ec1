#include "lt2/mixers/mamba2.h"

#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/gated_linear/gated_linear.h"  // scale_heads
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

Mamba2Impl::Mamba2Impl(const ModelConfig& cfg) : norm_eps(cfg.norm_eps) {
  const std::string where = "mixer_options.mamba2";
  const json opts = cfg.options_for("mamba2");
  json_reject_unknown(opts, {"num_heads", "head_dim", "expand", "state_size", "n_groups",
                             "conv_size", "chunk_size"}, where);
  const int64_t d = cfg.d_model;
  d_inner = option_int(opts, "expand", 2, where) * d;
  num_heads = option_int(opts, "num_heads", opts.contains("head_dim") ? 0 : cfg.n_heads, where);
  head_dim = option_int(opts, "head_dim", num_heads > 0 ? d_inner / num_heads : 0, where);
  if (num_heads == 0 && head_dim > 0) num_heads = d_inner / head_dim;
  LT2_CHECK(num_heads > 0 && head_dim > 0 && num_heads * head_dim == d_inner, where,
            ": num_heads * head_dim must equal expand * d_model = ", d_inner, ", found ", num_heads,
            " * ", head_dim);
  state_size = option_int(opts, "state_size", 64, where);
  n_groups = option_int(opts, "n_groups", 1, where);
  LT2_CHECK(state_size > 0 && n_groups > 0 && num_heads % n_groups == 0, where,
            ": state_size must be > 0 and n_groups must divide num_heads (", num_heads, "), found ",
            state_size, " and ", n_groups);
  conv_kernel = option_int(opts, "conv_size", 4, where);
  chunk_size = option_int(opts, "chunk_size", 64, where);
  LT2_CHECK(conv_kernel >= 1 && chunk_size >= 1, where, ": conv_size and chunk_size must be >= 1");

  const int64_t conv_dim = d_inner + 2 * n_groups * state_size;
  in_proj = register_module("in_proj", make_linear(d, d_inner + conv_dim + num_heads, cfg.init_scale()));
  conv1d = register_module("conv1d", ShortConv(conv_dim, conv_kernel, /*bias=*/true, /*silu=*/true,
                                               /*init_std=*/0.0));  // PyTorch's default conv init
  dt_bias = register_parameter("dt_bias", inverse_softplus_dt_init(num_heads));
  A_log = register_parameter("A_log", log_uniform_A_init(num_heads, 1.0, 16.0));
  D = register_parameter("D", torch::ones({num_heads}));
  norm = register_module("norm", RMSNorm(d_inner, norm_eps));
  out_proj = register_module("out_proj", make_linear(d_inner, d, 1.0 / std::sqrt(double(d_inner))));

  delta_rule = false;
  state_heads = num_heads, state_k = state_size, state_v = head_dim;
  conv_channels = {conv_dim};
}

RecurrenceInputs Mamba2Impl::project(const Tensor& x, RecurrentState* st, const Positions& pos) {
  const int64_t B = x.size(0), T = x.size(1), GN = n_groups * state_size;
  const int64_t heads_per_group = num_heads / n_groups;
  const auto ct = accum_dtype(x);
  // [z | xBC | dt] as column slices of one GEMM's output, whose 2 d_inner + 2 G N + H columns (3,212 at
  // d 768) ops::linear_split pads to whole 16-byte rows.
  const auto parts = ops::linear_split(x, in_proj, {d_inner, d_inner + 2 * GN, num_heads});
  auto xBC = conv1d(parts[1], st ? &st->conv[0] : nullptr, pos);     // [B, T, d_inner + 2 G N]
  auto xbc = xBC.split_with_sizes({d_inner, GN, GN}, -1);
  auto xs = xbc[0].view({B, T, num_heads, head_dim});                 // [B, T, H, P]
  auto dt = torch::softplus(parts[2].to(ct) + dt_bias.to(ct));        // [B, T, H]
  RecurrenceInputs in;
  in.q = repeat_heads(xbc[2].view({B, T, n_groups, state_size}), heads_per_group);  // C [B, T, H, N]
  in.k = repeat_heads(xbc[1].view({B, T, n_groups, state_size}), heads_per_group);  // B [B, T, H, N]
  // [B, T, H, P] in xs's dtype (the projection's: bf16 under autocast), as the chunk kernels read v; the
  // recurrence's output, the skip and the gated norm's input stay in it (the norm computes in fp32). The
  // product in dt's ct, xs read in place: no ct copy of xs made, or saved for the backward.
  in.v = ops::scale_heads(xs, dt);
  in.g = dt * -A_log.to(ct).exp();                                    // [B, T, H]
  in.scale = 1.0;
  in.gate = parts[0];                                                 // z [B, T, d_inner]
  in.skip = xs * D.to(xs.scalar_type()).view({num_heads, 1});         // [B, T, H, P]
  return in;
}

Tensor Mamba2Impl::output(const Tensor& y, const Tensor& x, const RecurrenceInputs& in) {
  const int64_t B = x.size(0), T = x.size(1);
  // y * silu(z), then the norm, both in y's dtype: z (a column slice of the projection) read in place.
  auto gated = ops::silu_gate(y.reshape({B, T, d_inner}), in.gate.to(y.scalar_type()));
  auto normed = ops::gated_rms_norm(gated.view({B, T, n_groups, d_inner / n_groups}),
                                    norm->weight.view({n_groups, d_inner / n_groups}), norm_eps, Tensor(),
                                    ops::GateActivation::None);
  return out_proj(for_linear(normed.reshape({B, T, d_inner}), x));
}

MixerInfo mamba2_info() {
  return {"mamba2", "Mamba2 (SSD): scalar data-dependent decay per head, shared B/C, gated group RMSNorm",
          [](const ModelConfig& cfg, int64_t) -> Mixer { return std::make_shared<Mamba2Impl>(cfg); }};
}

}  // namespace lt2
