// SwiGLU FFN: w2(silu(w1 x) * w3 x). Names follow Lingua (w1 gate, w3 up, w2 down). The module
// holds the weights and the reference math; ops::swiglu and its decode forms (ops/projections/projections.h)
// run the packed and fused paths.
#pragma once
#include <torch/torch.h>

namespace lt2 {

using torch::Tensor;

class SwiGLUImpl : public torch::nn::Module {
 public:
  SwiGLUImpl(int64_t dim, int64_t hidden, double std);
  Tensor forward(const Tensor& x);  // [..., dim] -> [..., dim]
  void pack();                      // inference: w1 and w3 in one matrix (pack_linears)
  int64_t hidden() const { return w1->weight.size(0); }
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
  Tensor w13;                       // packed [2 hidden, dim], or undefined
};
TORCH_MODULE(SwiGLU);

}  // namespace lt2
