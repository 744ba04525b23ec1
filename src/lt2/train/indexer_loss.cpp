#include "lt2/train/indexer_loss.h"

#include <unordered_set>

namespace lt2 {

Tensor indexer_loss(torch::nn::Module& model) {
  auto losses = take_indexer_losses(model);
  if (losses.empty()) return {};
  return torch::stack(losses).mean();
}

std::vector<Tensor> indexer_parameters(torch::nn::Module& model) {
  std::vector<Tensor> out;
  auto add = [&out](const torch::nn::Module* m) {
    if (auto* d = dynamic_cast<const DSAImpl*>(m))
      for (auto& p : d->indexer_parameters()) out.push_back(p);
  };
  add(&model);
  for (auto& m : model.modules(/*include_self=*/false)) add(m.get());
  return out;
}

std::vector<Tensor> freeze_except_indexers(torch::nn::Module& model) {
  std::unordered_set<const void*> keep;
  for (auto& p : indexer_parameters(model)) keep.insert(p.unsafeGetTensorImpl());
  std::vector<Tensor> frozen;
  for (auto& p : model.parameters()) {
    if (keep.count(p.unsafeGetTensorImpl()) || !p.requires_grad()) continue;
    p.set_requires_grad(false);
    frozen.push_back(p);
  }
  return frozen;
}

}  // namespace lt2
