#include "lt2/model/rope.h"

#include "lt2/model/layers.h"

namespace lt2 {

namespace {

// cos/sin tables [T, 1, D], each angle repeated for both members of its pair (in the layout of
// the RoPE style), with the sign of the sin folded in, for the last (start, T, D, theta, style,
// device, dtype) asked for: every layer and loop of a forward pass rotates the same positions.
struct RopeTables {
  int64_t start = -1, T = -1, D = -1;
  double theta = 0;
  RopeStyle style = RopeStyle::Interleaved;
  torch::Device device{torch::kCPU};
  torch::ScalarType dtype = torch::kFloat32;
  Tensor cos, sin;
};

const RopeTables& rope_tables(int64_t start, int64_t T, int64_t D, double theta, RopeStyle style,
                              const torch::TensorOptions& opts) {
  thread_local RopeTables t;
  const auto dtype = opts.dtype().toScalarType();
  if (t.start == start && t.T == T && t.D == D && t.theta == theta && t.style == style &&
      t.device == opts.device() && t.dtype == dtype)
    return t;
  torch::NoGradGuard ng;
  // Angles in float64 (exact positions at long contexts), then cast: inv_freq_i = theta^(-2i/D).
  auto f64 = opts.dtype(torch::kFloat64);
  auto inv_freq = torch::pow(theta, -torch::arange(0, D, 2, f64) / static_cast<double>(D));
  auto ang = torch::outer(torch::arange(start, start + T, f64), inv_freq);  // [T, D/2]
  auto cos = ang.cos(), sin = ang.sin();
  // Interleaved pairs (2i, 2i+1) -> [c0, c0, c1, c1, ...]; halves (i, i + D/2) -> [c, c].
  auto spread = [&](const Tensor& a, const Tensor& b) {
    return style == RopeStyle::Interleaved ? torch::stack({a, b}, -1).flatten(-2) : torch::cat({a, b}, -1);
  };
  // out = x * cos + partner(x) * sin_signed, partner(x) pairs each member with its mate
  // (a, b) -> (b, a); the first member takes -sin, the second +sin.
  t = RopeTables{start, T, D, theta, style, opts.device(), dtype,
                 spread(cos, cos).to(dtype).view({T, 1, D}), spread(-sin, sin).to(dtype).view({T, 1, D})};
  return t;
}

}  // namespace

Tensor apply_rope(const Tensor& x, int64_t start, double theta, RopeStyle style) {
  const int64_t T = x.size(1), D = x.size(3);
  // Computed in x's dtype (bf16 under autocast, like HF's rotary embedding): five elementwise
  // kernels on the activation instead of a round trip through fp32.
  const auto& tb = rope_tables(start, T, D, theta, style, x.options());
  Tensor partner;  // each member of a pair replaced by its mate
  if (style == RopeStyle::Interleaved) {
    partner = x.unflatten(-1, {D / 2, 2}).flip(-1).flatten(-2);
  } else {
    partner = x.roll(D / 2, -1);
  }
  return x * tb.cos + partner * tb.sin;
}

}  // namespace lt2
