#include "lt2/model/layers.h"

#include <cmath>

#include "lt2/ops/fused_decode.h"
#include "lt2/util/env.h"

namespace lt2 {

void trunc_normal_(Tensor w, double std) {
  torch::NoGradGuard ng;
  // Re-draw by inverse CDF on [-3, 3] std, like torch.nn.init.trunc_normal_.
  auto lo = 0.5 * (1.0 + std::erf(-3.0 / std::sqrt(2.0)));
  auto hi = 0.5 * (1.0 + std::erf(3.0 / std::sqrt(2.0)));
  w.uniform_(2 * lo - 1, 2 * hi - 1);
  w.erfinv_();
  w.mul_(std * std::sqrt(2.0));
  w.clamp_(-3 * std, 3 * std);
}

torch::nn::Linear make_linear(int64_t in, int64_t out, double std, bool bias) {
  torch::nn::Linear lin(torch::nn::LinearOptions(in, out).bias(bias));
  if (std > 0) trunc_normal_(lin->weight, std);
  else lin->weight.data().zero_();
  if (bias) lin->bias.data().zero_();
  return lin;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  // ATen's fused kernel accumulates in fp32 (float64 stays float64); low-precision inputs are
  // upcast first so the normalisation and the gain multiply happen in fp32. A weight that is not
  // [dim] (Mamba2's per-group gain [G, dim]) is broadcast after the fused normalisation.
  const auto dtype = accum_dtype(x);
  const bool fused_gain = weight.defined() && weight.dim() == 1;
  auto y = at::rms_norm(x.to(dtype), {x.size(-1)},
                        fused_gain ? std::optional<Tensor>(weight.to(dtype)) : std::nullopt, eps);
  if (weight.defined() && !fused_gain) y = y * weight.to(dtype);
  return y.to(x.scalar_type());
}

Tensor apply_linear(const Tensor& x, const Tensor& weight) {
  return ops::gemv_fused_applies(x, weight) ? ops::gemv_fused(x, weight) : at::linear(x, weight);
}

Tensor apply_linear(const Tensor& x, const torch::nn::Linear& layer) {
  return layer->bias.defined() ? at::linear(x, layer->weight, layer->bias) : apply_linear(x, layer->weight);
}

Tensor normed_linear(const Tensor& x, const Tensor& w, const Tensor& norm_weight, double eps) {
  ops::GemvFusion norm;
  norm.norm_weight = norm_weight, norm.norm_eps = eps;
  return ops::gemv_fused_applies(x, w, norm) ? ops::gemv_fused(x, w, norm) : Tensor();
}

Tensor gated_linear_residual(const Tensor& y, const torch::nn::Linear& layer, const Tensor& x_gate,
                             const Tensor& residual) {
  ops::GemvFusion f;
  f.x_gate = x_gate, f.residual = residual;
  if (!layer->bias.defined() && ops::gemv_fused_applies(y, layer->weight, f))
    return ops::gemv_fused(y, layer->weight, f);
  const auto out = apply_linear(x_gate.defined() ? y * torch::sigmoid(x_gate) : y, layer);
  return residual.defined() ? residual + out : out;
}

Tensor RMSNormImpl::forward(const Tensor& x) {
  if (ops::fused_elementwise_applies({x, weight})) return ops::rms_norm_fused(x, weight, eps);  // one launch, no casts
  return rms_norm(x, weight, eps);
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden, double std) {
  w1 = register_module("w1", make_linear(dim, hidden, std));
  w3 = register_module("w3", make_linear(dim, hidden, std));
  w2 = register_module("w2", make_linear(hidden, dim, 1.0 / std::sqrt(static_cast<double>(hidden))));
}

Tensor SwiGLUImpl::forward(const Tensor& x) {
  if (use_packed(w13)) {
    return down(apply_linear(x, w13));
  }
  return w2(torch::silu(w1(x)) * w3(x));
}

Tensor SwiGLUImpl::forward_residual(const Tensor& h, const Tensor& norm_weight, double eps) {
  if (!use_packed(w13)) return {};
  const auto gate_up = normed_linear(h, w13, norm_weight, eps);  // [..., 2 hidden]
  if (!gate_up.defined()) return {};
  ops::GemvFusion silu_add;
  silu_add.silu_mul = true, silu_add.residual = h;
  if (!ops::gemv_fused_applies(gate_up, w2->weight, silu_add)) return h + down(gate_up);
  return ops::gemv_fused(gate_up, w2->weight, silu_add);
}

// Rows up to which the whole block tail (projection -> w1|w3 -> w2) is one chain; above it the
// chain stops before w2 and w2 is one more launch. w1|w3 applies silu(a) * b as its epilogue, so
// w2's x is hidden wide, plain, computed once (it was [a | b] with SiLU·mul applied by every
// block that staged it: 180 KB per block at 8 rows, which made the 3-product chain lose there,
// 42.2 vs 37.6 us; bench/results/gemv_chain_h200.txt). LT2_CHAINED_TAIL_MAX_ROWS overrides it
// (a benchmarking knob: the A/B of the two forms in the engine).
namespace {
int64_t chained_tail_max_rows() {
  static const int64_t rows = env_int("LT2_CHAINED_TAIL_MAX_ROWS", 4);
  return rows;
}
}  // namespace

Tensor SwiGLUImpl::forward_residual(const PendingProjection& mixer, const Tensor& norm_weight, double eps) {
  if (!mixer.layer || mixer.layer->bias.defined() || !mixer.residual.defined() || !use_packed(w13)) return {};
  ops::ChainProduct projection{mixer.layer->weight}, gate_up{w13}, down_proj{w2->weight};
  projection.fusion.x_gate = mixer.x_gate, projection.fusion.residual = mixer.residual;  // h
  gate_up.fusion.norm_weight = norm_weight, gate_up.fusion.norm_eps = eps;
  gate_up.silu_mul_out = true;     // silu(a) * b
  down_proj.residual_of = 0;       // h + ...
  if (mixer.y.size(0) <= chained_tail_max_rows()) {
    const auto out = ops::gemv_chain_fused(mixer.y, {projection, gate_up, down_proj});
    return out.empty() ? Tensor() : out[2];
  }
  const auto out = ops::gemv_chain_fused(mixer.y, {projection, gate_up});  // {h, silu(a) * b}
  if (out.empty()) return {};
  ops::GemvFusion add;
  add.residual = out[0];
  if (!ops::gemv_fused_applies(out[1], w2->weight, add)) return out[0] + apply_linear(out[1], w2);
  return ops::gemv_fused(out[1], w2->weight, add);
}

Tensor SwiGLUImpl::down(const Tensor& gate_up) {
  const int64_t n = w1->weight.size(0);
  if (ops::fused_elementwise_applies({gate_up})) return apply_linear(ops::silu_mul_fused(gate_up), w2);
  return apply_linear(torch::silu(gate_up.narrow(-1, 0, n)) * gate_up.narrow(-1, n, n), w2);
}

void SwiGLUImpl::pack() {
  if (!w13.defined()) w13 = pack_linears({w1, w3});
}

Tensor pack_linears(const std::vector<torch::nn::Linear>& layers) {
  torch::NoGradGuard ng;
  std::vector<Tensor> weights;
  for (const auto& l : layers) {
    LT2_CHECK(!l->bias.defined(), "pack_linears: only bias-free layers are packed");
    weights.push_back(l->weight);
  }
  auto packed = torch::cat(weights, 0);  // [sum out, in]
  int64_t row = 0;
  for (const auto& l : layers) {
    const int64_t n = l->weight.size(0);
    l->weight.set_data(packed.narrow(0, row, n));
    row += n;
  }
  return packed;
}

std::vector<Tensor> unpack_outputs(const Tensor& y, const std::vector<torch::nn::Linear>& layers) {
  std::vector<Tensor> out;
  int64_t col = 0;
  for (const auto& l : layers) {
    const int64_t n = l->weight.size(0);
    out.push_back(y.narrow(-1, col, n));
    col += n;
  }
  return out;
}

}  // namespace lt2
