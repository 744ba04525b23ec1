// Decode steps of the recurrent families (one token per sequence, state updated in place):
// recurrent_step, the one entry point of the delta rule's and the gated linear recurrence's step,
// which takes the fused CUDA kernel (kernels/decode.h) where it applies and the libtorch step
// otherwise; and Gated DeltaNet's whole step after its projections as one kernel. The kernel entry
// points check their inputs, launch on the current CUDA stream and take their outputs from the
// caching allocator; nothing synchronises or reads device memory on the host, so a CUDA graph can
// capture them. Without CUDA kernels in the build (LT2_CUDA=OFF) they throw.
#pragma once
#include <torch/torch.h>

#include "lt2/kernels/decode.h"

namespace lt2::ops {

using torch::Tensor;

// One decode token of the recurrence family: q, k [B, H, K], v [B, H, V], beta [B, H] (the delta
// rule) or undefined (the gated linear recurrence), g undefined / [B, H] / [B, H, K] (log decay),
// state [B, H, K, V] updated in place. Returns o [B, H, V] in v's dtype: recurrent_step_fused
// where fused_decode_enabled() and recurrent_step_fused_supported, else delta_rule_step or
// gated_linear_step.
Tensor recurrent_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                      double scale, Tensor& state);

// The kernel of recurrent_step: q, k, v in bf16, fp16 or fp32 with their last dim contiguous,
// state fp32 contiguous on their CUDA device.
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
// Whether a GDN layer's decode step takes gdn_decode_fused: the fused kernels are enabled
// (fused_decode_enabled), no CUDA autocast is active (the kernel reads its inputs in their own
// dtype), and the layer input x, its state, a conv window and A_log are what the kernel takes
// (x, the window and A_log of one kernel dtype on x's CUDA device, the state fp32 contiguous
// there, head_k_dim within the kernel's limit). The layer decides this before its projections.
bool gdn_decode_applies(const Tensor& x, const Tensor& state, const Tensor& conv_window, const Tensor& A_log,
                        int64_t head_k_dim);

}  // namespace lt2::ops
