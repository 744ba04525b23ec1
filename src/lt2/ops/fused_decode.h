// Fused CUDA decode kernels (kernels/decode.h) for tensors: checks, launch on the current CUDA
// stream, outputs from the caching allocator. Nothing here synchronises or reads device memory on
// the host, so a CUDA graph can capture every entry point. Without CUDA kernels in the build
// (LT2_CUDA=OFF) the entry points throw; fused_decode_enabled() is then false, so the mixers never
// call them.
#pragma once
#include <torch/torch.h>

#include "lt2/kernels/decode.h"

namespace lt2 {

// Whether the decode paths take the fused kernels: DecodeOptions::fused of the options in force
// (ops/decode_options.h), and false in a build without the CUDA kernels.
bool fused_decode_enabled();
// True when this build has the CUDA kernels.
bool fused_decode_available();

namespace ops {

using torch::Tensor;

// One decode token of the recurrence family, the fused form of delta_rule_step (beta defined)
// and gated_linear_step (beta undefined): q, k [B, H, K], v [B, H, V] (bf16, fp16 or fp32; their
// last dim contiguous), beta [B, H], g undefined / [B, H] / [B, H, K] (log decay), state
// [B, H, K, V] fp32 contiguous, updated in place. Returns o [B, H, V] in v's dtype.
Tensor recurrent_step_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                            const Tensor& g, double scale, Tensor& state);
// Whether recurrent_step_fused takes these inputs (CUDA, dtypes, fp32 state, K limit).
bool recurrent_step_fused_supported(const Tensor& q, const Tensor& v, const Tensor& state);

// Gated DeltaNet's decode step after the input projections (kernels::gdn_decode has the math).
// Tensors of the new token are [B, channels] (the [B, 1, channels] projections squeezed); every
// non-state tensor has the activation dtype (bf16, fp16 or fp32). One value head per q/k head.
struct GdnDecodeArgs {
  Tensor q, k, v;           // [B, H*K], [B, H*K], [B, H*V]: projections before the short convs
  Tensor a, b;              // [B, H]: a_proj, b_proj outputs
  Tensor gate;              // [B, H*V]: g_proj output, or undefined (no output gate)
  Tensor q_conv_weight, k_conv_weight, v_conv_weight;  // [C, 1, W] (nn.Conv1d layout), no bias
  Tensor A_log, dt_bias;    // [H]
  Tensor norm_weight;       // [V]
  int64_t num_heads = 0, head_k_dim = 0, head_v_dim = 0;
  double scale = 1.0, norm_eps = 1e-5;
  bool allow_neg_eigval = false;
  kernels::GdnDecodeForm form = kernels::GdnDecodeForm::Auto;  // tests and benchmarks pick one
  // The kernel launched just before this step is the caller's projection, which does not write
  // the state (kernels::GdnDecodeParams::state_settled; DecodeOptions::gdn_early_state off ignores it).
  bool state_settled = false;
};
// Advances state ([B, H, K, V] fp32) and the conv windows ([B, W-1, C], activation dtype) in
// place; returns y [B, H*V] (the swish-gated RMSNorm output, ready for o_proj).
Tensor gdn_decode_fused(const GdnDecodeArgs& args, Tensor& state, Tensor& q_window, Tensor& k_window,
                        Tensor& v_window);
// Whether gdn_decode_fused takes activations `x` with this state and key head dim.
bool gdn_decode_fused_supported(const Tensor& x, const Tensor& state, int64_t head_k_dim);

// Flash-decoding: q [B, Hq, D] (one new token per sequence), k_cache / v_cache [B, Hkv, L, D] in
// q's dtype (Hq a multiple of Hkv; last dim contiguous, rows 16-byte aligned), seq_lens [B] int64
// on q's device (keys 0..len-1 of sequence b are attended, 1 <= len <= L). Returns [B, Hq, D].
// The number of key splits depends only on the shapes, so a captured graph replays with new
// lengths.
Tensor attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& seq_lens, double scale);
// Whether attention_decode takes these inputs (CUDA, dtype, head dim 64/128/256, at most 8 query
// heads per kv head, aligned cache rows).
bool attention_decode_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache);

// Attention's decode prologue in one launch (kernels::rope_cache_write has the math): q [B, H, D]
// and k, v [B, H_kv, D] of the new token (views with contiguous rows, e.g. of a packed projection),
// RoPE'd at positions seq_pos [B] (int64, on their device); k and v go into k_cache / v_cache
// [B, H_kv, L, D] (last dim contiguous) at row seq_pos[b]. Returns the rotated q [B, H, D].
// Every tensor but seq_pos in one kernel dtype on one CUDA device.
Tensor rope_cache_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& seq_pos, double theta, bool interleaved);
// Whether rope_cache_write takes these tensors (what the comment above asks).
bool rope_cache_write_supported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& seq_pos);

// Elementwise kernels of a block's decode path. They are taken when fused_elementwise_applies:
// the switch is on, no gradient is recorded (no autograd graph through them) and `tensors` are
// CUDA tensors of one kernel dtype and device with a contiguous last dim.
bool fused_elementwise_applies(const std::vector<Tensor>& tensors);

// RMSNorm in fp32 of x [..., d] with weight [d] (x's dtype): x * rsqrt(mean(x^2) + eps) * weight,
// returned in x's dtype. Same math as rms_norm (model/layers.h) without its dtype casts.
Tensor rms_norm_fused(const Tensor& x, const Tensor& weight, double eps);
// A residual add and the RMSNorm of its result in one kernel: h = x + m in x's dtype (as the
// unfused add) and y = rms_norm_fused(h, weight, eps). x, m [..., d] of one dtype.
struct AddRmsNormResult {
  Tensor h, y;
};
AddRmsNormResult add_rms_norm_fused(const Tensor& x, const Tensor& m, const Tensor& weight, double eps);

// SwiGLU's silu(a) * b on gate_up [..., 2 hidden] = [a | b] (the packed w1|w3 output). Returns
// [..., hidden] in gate_up's dtype, silu(a) rounded to it before the product as in the unfused form.
Tensor silu_mul_fused(const Tensor& gate_up);

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
// Whether the decode path takes gemv_fused: fused_elementwise_applies to every tensor, the GEMV
// takes the shapes, and DecodeOptions::fused_gemv is on (at::linear and the unfused
// elementwise ops then: an A/B switch).
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
// Whether gemv_batched takes x and W (and gate): fused_elementwise_applies to them and the shapes
// fit; x's layout does not matter.
bool gemv_batched_applies(const Tensor& x, const Tensor& w, const Tensor& gate = {});

}  // namespace ops
}  // namespace lt2
