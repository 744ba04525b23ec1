// The elementwise ops of a block: RMSNorm, a residual add with the RMSNorm of its sum, and
// SwiGLU's activation silu(a) * b. Each entry point takes its fused CUDA kernel (kernels/decode.h)
// where one applies (fused kernels on, no gradient recorded, CUDA tensors of one kernel dtype with
// a contiguous last dim) and the reference math of nn/ otherwise, so callers never choose the path.
// The kernel entry points (*_fused) launch on the current CUDA stream and take their outputs from
// the caching allocator, so a CUDA graph can capture them; without CUDA kernels in the build
// (LT2_CUDA=OFF) they throw.
#pragma once
#include <torch/torch.h>

#include "lt2/nn/norm.h"

namespace lt2::ops {

using torch::Tensor;

// RMSNorm of x with the module's weight: one fused launch with no casts where it applies; under
// autograd the row-norm kernels forward and backward where they apply (see gated_rms_norm).
Tensor rms_norm(const Tensor& x, const RMSNorm& norm);

// The same norm of x whose output only feeds products (linear layers): under CUDA bf16 autocast
// with fp32 x (training), the row-norm kernels write it in bf16, the dtype autocast casts it to for
// each product (one bf16 write forward and one bf16 read backward, where the fp32 output took a cast
// pass each way; DecodeOptions::norm_products_dtype); rms_norm above otherwise. The values are
// those of the cast: the kernel rounds its fp32 result once.
Tensor rms_norm_for_products(const Tensor& x, const RMSNorm& norm);

// h = x + m in x's dtype and y = RMSNorm of h with the module's weight.
struct AddRmsNormResult {
  Tensor h, y;
};
// One fused launch for both where it applies to x, m (of x's sizes) and the weight; under autograd
// the row-norm kernels with a residual add, forward and backward (DecodeOptions::residual_norm: m of
// x's dtype or bf16 with fp32 x, y in bf16 with for_products where rms_norm_for_products writes
// bf16); the add and rms_norm above otherwise (rms_norm_for_products with for_products).
AddRmsNormResult add_rms_norm(const Tensor& x, const Tensor& m, const RMSNorm& norm, bool for_products = false);

// The gated products, differentiable, in training, prefill and decode: one CUDA kernel forward and
// one backward (kernels/prefill.h: gated_product_*) where it applies (CUDA tensors of one kernel
// dtype with a contiguous last dim, DecodeOptions::gated_product on, and `fused` on where no
// gradient is taken), the libtorch ops otherwise.
// silu(a) * b of gate_up [..., 2 hidden] = [a | b] (the packed w1|w3 output): [..., hidden]; its
// gradient is one [..., 2 hidden] tensor.
Tensor silu_mul(const Tensor& gate_up);
// y * sigmoid(gate) (attention's SDPA output gate), y and gate [..., n] of one dtype.
Tensor sigmoid_gate(const Tensor& y, const Tensor& gate);
// y * silu(gate) (Mamba2's gate before its norm), y and gate [..., n] of one dtype.
Tensor silu_gate(const Tensor& y, const Tensor& gate);
// sum_i sigmoid(logits[..., i]) * branches[i] (NSA's combination of its branches), logits [B, T, H, n]
// and n branches [B, T, H, D]: one CUDA kernel forward and one backward (kernels/prefill.h: gated_sum_*,
// fp32 inside, rounded once) where DecodeOptions::gated_sum is on and they apply as for the gated products
// (the branches read in place with any token and head strides, D in whole 16-byte pieces, at most 4
// branches), the libtorch ops otherwise (any sizes, logits [..., n] broadcast over the branches' last dim).
Tensor sigmoid_gated_sum(const Tensor& logits, const std::vector<Tensor>& branches);

// The linear mixers' norms, differentiable, in training and prefill alike. Both compute in fp32
// (fp64 for fp64 input) and return x's dtype; on CUDA each is one fused kernel forward and one
// backward (kernels/prefill.h: row_norm) where it applies (a kernel dtype, last dim <= 4096, a
// weight [d], a gate of x's sizes, DecodeOptions::row_norm on), the reference math otherwise.
enum class GateActivation { None, Swish, Sigmoid };
// RMSNorm over the last dim times weight, then times act(gate) (fla's FusedRMSNormGated:
// y = norm(x) * w * act(gate)); gate undefined means no gate. weight [d], or [G, d] for a
// per-group gain on x [..., G, d] (the reference path where G > 1).
Tensor gated_rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& gate, GateActivation act);
// x / sqrt(sum(x^2) + 1e-6) over the last dim (fla's l2norm).
Tensor l2_normalize(const Tensor& x);

// The kernels. RMSNorm in fp32 of x [..., d] with weight [d] (x's dtype): x * rsqrt(mean(x^2) +
// eps) * weight, returned in x's dtype; the same math as nn's rms_norm without its dtype casts.
Tensor rms_norm_fused(const Tensor& x, const Tensor& weight, double eps);
// A residual add and the RMSNorm of its result in one kernel: h = x + m in x's dtype (as the
// unfused add) and y = rms_norm_fused(h, weight, eps). x, m [..., d] of one dtype.
AddRmsNormResult add_rms_norm_fused(const Tensor& x, const Tensor& m, const Tensor& weight, double eps);
// silu(a) * b on gate_up [..., 2 hidden] in gate_up's dtype, silu(a) rounded to it before the
// product as in the unfused form.
Tensor silu_mul_fused(const Tensor& gate_up);

}  // namespace lt2::ops
