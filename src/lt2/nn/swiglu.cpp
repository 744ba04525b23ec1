#include "lt2/nn/swiglu.h"

#include <cmath>

#include "lt2/nn/linear.h"

namespace lt2 {

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden, double std) {
  w1 = register_module("w1", make_linear(dim, hidden, std));
  w3 = register_module("w3", make_linear(dim, hidden, std));
  w2 = register_module("w2", make_linear(hidden, dim, 1.0 / std::sqrt(static_cast<double>(hidden))));
}

Tensor SwiGLUImpl::forward(const Tensor& x) { return w2(torch::silu(w1(x)) * w3(x)); }

void SwiGLUImpl::pack() {
  if (!w13.defined()) w13 = pack_linears({w1, w3});
}

}  // namespace lt2
