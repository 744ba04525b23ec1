// The auxiliary-loss hook over every mixer inside a module (a LoopedLM, a block, a mixer): what a
// trainer uses, without knowing which mixers have such a loss (MixerCaps::aux_loss).
#pragma once
#include <torch/torch.h>

#include <vector>

#include "lt2/mixers/mixer.h"

namespace lt2 {

// Sets the auxiliary-loss stage of every mixer inside `model` that has one.
void set_aux_loss_stage(torch::nn::Module& model, AuxLossStage stage);
// Takes (and clears) the auxiliary losses recorded by every mixer inside `model`, in module order
// (layer-major, then loop).
std::vector<Tensor> take_aux_losses(torch::nn::Module& model);
// The parameters trained by the auxiliary losses of the mixers inside `model`.
std::vector<Tensor> aux_loss_parameters(torch::nn::Module& model);

}  // namespace lt2
