// Rotating checkpoint folders of a run: <out_dir>/ckpt-<step>/ and <out_dir>/latest naming the
// newest complete one (read it back with latest_checkpoint() in train/trainer.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lt2/io/checkpoint.h"
#include "lt2/model/looped_lm.h"

namespace lt2 {

// Writes ckpt-<step>/ (config.json, model.safetensors and `extra`) into a temporary folder,
// renames it into place, then points `latest` at it (atomically) and removes all but the `keep`
// newest ckpt-* folders. An interruption at any point leaves `latest` naming a complete folder.
// Returns the folder's path.
std::string save_rotating_checkpoint(const std::string& out_dir, int64_t step, const LoopedLM& model,
                                     const std::vector<FileWriter>& extra, int keep);

}  // namespace lt2
