// Training objectives (LT2: the last loop; Ouro: the loop exits).
#pragma once
#include <torch/torch.h>

#include "lt2/model/looped_lm.h"
#include "lt2/ops/loss/lm_head_loss.h"

namespace lt2 {

using torch::Tensor;

// Mean next-token cross-entropy in accum_dtype (fp32; float64 stays float64). logits: [B, T, V],
// targets: [B, T].
Tensor cross_entropy(const Tensor& logits, const Tensor& targets);
// Per-token cross-entropy [B, T] in accum_dtype.
Tensor token_cross_entropy(const Tensor& logits, const Tensor& targets);

// How the LM loss runs: fused (the chunked head + cross-entropy of ops/loss/lm_head_loss.h, which
// never holds the [tokens x vocab] logits) or the reference (the model's logits, then
// cross_entropy).
struct LmLossOptions {
  bool fused = true;
  ops::HeadLossOptions head;
};

// Mean next-token cross-entropy of `model` on tokens [B, T] against targets [B, T]: the forward
// (with `fo`) and the loss. Fused where asked for and where the model's logits are its head applied
// to its hidden state (LoopedLMImpl::logits_from_hidden); the reference otherwise.
Tensor lm_cross_entropy(LoopedLMImpl& model, const Tensor& tokens, const Tensor& targets, ForwardOptions fo,
                        const LmLossOptions& opts);

// Ouro stage 1: mean over tokens of sum_t p_t * CE_t - beta * H(p). Needs out.loop_logits and
// out.exit_probs.
Tensor ouro_loss(const ModelOutput& out, const Tensor& targets, double entropy_beta);

// Ouro stage 2 (gate only): per token and loop t < T, the gate's exit probability lambda_t is
// trained (binary cross-entropy) toward "stop" when the next loop lowers that token's CE by at
// most `min_gain`, toward "continue" otherwise. Losses of the loops are detached.
Tensor ouro_gate_loss(const ModelOutput& out, const Tensor& targets, double min_gain);

}  // namespace lt2
