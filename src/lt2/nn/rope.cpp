#include "lt2/nn/rope.h"

#include "lt2/nn/linear.h"

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

// cos and signed sin of the angles pos * theta^(-2i/D), spread over the pair layout of the style:
// interleaved pairs (2i, 2i+1) -> [c0, c0, c1, c1, ...]; halves (i, i + D/2) -> [c, c]. The sin
// carries the sign of each member (out = x * cos + partner(x) * sin_signed, partner(x) pairs each
// member with its mate (a, b) -> (b, a): the first member takes -sin, the second +sin).
// positions: float64, any shape P -> two [P..., D] tensors in `dtype`. Angles in float64 keep
// positions exact at long contexts.
std::pair<Tensor, Tensor> signed_cos_sin(const Tensor& positions, int64_t D, double theta, RopeStyle style,
                                         torch::ScalarType dtype) {
  auto inv_freq = torch::pow(theta, -torch::arange(0, D, 2, positions.options()) / static_cast<double>(D));
  auto ang = positions.unsqueeze(-1) * inv_freq;  // [P..., D/2]
  auto cos = ang.cos(), sin = ang.sin();
  auto spread = [&](const Tensor& a, const Tensor& b) {
    return style == RopeStyle::Interleaved ? torch::stack({a, b}, -1).flatten(-2) : torch::cat({a, b}, -1);
  };
  return {spread(cos, cos).to(dtype), spread(-sin, sin).to(dtype)};
}

const RopeTables& rope_tables(int64_t start, int64_t T, int64_t D, double theta, RopeStyle style,
                              const torch::TensorOptions& opts) {
  thread_local RopeTables t;
  const auto dtype = opts.dtype().toScalarType();
  if (t.start == start && t.T == T && t.D == D && t.theta == theta && t.style == style &&
      t.device == opts.device() && t.dtype == dtype)
    return t;
  torch::NoGradGuard ng;
  auto [cos, sin] = signed_cos_sin(torch::arange(start, start + T, opts.dtype(torch::kFloat64)), D, theta,
                                   style, dtype);
  t = RopeTables{start, T, D, theta, style, opts.device(), dtype, cos.view({T, 1, D}), sin.view({T, 1, D})};
  return t;
}

// Each member of a pair replaced by its mate.
Tensor rope_partner(const Tensor& x, RopeStyle style) {
  const int64_t D = x.size(3);
  return style == RopeStyle::Interleaved ? x.unflatten(-1, {D / 2, 2}).flip(-1).flatten(-2) : x.roll(D / 2, -1);
}

}  // namespace

Tensor apply_rope(const Tensor& x, int64_t start, double theta, RopeStyle style) {
  const int64_t T = x.size(1), D = x.size(3);
  // Computed in x's dtype (bf16 under autocast, like HF's rotary embedding): five elementwise
  // kernels on the activation instead of a round trip through fp32.
  const auto& tb = rope_tables(start, T, D, theta, style, x.options());
  return x * tb.cos + rope_partner(x, style) * tb.sin;
}

Tensor apply_rope(const Tensor& x, const Tensor& positions, double theta, RopeStyle style) {
  LT2_CHECK(positions.dim() == 2 && positions.size(0) == x.size(0) && positions.size(1) == x.size(1),
            "apply_rope: positions must be [B, T] = [", x.size(0), ", ", x.size(1), "], found ", positions.sizes());
  auto [cos, sin] = signed_cos_sin(positions.to(torch::kFloat64), x.size(3), theta, style, x.scalar_type());
  return x * cos.unsqueeze(2) + rope_partner(x, style) * sin.unsqueeze(2);  // tables [B, T, 1, D]
}

Tensor apply_rope(const Tensor& x, const Positions& pos, double theta, RopeStyle style) {
  if (pos.documents) return apply_rope(x, pos.documents->offsets, theta, style);  // positions in each document
  if (!pos.seq_pos.defined()) return apply_rope(x, pos.start, theta, style);
  LT2_CHECK(x.size(1) == 1, "per-sequence positions rotate one token per sequence, found ", x.size(1));
  return apply_rope(x, pos.seq_pos.view({x.size(0), 1}), theta, style);
}

}  // namespace lt2
