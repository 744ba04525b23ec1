// Rotary position embedding in both conventions.
//   Interleaved (Lingua / LT2): pairs (x[2i], x[2i+1]) rotate by angle pos * theta^(-2i/D).
//   Half (HF Llama / Ouro):     pairs (x[i], x[i + D/2]) rotate by the same angles.
#pragma once
#include <torch/torch.h>

#include "lt2/config/model_config.h"

namespace lt2 {

using torch::Tensor;

// x: [B, T, H, D]; positions start..start+T-1 (the same for every sequence). Angles in float64,
// returned in x's dtype.
Tensor apply_rope(const Tensor& x, int64_t start, double theta, RopeStyle style);

}  // namespace lt2
