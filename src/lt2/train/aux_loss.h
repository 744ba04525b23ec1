// Training mixers that have an auxiliary loss (MixerCaps::aux_loss; mixers/aux_loss.h), for the
// trainer, whatever the mixer:
//
//   warm-up:  set_aux_loss_stage(model, AuxLossStage::Warmup); freeze_except_aux_parameters(model);
//             per step: model forward, loss = aux_loss(model) (the LM loss trains nothing here)
//   joint:    set_aux_loss_stage(model, AuxLossStage::Joint); unfreeze what the warm-up froze;
//             per step: loss = lm_loss + coef * aux_loss(model)
//
// Each parallel forward records one loss per (layer, loop) of such a mixer; aux_loss takes them.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "lt2/mixers/aux_loss.h"

namespace lt2 {

// The train config's stage name ("off", "dense_warmup", "sparse") as a stage: Off, Warmup, Joint.
AuxLossStage parse_aux_loss_stage(const std::string& s);

// Mean of the auxiliary losses recorded by the mixers of `model` since the last call (mean over
// layers and loops), and clears them. An undefined tensor when none were recorded (no such mixer,
// or stage off).
Tensor aux_loss(torch::nn::Module& model);

// Sets requires_grad = false on every parameter of `model` except those the auxiliary losses
// train, and returns the parameters it froze (to unfreeze them for the joint stage).
std::vector<Tensor> freeze_except_aux_parameters(torch::nn::Module& model);

}  // namespace lt2
