// Rotating checkpoint folders of a run: <out_dir>/ckpt-<step>/, <out_dir>/latest naming the
// newest complete one (read it back with latest_checkpoint() in train/trainer.h) and, in runs that
// keep their best checkpoint, <out_dir>/best naming that one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lt2/io/checkpoint.h"
#include "lt2/model/looped_lm.h"

namespace lt2 {

// Writes ckpt-<step>/ (config.json, model.safetensors and `extra`) into a temporary folder,
// renames it into place, then points `best` (with `best` set) and `latest` at it (atomically, in
// that order) and removes all ckpt-* folders but the `keep` newest and the one `best` names. An
// interruption at any point leaves `latest` naming a complete folder, and `best` too (but while a
// resumed run rewrites the folder it names, with the same contents); a failed write (disk full)
// throws and leaves the run folder as it was. Returns the folder's path.
std::string save_rotating_checkpoint(const std::string& out_dir, int64_t step, const LoopedLM& model,
                                     const std::vector<FileWriter>& extra, int keep, bool best = false);

// The folder name a pointer file (`latest`, `best`) holds, or "" when there is no such file.
std::string read_checkpoint_pointer(const std::string& path);

// Removes what a run killed mid-save leaves in `out_dir`: ckpt-<step>.tmp folders and temporary
// files (util/fs.h). For the one process that writes the run folder, before it starts.
void remove_checkpoint_temporaries(const std::string& out_dir);

}  // namespace lt2
