// Training the DSA lightning indexer (spec/mixers.md §6.2), for the trainer:
//
//   dense warm-up:  set_indexer_stage(model, IndexerStage::DenseWarmup); freeze_except_indexers(model);
//                   per step: model forward (dense attention), loss = indexer_loss(model)
//                   (the LM loss trains nothing here; the report uses lr 1e-3)
//   sparse stage:   set_indexer_stage(model, IndexerStage::Sparse); unfreeze what the warm-up froze;
//                   per step: loss = lm_loss + coef * indexer_loss(model)
//                   (the indexer sees its input detached, so it learns only from its KL and the
//                   rest of the model only from the LM loss)
//
// Each parallel forward of a DSA layer records one KL per (layer, loop); indexer_loss takes them.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "lt2/mixers/dsa.h"

namespace lt2 {

// Mean of the KL losses recorded by every DSA mixer of `model` since the last call (mean over
// layers and loops; each is already a mean over batch and queries), and clears them. An undefined
// tensor when none were recorded (no DSA layer, or stage off).
Tensor indexer_loss(torch::nn::Module& model);

// The parameters of every DSA indexer in `model` (what the dense warm-up trains).
std::vector<Tensor> indexer_parameters(torch::nn::Module& model);

// Sets requires_grad = false on every parameter of `model` except the DSA indexers' and returns the
// parameters it froze (to unfreeze them for the sparse stage).
std::vector<Tensor> freeze_except_indexers(torch::nn::Module& model);

}  // namespace lt2
