// Short causal depthwise convolution (fla ShortConvolution / Mamba's conv1d):
//   y_t[c] = act( bias[c] + sum_{w=0}^{W-1} weight[c, 0, w] * x_{t-W+1+w}[c] )
// with x_{<0} taken from a window of the W-1 inputs before the call (zeros for a fresh
// sequence), so prefill in pieces and token-by-token decode match one call over the whole input.
#pragma once
#include <torch/torch.h>

namespace lt2::ops {

using torch::Tensor;

// x: [B, T, C]; weight: [C, 1, W] (the nn.Conv1d layout); bias: [C] or undefined.
// window: nullptr (fresh sequence, zeros before the first token) or a [B, W-1, C] tensor of the
// previous inputs, read and then overwritten in place with the last W-1 inputs (older ones first).
// offsets: undefined, or [B, T] int64, each token's position inside its packed document
// (PackedDocuments::offsets): tap x_{t-j} is left out where j > offsets[t], so no output reads
// another document. Only without a window. Returns y: [B, T, C] in x's dtype.
Tensor short_conv(const Tensor& x, const Tensor& weight, const Tensor& bias, bool silu,
                  Tensor* window = nullptr, const Tensor& offsets = {});

}  // namespace lt2::ops
