#include "lt2/model/layers.h"

#include <cmath>

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

Tensor RMSNormImpl::forward(const Tensor& x) { return rms_norm(x, weight, eps); }

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden, double std) {
  w1 = register_module("w1", make_linear(dim, hidden, std));
  w3 = register_module("w3", make_linear(dim, hidden, std));
  w2 = register_module("w2", make_linear(hidden, dim, 1.0 / std::sqrt(static_cast<double>(hidden))));
}

Tensor SwiGLUImpl::forward(const Tensor& x) {
  return w2(torch::silu(w1(x)) * w3(x));
}

}  // namespace lt2
