// Building blocks shared by mixers and blocks: initialised linear layers, RMSNorm (fp32), SwiGLU.
#pragma once
#include <torch/torch.h>

#include "lt2/config/model_config.h"

namespace lt2 {

using torch::Tensor;

// The dtype for numerically sensitive math (norms, gates, cumulative sums, RoPE angles): fp32 for
// low-precision inputs, float64 kept as is (so float64 tests check the exact math).
inline torch::ScalarType accum_dtype(const Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// x W^T with W [out, in] (no bias). At decode (few rows, no gradient, fused kernels on, CUDA) the
// fused GEMV (ops/fused_decode.h), otherwise at::linear; the layer form takes its weight and bias.
Tensor apply_linear(const Tensor& x, const Tensor& weight);
Tensor apply_linear(const Tensor& x, const torch::nn::Linear& layer);

// The two ends of a pre-norm block's decode half with their elementwise work folded into the
// fused GEMV (ops::gemv_fused), as the mixers' and SwiGLU's step_residual forms use them:
//   normed_linear          rms_norm(x, norm_weight, eps) W^T (x [..., K]; norm_weight undefined:
//                          x W^T); undefined where the fused GEMV does not take them, so the
//                          caller runs its unfused path.
//   gated_linear_residual  residual + (y * sigmoid(x_gate)) W^T (y, x_gate [..., K], residual
//                          [..., d]; either undefined: left out), one fused GEMV where it applies,
//                          at::linear and elementwise ops otherwise.
Tensor normed_linear(const Tensor& x, const Tensor& w, const Tensor& norm_weight, double eps);
Tensor gated_linear_residual(const Tensor& y, const torch::nn::Linear& layer, const Tensor& x_gate,
                             const Tensor& residual);

// A decode half's output projection, not yet run: gated_linear_residual(y, layer, x_gate,
// residual) (y [B, K], residual [B, d] or undefined), left to the block so it can run it in one
// kernel with the FFN's products (SwiGLU::forward_residual's PendingProjection form). An
// undefined layer (done()) means y is already the result.
struct PendingProjection {
  Tensor y;
  torch::nn::Linear layer{nullptr};
  Tensor x_gate, residual;
  static PendingProjection done(Tensor result) { return {std::move(result), nullptr, {}, {}}; }
  Tensor run() const { return layer ? gated_linear_residual(y, layer, x_gate, residual) : y; }
};

// Truncated normal N(0, std) cut at +-3 std, in place (LT2/Lingua initialisation).
void trunc_normal_(Tensor w, double std);

// A bias-free linear layer initialised with trunc_normal_(std); std 0 means zero-initialised
// (SDPA output gate, rho).
torch::nn::Linear make_linear(int64_t in, int64_t out, double std, bool bias = false);

// Inference packing of bias-free Linear layers that read the same input: their weights are
// concatenated along the output dim into one [sum(out), in] matrix, and each layer's weight
// becomes a view of its row block (same values, no second copy), so one GEMM (a single GEMV at
// decode) computes every output. Returns the packed weight.
Tensor pack_linears(const std::vector<torch::nn::Linear>& layers);
// The output blocks of at::linear(x, packed) in the order of `layers` (views along the last dim).
std::vector<Tensor> unpack_outputs(const Tensor& y, const std::vector<torch::nn::Linear>& layers);
// Whether a packed weight may be used now: defined, and no gradient being recorded (the packed
// tensor is not a parameter).
inline bool use_packed(const Tensor& packed) { return packed.defined() && !torch::GradMode::is_enabled(); }

// RMSNorm computed in fp32 whatever the input dtype: y = w * x / sqrt(mean(x^2) + eps).
// Output has the input's dtype. Weight init ones (Ouro's convention: w * x_hat, no 1 + w).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  Tensor forward(const Tensor& x);  // x: [..., dim]
  Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Functional RMSNorm over the last dim in fp32 (weight: [dim], broadcastable to x, or undefined).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);

// SwiGLU FFN: w2(silu(w1 x) * w3 x). Names follow Lingua (w1 gate, w3 up, w2 down).
class SwiGLUImpl : public torch::nn::Module {
 public:
  SwiGLUImpl(int64_t dim, int64_t hidden, double std);
  Tensor forward(const Tensor& x);  // [..., dim] -> [..., dim]
  void pack();                      // inference: w1 and w3 in one matrix (pack_linears)
  // The pre-norm block's second half, h + forward(rms_norm(h, norm_weight, eps)), at decode with
  // the norm folded into the packed w1|w3 GEMV and silu * mul and the add into w2's
  // (ops::gemv_fused). Undefined when those GEMVs do not take the inputs (not packed, too many
  // rows, gradients, ...) before anything ran: the caller runs the unfused form.
  Tensor forward_residual(const Tensor& h, const Tensor& norm_weight, double eps);
  // The same from the mixer's pending output projection: h + forward(rms_norm(h)) with
  // h = mixer.run(), [B, d]: up to 4 rows the three products (the projection, w1|w3, w2) in one
  // chained kernel (ops::gemv_chain_fused), above that the first two chained and w2 as one GEMV
  // (layers.cpp has the measurements). Undefined, having run nothing, where the chain does not
  // apply: the caller runs mixer.run() and the form above.
  Tensor forward_residual(const PendingProjection& mixer, const Tensor& norm_weight, double eps);
  // w2(silu(a) * b) of the packed w1|w3 output [..., 2 hidden] = [a | b].
  Tensor down(const Tensor& gate_up);
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
  Tensor w13;                       // packed [2 hidden, dim], or undefined
};
TORCH_MODULE(SwiGLU);

}  // namespace lt2
