// LoopedLM checkpoint folders (docs/architecture.md, "Checkpoints"): config.json (our ModelConfig) +
// model.safetensors, written all-or-nothing; loading accepts our folders and Ouro folders
// (config.json with model_type "ouro", see lt2/io/ouro.h). The file-level machinery is in
// lt2/io/checkpoint.h; this layer adds what needs the model (it lives in lt2_model, above lt2_io).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "lt2/io/checkpoint.h"
#include "lt2/model/looped_lm.h"

namespace lt2 {

// Writes <dir>/config.json and <dir>/model.safetensors (every parameter and buffer in its own
// dtype, so a round trip is bit-exact), plus `extra` files (optimizer.safetensors,
// trainer_state.json, tokenizer.json, ...), all or nothing: on failure the folder keeps its
// previous files. Creates the folder if needed.
void save_checkpoint(const std::string& dir, const LoopedLM& model, const std::vector<FileWriter>& extra = {});

// The model config of a checkpoint folder: ours (config.json without model_type), or Ouro's
// (model_type "ouro"), validated. Any other model_type is an error.
ModelConfig load_checkpoint_config(const std::string& dir);

// Checks the weights of checkpoint folder `dir` against `model` (built from the folder's config)
// from the safetensors headers alone: every file the size its header says, every tensor present
// with its shape and a dtype that loads, no tensor left over. No tensor data is read. Throws
// lt2::Error listing the problems; returns the number of tensors checked.
int64_t check_checkpoint_weights(const std::string& dir, const LoopedLM& model);

// Builds the model of a checkpoint folder (ours or Ouro) on the CPU and loads its weights
// strictly (lt2/io/checkpoint.h: load_weights_into). Floating-point weights are converted to
// `dtype`; without one, float64 checkpoints load as float64 and all others as float32.
LoopedLM load_checkpoint(const std::string& dir, std::optional<torch::ScalarType> dtype = std::nullopt);

}  // namespace lt2
