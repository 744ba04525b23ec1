#include "lt2/mixers/aux_loss.h"

namespace lt2 {

namespace {

// Every auxiliary loss inside `model`, `model` itself included, in module order.
std::vector<AuxLoss*> aux_losses(torch::nn::Module& model) {
  std::vector<AuxLoss*> out;
  auto add = [&out](torch::nn::Module* m) {
    if (auto* mixer = dynamic_cast<MixerImpl*>(m))
      if (auto* aux = mixer->aux_loss()) out.push_back(aux);
  };
  add(&model);
  for (auto& m : model.modules(/*include_self=*/false)) add(m.get());
  return out;
}

}  // namespace

void set_aux_loss_stage(torch::nn::Module& model, AuxLossStage stage) {
  for (auto* aux : aux_losses(model)) aux->set_stage(stage);
}

std::vector<Tensor> take_aux_losses(torch::nn::Module& model) {
  std::vector<Tensor> out;
  for (auto* aux : aux_losses(model))
    for (auto& l : aux->take()) out.push_back(l);
  return out;
}

std::vector<Tensor> aux_loss_parameters(torch::nn::Module& model) {
  std::vector<Tensor> out;
  for (auto* aux : aux_losses(model))
    for (auto& p : aux->parameters()) out.push_back(p);
  return out;
}

}  // namespace lt2
