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
// newest ckpt-* folders. An interruption at any point leaves `latest` naming a complete folder; a
// failed write (disk full) throws and leaves the run folder as it was. Returns the folder's path.
std::string save_rotating_checkpoint(const std::string& out_dir, int64_t step, const LoopedLM& model,
                                     const std::vector<FileWriter>& extra, int keep);

// Removes what a run killed mid-save leaves in `out_dir`: ckpt-<step>.tmp folders and temporary
// files (util/fs.h). For the one process that writes the run folder, before it starts.
void remove_checkpoint_temporaries(const std::string& out_dir);

}  // namespace lt2
