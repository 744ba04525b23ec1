#include "lt2/nn/norm.h"

#include "lt2/nn/linear.h"

namespace lt2 {

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

}  // namespace lt2
