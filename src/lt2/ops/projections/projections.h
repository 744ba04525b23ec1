// Projections and the FFN with their dispatch: the fused decode GEMV forms (gemv.h) where they
// apply to the inputs (decode: few rows, no gradient, fused kernels on), the reference math of nn/
// otherwise. Callers never choose the path themselves.
#pragma once
#include <torch/torch.h>

#include "lt2/nn/linear.h"
#include "lt2/nn/norm.h"
#include "lt2/nn/swiglu.h"

namespace lt2 {
namespace ops {

// x W^T with W [out, in] (no bias): the fused GEMV at decode, at::linear otherwise; the layer form
// takes its weight and bias.
Tensor linear(const Tensor& x, const Tensor& weight);
Tensor linear(const Tensor& x, const torch::nn::Linear& layer);
// x through `layers` that all read it, as one GEMM whose outputs are column slices (in the order
// of `layers`): by `packed` where inference packed them (use_packed; bias-free layers), else by
// their weights (and biases) concatenated for this call. Under autograd that is one GEMM forward
// and one for x's gradient, where a GEMM per layer would also cast x under autocast once per layer
// and add the layers' gradients of x. Without a gradient and with at most kLinearGroupFewRows rows of x (a
// decode step whose weights were not packed), one linear each: concatenating the weights would
// cost more than the products, which read each weight once either way.
constexpr int64_t kLinearGroupFewRows = 64;
std::vector<Tensor> linear_group(const Tensor& x, const std::vector<torch::nn::Linear>& layers, const Tensor& packed);
// x through one layer whose output's columns are split into blocks of `widths` (summing to its
// outputs), one split (split_columns): its weight padded as linear_group pads a group's (16-byte-aligned
// output rows for cuBLAS's Hopper GEMMs), or at a decode step (linear_group's few rows) the layer itself.
std::vector<Tensor> linear_split(const Tensor& x, const torch::nn::Linear& layer, const std::vector<int64_t>& widths);

// The two ends of a pre-norm block's decode half with their elementwise work folded into the
// fused GEMV (gemv_fused), as the mixers' and the FFN's residual forms use them:
//   normed_linear          rms_norm(x, norm_weight, eps) W^T (x [..., K]; norm_weight undefined:
//                          x W^T); undefined where the fused GEMV does not take them
//                          (normed_linear_applies), so the caller runs its unfused path.
//   gated_linear_residual  residual + (y * sigmoid(x_gate)) W^T (y, x_gate [..., K], residual
//                          [..., d]; either undefined: left out), one fused GEMV where it applies,
//                          at::linear and elementwise ops otherwise.
Tensor normed_linear(const Tensor& x, const Tensor& w, const Tensor& norm_weight, double eps);
bool normed_linear_applies(const Tensor& x, const Tensor& w, const Tensor& norm_weight, double eps);
Tensor gated_linear_residual(const Tensor& y, const torch::nn::Linear& layer, const Tensor& x_gate,
                             const Tensor& residual);

}  // namespace ops

// A decode half's output projection, not yet run: gated_linear_residual(y, layer, x_gate,
// residual) (y [B, K], residual [B, d] or undefined), left to the block so it can run it in one
// kernel with the FFN's products (ops::swiglu_residual).
struct PendingProjection {
  Tensor y;
  torch::nn::Linear layer{nullptr};
  Tensor x_gate, residual;
  Tensor run() const { return ops::gated_linear_residual(y, layer, x_gate, residual); }
};

namespace ops {

// The FFN on x: the packed w1|w3 product (one GEMV at decode) once SwiGLUImpl::pack ran and no
// gradient is recorded, the module's reference form otherwise.
Tensor swiglu(SwiGLUImpl& ffn, const Tensor& x);
// w2(silu(a) * b) of the packed w1|w3 output [..., 2 hidden] = [a | b].
Tensor swiglu_down(SwiGLUImpl& ffn, const Tensor& gate_up);
// The pre-norm block's second half, h + ffn(rms_norm(h, norm_weight, eps)), at decode with the
// norm folded into the packed w1|w3 GEMV and silu * mul and the add into w2's (gemv_fused).
// Undefined when those GEMVs do not take the inputs (not packed, too many rows, gradients, ...)
// before anything ran: the caller runs the unfused form.
Tensor swiglu_residual(SwiGLUImpl& ffn, const Tensor& h, const Tensor& norm_weight, double eps);
// The same from the mixer's pending output projection: h + ffn(rms_norm(h)) with h = mixer.run(),
// [B, d]: up to `chained_tail_max_rows` rows the three products (the projection, w1|w3, w2) in one
// chained kernel (gemv_chain_fused), above that the first two chained and w2 as one GEMV.
// Undefined, having run nothing, where the chain does not apply: the caller runs mixer.run() and
// the form above.
Tensor swiglu_residual(SwiGLUImpl& ffn, const PendingProjection& mixer, const Tensor& norm_weight,
                       double eps, int64_t chained_tail_max_rows);

}  // namespace ops
}  // namespace lt2
