#include "lt2/train/aux_loss.h"

#include <unordered_set>

#include "lt2/util/error.h"

namespace lt2 {

AuxLossStage parse_aux_loss_stage(const std::string& s) {
  if (s == "off") return AuxLossStage::Off;
  if (s == "dense_warmup") return AuxLossStage::Warmup;
  if (s == "sparse") return AuxLossStage::Joint;
  throw Error(cat("auxiliary-loss stage '", s, "': expected 'off', 'dense_warmup' or 'sparse'"));
}

Tensor aux_loss(torch::nn::Module& model) {
  auto losses = take_aux_losses(model);
  if (losses.empty()) return {};
  return torch::stack(losses).mean();
}

std::vector<Tensor> freeze_except_aux_parameters(torch::nn::Module& model) {
  std::unordered_set<const void*> keep;
  for (auto& p : aux_loss_parameters(model)) keep.insert(p.unsafeGetTensorImpl());
  std::vector<Tensor> frozen;
  for (auto& p : model.parameters()) {
    if (keep.count(p.unsafeGetTensorImpl()) || !p.requires_grad()) continue;
    p.set_requires_grad(false);
    frozen.push_back(p);
  }
  return frozen;
}

}  // namespace lt2
