// The decode GEMV forms of the projections (kernels/decode.h): y = f(x) W^T for a few rows with
// elementwise work folded in (gemv_fused), chains of dependent products in one persistent kernel
// (gemv_chain_fused), and batches of independent products (gemv_batched). ops::linear and the
// block's decode forms (projections.h) dispatch to them; the *_applies queries say whether the
// decode path takes them (the fused kernels on, no gradient recorded, shapes the kernels take).
// Every entry point launches on the current CUDA stream and takes its outputs from the caching
// allocator, so a CUDA graph can capture it; without CUDA kernels in the build (LT2_CUDA=OFF) they
// throw, or (gemv_chain_fused) run nothing.
#pragma once
#include <torch/torch.h>

#include <vector>

namespace lt2::ops {

using torch::Tensor;

// Elementwise work folded into gemv_fused (kernels::gemv has the math).
struct GemvFusion {
  Tensor norm_weight;     // defined: RMSNorm prologue, y = rms_norm(x, norm_weight, norm_eps) W^T
  double norm_eps = 1e-5;
  bool silu_mul = false;  // x = [a | b] [..., 2K]: y = (silu(a) * b) W^T (SwiGLU's w2)
  Tensor x_gate;          // defined: y = (x * sigmoid(x_gate)) W^T, x_gate [..., K] (attention's output gate)
  Tensor residual;        // defined: y = residual + ..., [..., N]
  int k_splits = 0;       // K split over a thread-block cluster: 0 picks (kernels::gemv_k_splits)
};
// y = f(x) W^T (nn.Linear without bias) through the fused GEMV: x [..., K] ([..., 2K] with
// silu_mul) with at most kernels::kGemvMaxRows rows, W [N, K] contiguous, every tensor in one
// kernel dtype on one CUDA device. Returns [..., N] in x's dtype. Products up to 128 MB without
// silu_mul run as a one-product gemv_chain_fused where it takes them (measured faster), the rest
// on the GEMV kernel.
Tensor gemv_fused(const Tensor& x, const Tensor& w, const GemvFusion& fusion = {});
// Whether the decode path takes gemv_fused: the fused kernels are on, no gradient is recorded,
// x and W are CUDA tensors of one kernel dtype with a contiguous last dim, the GEMV takes the
// shapes, and DecodeOptions::fused_gemv is on (at::linear and the unfused elementwise ops
// otherwise: an A/B switch).
bool gemv_fused_applies(const Tensor& x, const Tensor& w, const GemvFusion& fusion = {});

// One product of a chain run by gemv_chain_fused: y_i = f_i(x_i) W_i^T (+ residual), x_0 the
// chain's x and x_i (i > 0) product i - 1's output.
struct ChainProduct {
  ChainProduct() = default;
  explicit ChainProduct(Tensor weight) : w(std::move(weight)) {}
  Tensor w;             // [N, K] contiguous, as gemv_fused's
  GemvFusion fusion;    // as gemv_fused's (k_splits 0)
  int residual_of = -1;  // >= 0: the residual is that earlier product's output (fusion.residual undefined)
  // SwiGLU's silu(a) * b as the epilogue: W = [W_a; W_b] (packed w1|w3), a = f(x) W_a^T and
  // b = f(x) W_b^T in fp32, y [..., N / 2] = silu(a) * b rounded once; no residual. The next
  // product (w2) then reads a plain x half as wide as [a | b] (the chain stages it per block).
  bool silu_mul_out = false;
};
// The products in one persistent kernel (kernels::gemv_chain): the next products' weights stream
// in while a product finishes, instead of one launch each with its ramp and tail. Returns every
// product's output ([..., N_i] like x), or nothing, having run nothing, when the chain kernel does
// not take these tensors (what gemv_fused takes, sm_90, bf16 / fp16, x rows within shared memory)
// or DecodeOptions::gemv_chain is off: the caller then runs the products one by one.
std::vector<Tensor> gemv_chain_fused(const Tensor& x, const std::vector<ChainProduct>& products);

// J independent products in one launch (kernels::gemv's batch): out[:, j] = x[:, j] W[j]^T, times
// sigmoid(gate[:, j]) when gate is defined (an attention output gate). x [M, J, K] with at most
// kernels::kGemvMaxRows rows M (any strides, copied when its rows are not contiguous and 16-byte
// aligned), W [J, N, K] contiguous, gate and out [M, J, N] with a contiguous last dim (out is
// written in place: it may be a view into a larger tensor), every tensor in one kernel dtype on one
// CUDA device. The DSA latent form's absorptions q_nope W_uk and o W_uv (per-head weights).
void gemv_batched(const Tensor& x, const Tensor& w, const Tensor& out, const Tensor& gate = {});
// Whether the decode path takes gemv_batched for x and W (and gate): the fused kernels are on, no
// gradient is recorded, x and W are CUDA tensors of one kernel dtype with a contiguous last dim,
// and the shapes fit; x's layout does not matter.
bool gemv_batched_applies(const Tensor& x, const Tensor& w, const Tensor& gate = {});

}  // namespace lt2::ops
