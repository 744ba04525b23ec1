// The model an evaluation runs: loading (preset, config JSON, or checkpoint folder, with its
// tokenizer) and how its loops and Ouro exits are used.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lt2/model/looped_lm.h"
#include "lt2/tokenizer/tokenizer.h"

namespace lt2::eval {

struct ModelSource {
  std::string model;      // preset name, model-config JSON, or checkpoint folder (ours or Ouro)
  std::string tokenizer;  // tokenizer.json, or a folder with tokenizer.json or vocab.json + merges.txt;
                          // default: the checkpoint's tokenizer.json (required for presets and configs)
  std::string device = "auto";  // auto (CUDA when available) | cpu | cuda
  std::string dtype = "auto";   // auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
  uint64_t seed = 0;            // weights of presets and configs (random)
};

struct LoadedModel {
  LoopedLM model;
  Tokenizer tokenizer;
  bool random_weights = false;  // a preset or config: untrained
};

// Loads the model in eval mode on its device and dtype. Throws lt2::Error when the model or the
// tokenizer cannot be found, or the tokenizer has more ids than the model's vocabulary.
LoadedModel load_model(const ModelSource& source);

// A tokenizer file or folder (see ModelSource::tokenizer).
Tokenizer load_tokenizer(const std::string& path);

// The token the harness puts before a document or an empty context: `name` when given (it must be
// a token), else the first of <|begin_of_text|>, <s>, <|endoftext|>, </s> the tokenizer has.
int32_t prefix_token(const Tokenizer& tok, const std::string& name = "");

// How a looped model's loops and Ouro exits are used when scoring or generating.
struct LoopOptions {
  std::optional<int64_t> loops;          // run only the first T' loops; unset: all (LT2 `--loops`)
  std::optional<int64_t> exit_step;      // Ouro: every token takes this loop's exit (1-based)
  std::optional<double> exit_threshold;  // Ouro: first loop whose cumulative exit probability >= q; unset: config
  bool exit_rule_published = false; // Ouro: compare in the model dtype as Ouro's released code does
  bool all_exits = false;           // score every loop's exit (one column per loop)
};

// The forward options for `o`, checked against the model: exit settings need an exit gate (Ouro
// form), loop counts must be in [1, n_loops], and settings that contradict each other are errors.
ForwardOptions forward_options(const ModelConfig& cfg, const LoopOptions& o);
// What each scored column is: "loop 1".."loop T" with all_exits, else one name for the setting
// ("last loop", "loop 2", "exit q=0.9", ...).
std::vector<std::string> exit_names(const ModelConfig& cfg, const LoopOptions& o);

}  // namespace lt2::eval
