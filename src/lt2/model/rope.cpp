#include "lt2/model/rope.h"

#include "lt2/model/layers.h"

namespace lt2 {

namespace {

// cos/sin tables [T, D/2] for the last (start, T, D, theta, device, dtype) asked for: every layer
// and loop of a forward pass rotates the same positions, so they are computed once per pass.
struct RopeTables {
  int64_t start = -1, T = -1, D = -1;
  double theta = 0;
  torch::Device device{torch::kCPU};
  torch::ScalarType dtype = torch::kFloat32;
  Tensor cos, sin;
};

const RopeTables& rope_tables(int64_t start, int64_t T, int64_t D, double theta,
                              const torch::TensorOptions& fopts) {
  thread_local RopeTables t;
  if (t.start == start && t.T == T && t.D == D && t.theta == theta && t.device == fopts.device() &&
      t.dtype == fopts.dtype().toScalarType())
    return t;
  torch::NoGradGuard ng;
  // inv_freq_i = theta^(-2i/D), i = 0..D/2-1
  auto inv_freq = torch::pow(theta, -torch::arange(0, D, 2, fopts) / static_cast<double>(D));
  auto ang = torch::outer(torch::arange(start, start + T, fopts), inv_freq);  // [T, D/2]
  t = RopeTables{start, T, D, theta, fopts.device(), fopts.dtype().toScalarType(), ang.cos(), ang.sin()};
  return t;
}

}  // namespace

Tensor apply_rope(const Tensor& x, int64_t start, double theta, RopeStyle style) {
  const int64_t T = x.size(1), D = x.size(3);
  auto fopts = torch::TensorOptions().dtype(accum_dtype(x)).device(x.device());
  const auto& tables = rope_tables(start, T, D, theta, fopts);
  auto cos = tables.cos.view({1, T, 1, D / 2});
  auto sin = tables.sin.view({1, T, 1, D / 2});
  auto xf = x.to(fopts.dtype());
  if (style == RopeStyle::Interleaved) {
    auto pairs = xf.unflatten(-1, {D / 2, 2});               // [B, T, H, D/2, 2]
    auto a = pairs.select(-1, 0), b = pairs.select(-1, 1);
    return torch::stack({a * cos - b * sin, a * sin + b * cos}, -1).flatten(-2).to(x.scalar_type());
  }
  auto a = xf.narrow(-1, 0, D / 2), b = xf.narrow(-1, D / 2, D / 2);
  return torch::cat({a * cos - b * sin, a * sin + b * cos}, -1).to(x.scalar_type());
}

}  // namespace lt2
