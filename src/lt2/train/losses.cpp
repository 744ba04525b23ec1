#include "lt2/train/losses.h"

#include "lt2/nn/linear.h"  // accum_dtype
#include "lt2/util/error.h"

namespace lt2 {

Tensor token_cross_entropy(const Tensor& logits, const Tensor& targets) {
  const auto V = logits.size(-1);
  auto ce = torch::nn::functional::cross_entropy(
      logits.reshape({-1, V}).to(accum_dtype(logits)), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  return ce.view(targets.sizes());
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets) {
  const auto V = logits.size(-1);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, V}).to(accum_dtype(logits)),
                                              targets.reshape({-1}));
}

Tensor lm_cross_entropy(LoopedLMImpl& model, const Tensor& tokens, const Tensor& targets, ForwardOptions fo,
                        const LmLossOptions& opts) {
  const bool fused = opts.fused && model.logits_from_hidden(fo);
  fo.compute_logits = !fused;
  const auto out = model.forward(tokens, nullptr, fo);
  return fused ? ops::lm_head_cross_entropy(out.hidden, model.head_weight(), targets, opts.head)
               : cross_entropy(out.logits, targets);
}

Tensor ouro_loss(const ModelOutput& out, const Tensor& targets, double entropy_beta) {
  LT2_CHECK(!out.loop_logits.empty() && out.exit_probs.defined(),
            "the Ouro objective needs a model with an exit gate and per-loop logits");
  std::vector<Tensor> ce;
  for (const auto& l : out.loop_logits) ce.push_back(token_cross_entropy(l, targets));
  auto ce_t = torch::stack(ce, -1);                       // [B, T, L]
  auto p = out.exit_probs;                                // [B, T, L]
  auto expected_ce = (p * ce_t).sum(-1);                  // [B, T]
  auto entropy = -(p * torch::log(p.clamp_min(1e-12))).sum(-1);
  return (expected_ce - entropy_beta * entropy).mean();
}

Tensor ouro_gate_loss(const ModelOutput& out, const Tensor& targets, double min_gain) {
  const int64_t L = static_cast<int64_t>(out.loop_logits.size());
  LT2_CHECK(L >= 2, "the gate objective needs at least 2 loops");
  std::vector<Tensor> ce;
  {
    torch::NoGradGuard ng;
    for (const auto& l : out.loop_logits) ce.push_back(token_cross_entropy(l, targets));
  }
  auto ce_t = torch::stack(ce, -1);                                   // [B, T, L]
  auto gain = ce_t.narrow(-1, 0, L - 1) - ce_t.narrow(-1, 1, L - 1);  // [B, T, L-1]
  auto stop = (gain <= min_gain).to(torch::kFloat32);
  return torch::nn::functional::binary_cross_entropy_with_logits(
      out.exit_logits.narrow(-1, 0, L - 1).to(torch::kFloat32), stop);
}

}  // namespace lt2
