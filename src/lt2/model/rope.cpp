#include "lt2/model/rope.h"

#include "lt2/model/layers.h"

namespace lt2 {

Tensor apply_rope(const Tensor& x, int64_t start, double theta, RopeStyle style) {
  const int64_t T = x.size(1), D = x.size(3);
  auto fopts = torch::TensorOptions().dtype(accum_dtype(x)).device(x.device());
  // inv_freq_i = theta^(-2i/D), i = 0..D/2-1
  auto inv_freq = torch::pow(theta, -torch::arange(0, D, 2, fopts) / static_cast<double>(D));
  auto pos = torch::arange(start, start + T, fopts);
  auto ang = torch::outer(pos, inv_freq);                    // [T, D/2]
  auto cos = ang.cos().view({1, T, 1, D / 2});
  auto sin = ang.sin().view({1, T, 1, D / 2});
  auto xf = x.to(fopts.dtype());
  Tensor a, b;  // the two members of each rotated pair
  if (style == RopeStyle::Interleaved) {
    auto pairs = xf.unflatten(-1, {D / 2, 2});               // [B, T, H, D/2, 2]
    a = pairs.select(-1, 0);
    b = pairs.select(-1, 1);
    auto out = torch::stack({a * cos - b * sin, a * sin + b * cos}, -1).flatten(-2);
    return out.to(x.scalar_type());
  }
  a = xf.narrow(-1, 0, D / 2);
  b = xf.narrow(-1, D / 2, D / 2);
  return torch::cat({a * cos - b * sin, a * sin + b * cos}, -1).to(x.scalar_type());
}

}  // namespace lt2
