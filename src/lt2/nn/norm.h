// RMSNorm: the module (its weight) and the reference math, in fp32 whatever the input dtype.
// ops::rms_norm dispatches to the fused kernel where one applies.
#pragma once
#include <torch/torch.h>

namespace lt2 {

using torch::Tensor;

// Functional RMSNorm over the last dim in fp32: y = w * x / sqrt(mean(x^2) + eps) (weight: [dim],
// broadcastable to x, or undefined). Output has the input's dtype.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);

// Weight init ones (Ouro's convention: w * x_hat, no 1 + w).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  Tensor forward(const Tensor& x) { return rms_norm(x, weight, eps); }  // x: [..., dim]
  Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

}  // namespace lt2
