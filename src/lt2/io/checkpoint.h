// Checkpoint folders, model-agnostic part (HF style, docs/architecture.md "Checkpoints"):
//   config.json, model.safetensors (or model.safetensors.index.json + shards), tokenizer.json,
//   optimizer.safetensors, trainer_state.json.
// Folders are written all-or-nothing: every file goes to a temporary name first and only when all
// of them are complete are they renamed into place, so a failed save leaves the previous
// checkpoint intact. Loading into a module is strict: every parameter must be found with its
// exact shape and every tensor of the file must be used. The LoopedLM-level save_checkpoint /
// load_checkpoint live in lt2/model/checkpoint_io.h.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "lt2/io/safetensors.h"

namespace lt2 {

// One file of a folder: its name inside the folder and a function that writes its bytes.
struct FileWriter {
  std::string name;
  std::function<void(std::ostream&)> write;
};

// A FileWriter for a safetensors file (captures the tensors by reference count, not by copy).
FileWriter safetensors_writer(const std::string& name, TensorMap tensors, Metadata metadata = {});
// A FileWriter for a text file (JSON, ...).
FileWriter text_writer(const std::string& name, std::string contents);

// Creates `dir` if needed, writes every file to temporary_path(<dir>/<name>), fsyncs them, and only
// then renames each onto `<dir>/<name>`. If any write fails, the temporary files are removed,
// the existing files are left untouched, and the error is rethrown.
void write_folder_atomic(const std::string& dir, const std::vector<FileWriter>& files);

// Every parameter and buffer of `m` by its full dotted name (registration order does not matter:
// the map is sorted). Detached: the tensors share storage with the module.
TensorMap module_tensors(const torch::nn::Module& m);

// Owned CPU copies of every tensor of a safetensors file (for optimizer state and other data
// that is modified after loading). Save with save_safetensors().
TensorMap load_tensor_map(const std::string& path);

// The weights of a checkpoint folder as views of the mapped files (no copy): model.safetensors,
// or the shards listed in model.safetensors.index.json ({"weight_map": {key: file}}).
// `source` receives a description for error messages (the file, or the index).
TensorMap open_model_weights(const std::string& dir, std::string* source = nullptr);
// The dtypes and shapes of the same weights from the files' headers alone (each file is checked
// against its header's size; no tensor data is read).
TensorSpecs read_model_weight_specs(const std::string& dir, std::string* source = nullptr);

// Our parameter name -> the key in the file; names not in the map are looked up unchanged.
using NameMap = std::map<std::string, std::string>;

// Copies `weights` into the parameters and buffers of `m`, strictly: every tensor of `m` must be
// present (under its mapped key) with exactly its shape; every key of `weights` not in `ignore`
// must be used. Floating-point weights are converted to the module's dtype (bf16 -> fp32, ...);
// other dtypes must match exactly. All problems are reported at once, naming each key, the
// expected shape and the found shape; on error the module is left unchanged. `source` names the
// file in messages.
void load_weights_into(torch::nn::Module& m, const TensorMap& weights, const std::string& source,
                       const NameMap& name_map = {}, const std::set<std::string>& ignore = {});
// The checks of load_weights_into on dtypes and shapes alone (a checkpoint's headers): throws the
// same error, listing every problem, when `weights` would not load into `m`.
void check_weights_match(const torch::nn::Module& m, const TensorSpecs& weights, const std::string& source,
                         const NameMap& name_map = {}, const std::set<std::string>& ignore = {});
void load_weights_into(torch::nn::Module& m, const SafetensorsFile& file, const NameMap& name_map = {},
                       const std::set<std::string>& ignore = {});

// The dtype to load floating-point weights into when the caller gives none: float64 when every
// floating-point tensor is stored in float64, else float32 (fp32 master weights; bf16 and fp16
// checkpoints are widened).
torch::ScalarType default_load_dtype(const TensorMap& weights);

}  // namespace lt2
