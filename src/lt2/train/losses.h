// Training objectives (LT2: the last loop; Ouro: the loop exits).
#pragma once
#include <torch/torch.h>

#include "lt2/model/looped_lm.h"

namespace lt2 {

using torch::Tensor;

// Mean next-token cross-entropy in fp32. logits: [B, T, V], targets: [B, T].
Tensor cross_entropy(const Tensor& logits, const Tensor& targets);
// Per-token cross-entropy [B, T] in fp32.
Tensor token_cross_entropy(const Tensor& logits, const Tensor& targets);

// Ouro stage 1: mean over tokens of sum_t p_t * CE_t - beta * H(p). Needs out.loop_logits and
// out.exit_probs.
Tensor ouro_loss(const ModelOutput& out, const Tensor& targets, double entropy_beta);

// Ouro stage 2 (gate only): per token and loop t < T, the gate's exit probability lambda_t is
// trained (binary cross-entropy) toward "stop" when the next loop lowers that token's CE by at
// most `min_gain`, toward "continue" otherwise. Losses of the loops are detached.
Tensor ouro_gate_loss(const ModelOutput& out, const Tensor& targets, double min_gain);

}  // namespace lt2
