// Rotary position embedding in both conventions.
//   Interleaved (Lingua / LT2): pairs (x[2i], x[2i+1]) rotate by angle pos * theta^(-2i/D).
//   Half (HF Llama / Ouro):     pairs (x[i], x[i + D/2]) rotate by the same angles.
#pragma once
#include <torch/torch.h>

#include "lt2/config/model_config.h"
#include "lt2/nn/positions.h"

namespace lt2 {

using torch::Tensor;

// x: [B, T, H, D]; positions start..start+T-1 (the same for every sequence). Angles in float64,
// returned in x's dtype.
Tensor apply_rope(const Tensor& x, int64_t start, double theta, RopeStyle style);

// x: [B, T, H, D]; positions [B, T] int64 on x's device (each sequence its own positions: the
// engine's decode). Same angles and rounding as the form above; no host read of the positions.
Tensor apply_rope(const Tensor& x, const Tensor& positions, double theta, RopeStyle style);

// The positions of a mixer call (nn/positions.h): start.. for every sequence, seq_pos[b] (T == 1), or
// with packed documents each token's position inside its document.
Tensor apply_rope(const Tensor& x, const Positions& pos, double theta, RopeStyle style);

}  // namespace lt2
