// Rotary position embedding of the mixers' activations in training and prefill. apply_rope is the
// entry point the mixers call: one CUDA kernel forward and one backward (kernels/prefill.h:
// rope_apply) where it applies, the nn/ reference (nn/rope.h) otherwise, so CPU runs and the paths
// the kernel does not take are the reference's.
#pragma once
#include <torch/torch.h>

#include "lt2/config/model_config.h"
#include "lt2/nn/positions.h"

namespace lt2::ops {

using torch::Tensor;

// RoPE of x [B, T, H, D] at the positions of pos, in the pair layout of `style` (nn/rope.h has the
// math). The kernel where rope_kernel_applies: the angle in float64 and the rotation in fp32 with one
// rounding (the reference rounds its tables and each product to x's dtype); under autograd its
// backward is the inverse rotation of the gradient, one more launch, and nothing of x is saved.
// Returns a packed [B, T, H, D] tensor in x's dtype there, and lt2::apply_rope's result otherwise.
Tensor apply_rope(const Tensor& x, const Positions& pos, double theta, RopeStyle style);

// RoPE of the first n dims (even) of x's last axis [B, T, H, D], the rest as they are. Where the
// kernel applies: without a gradient for x, x's prefix is rotated in place and x returned (the
// caller hands over a tensor it owns: a fresh projection); under autograd a new tensor, the prefix
// rotated into it and the rest copied, with a backward of the same two passes. Otherwise a new
// tensor: the prefix rotated by apply_rope, the rest concatenated after it.
Tensor apply_rope_prefix_(const Tensor& x, int64_t n, const Positions& pos, double theta, RopeStyle style);

// Whether apply_rope takes the kernel: DecodeOptions::rope on, x a [B, T, H, D] CUDA tensor of a
// kernel dtype with a contiguous last dim, D even and at most 512, positions start.. shared by every
// sequence (no packed documents, no per-sequence positions).
bool rope_kernel_applies(const Tensor& x, const Positions& pos);

}  // namespace lt2::ops
