#include "lt2/ops/projections/projections.h"

#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/gemv.h"

namespace lt2::ops {

Tensor linear(const Tensor& x, const Tensor& weight) {
  return gemv_fused_applies(x, weight) ? gemv_fused(x, weight) : at::linear(x, weight);
}

Tensor linear(const Tensor& x, const torch::nn::Linear& layer) {
  return layer->bias.defined() ? at::linear(x, layer->weight, layer->bias) : ops::linear(x, layer->weight);
}

namespace {
// A decode step: no gradient and at most kLinearGroupFewRows rows of x, where one linear per layer (the
// fused GEMV) costs less than concatenating the weights.
bool decode_rows(const Tensor& x) {
  return !torch::GradMode::is_enabled() && x.numel() <= kLinearGroupFewRows * x.size(-1);
}

// x through `layers` as one GEMM over their weights (and biases) concatenated, the output's rows padded
// to whole 16-byte pieces of bf16 (8 columns) with zero weight rows: cuBLAS takes its Hopper kernels
// only for 16-byte-aligned leading dimensions, and the forward GEMM writes, and both backward GEMMs
// read, this output with its row length as leading dim (lt2-gdn-100m's group, 3,468 columns, and
// Mamba2's in_proj, 3,212, otherwise run on sm80 CUTLASS kernels).
Tensor padded_linear(const Tensor& x, const std::vector<torch::nn::Linear>& layers) {
  constexpr int64_t kRowsMultiple = 8;
  return at::linear(x, cat_weights(layers, kRowsMultiple), cat_biases(layers, kRowsMultiple));
}
}  // namespace

std::vector<Tensor> linear_group(const Tensor& x, const std::vector<torch::nn::Linear>& layers, const Tensor& packed) {
  if (use_packed(packed)) return unpack_outputs(ops::linear(x, packed), layers);
  if (decode_rows(x)) {
    std::vector<Tensor> out;
    for (const auto& l : layers) out.push_back(ops::linear(x, l));
    return out;
  }
  return unpack_outputs(padded_linear(x, layers), layers);
}

std::vector<Tensor> linear_split(const Tensor& x, const torch::nn::Linear& layer, const std::vector<int64_t>& widths) {
  return split_columns(decode_rows(x) ? ops::linear(x, layer) : padded_linear(x, {layer}), widths);
}

namespace {
GemvFusion rms_norm_prologue(const Tensor& norm_weight, double eps) {
  GemvFusion norm;
  norm.norm_weight = norm_weight, norm.norm_eps = eps;
  return norm;
}
}  // namespace

Tensor normed_linear(const Tensor& x, const Tensor& w, const Tensor& norm_weight, double eps) {
  const auto norm = rms_norm_prologue(norm_weight, eps);
  return gemv_fused_applies(x, w, norm) ? gemv_fused(x, w, norm) : Tensor();
}

bool normed_linear_applies(const Tensor& x, const Tensor& w, const Tensor& norm_weight, double eps) {
  return gemv_fused_applies(x, w, rms_norm_prologue(norm_weight, eps));
}

Tensor gated_linear_residual(const Tensor& y, const torch::nn::Linear& layer, const Tensor& x_gate,
                             const Tensor& residual) {
  GemvFusion f;
  f.x_gate = x_gate, f.residual = residual;
  if (!layer->bias.defined() && gemv_fused_applies(y, layer->weight, f)) return gemv_fused(y, layer->weight, f);
  const auto out = ops::linear(x_gate.defined() ? ops::sigmoid_gate(y, x_gate) : y, layer);
  return residual.defined() ? residual + out : out;
}

Tensor swiglu(SwiGLUImpl& ffn, const Tensor& x) {
  // w1 and w3 as one GEMM (packed for inference, concatenated for this call under autograd), so
  // the gated product reads both halves of one output and returns their gradient as one tensor.
  return swiglu_down(ffn, use_packed(ffn.w13) ? ops::linear(x, ffn.w13) : at::linear(x, cat_weights({ffn.w1, ffn.w3})));
}

Tensor swiglu_down(SwiGLUImpl& ffn, const Tensor& gate_up) { return ops::linear(ops::silu_mul(gate_up), ffn.w2); }

Tensor swiglu_residual(SwiGLUImpl& ffn, const Tensor& h, const Tensor& norm_weight, double eps) {
  if (!use_packed(ffn.w13)) return {};
  const auto gate_up = ops::normed_linear(h, ffn.w13, norm_weight, eps);  // [..., 2 hidden]
  if (!gate_up.defined()) return {};
  GemvFusion silu_add;
  silu_add.silu_mul = true, silu_add.residual = h;
  if (!gemv_fused_applies(gate_up, ffn.w2->weight, silu_add)) return h + swiglu_down(ffn, gate_up);
  return gemv_fused(gate_up, ffn.w2->weight, silu_add);
}

// Up to `chained_tail_max_rows` the whole block tail (projection -> w1|w3 -> w2) is one chain;
// above it the chain stops before w2 and w2 is one more launch. w1|w3 applies silu(a) * b as its
// epilogue, so w2's x is hidden wide and computed once; at 8 rows a block staging that x for the
// third product holds 180 KB, which makes the 3-product chain the slower form there.
Tensor swiglu_residual(SwiGLUImpl& ffn, const PendingProjection& mixer, const Tensor& norm_weight,
                       double eps, int64_t chained_tail_max_rows) {
  if (mixer.layer->bias.defined() || !mixer.residual.defined() || !use_packed(ffn.w13)) return {};
  ChainProduct projection{mixer.layer->weight}, gate_up{ffn.w13}, down_proj{ffn.w2->weight};
  projection.fusion.x_gate = mixer.x_gate, projection.fusion.residual = mixer.residual;  // h
  gate_up.fusion.norm_weight = norm_weight, gate_up.fusion.norm_eps = eps;
  gate_up.silu_mul_out = true;     // silu(a) * b
  down_proj.residual_of = 0;       // h + ...
  if (mixer.y.size(0) <= chained_tail_max_rows) {
    const auto out = gemv_chain_fused(mixer.y, {projection, gate_up, down_proj});
    return out.empty() ? Tensor() : out[2];
  }
  const auto out = gemv_chain_fused(mixer.y, {projection, gate_up});  // {h, silu(a) * b}
  if (out.empty()) return {};
  GemvFusion add;
  add.residual = out[0];
  if (!gemv_fused_applies(out[1], ffn.w2->weight, add)) return out[0] + ops::linear(out[1], ffn.w2);
  return gemv_fused(out[1], ffn.w2->weight, add);
}

}  // namespace lt2::ops
