#include "lt2/eval/model.h"

#include <filesystem>

#include "lt2/config/presets.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/util/error.h"

namespace lt2::eval {

Tokenizer load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  LT2_CHECK(fs::exists(path), "tokenizer '", path, "' does not exist");
  if (!fs::is_directory(path)) return Tokenizer::load(path);
  if (fs::exists(path + "/tokenizer.json")) return Tokenizer::load(path + "/tokenizer.json");
  if (fs::exists(path + "/vocab.json") && fs::exists(path + "/merges.txt"))
    return Tokenizer::load_gpt2(path + "/vocab.json", path + "/merges.txt");
  throw Error(cat("tokenizer folder '", path, "' holds neither tokenizer.json nor vocab.json + merges.txt"));
}

LoadedModel load_model(const ModelSource& s) {
  LT2_CHECK(s.device == "auto" || s.device == "cpu" || s.device == "cuda", "--device must be auto, cpu or cuda, found '",
            s.device, "'");
  LT2_CHECK(s.dtype == "auto" || s.dtype == "fp32" || s.dtype == "bf16", "--dtype must be auto, fp32 or bf16, found '",
            s.dtype, "'");
  const bool folder = std::filesystem::is_directory(s.model);
  std::string tok_path = s.tokenizer;
  if (tok_path.empty() && folder && std::filesystem::exists(s.model + "/tokenizer.json"))
    tok_path = s.model + "/tokenizer.json";
  LT2_CHECK(!tok_path.empty(), "'", s.model, "' ",
            folder ? "has no tokenizer.json" : "is a preset or config (random weights, no tokenizer)",
            ": give one with --tokenizer FILE");
  Tokenizer tok = load_tokenizer(tok_path);
  LoopedLM model{nullptr};
  if (folder) {
    model = load_checkpoint(s.model);
  } else {
    ModelConfig cfg = load_model_config(s.model);
    if (cfg.vocab_size == 0) cfg.vocab_size = tok.vocab_size();  // presets that take it from the data
    torch::manual_seed(s.seed);
    model = LoopedLM(cfg);
  }
  LT2_CHECK(tok.vocab_size() <= model->config().vocab_size, "the tokenizer '", tok_path, "' has ", tok.vocab_size(),
            " ids but the model's vocab_size is ", model->config().vocab_size, " (expected >= the tokenizer's)");
  const bool cuda = s.device == "cuda" || (s.device == "auto" && torch::cuda::is_available());
  LT2_CHECK(!cuda || torch::cuda::is_available(), "--device cuda: no CUDA GPU is available");
  model->to(cuda ? torch::kCUDA : torch::kCPU);
  if (s.dtype == "bf16" || (s.dtype == "auto" && cuda)) model->to(torch::kBFloat16);
  model->eval();
  return LoadedModel{model, std::move(tok), !folder};
}

int32_t prefix_token(const Tokenizer& tok, const std::string& name) {
  if (!name.empty()) {
    auto id = tok.token_to_id(name);
    LT2_CHECK(id, "--prefix-token '", name, "' is not a token of the tokenizer");
    return *id;
  }
  for (const char* candidate : {"<|begin_of_text|>", "<s>", "<|endoftext|>", "</s>"})
    if (auto id = tok.token_to_id(candidate)) return *id;
  throw Error("the tokenizer has none of <|begin_of_text|>, <s>, <|endoftext|>, </s> to start documents with: "
              "name one with --prefix-token");
}

ForwardOptions forward_options(const ModelConfig& cfg, const LoopOptions& o) {
  const bool exit_set = o.exit_step || o.exit_threshold || o.exit_rule_published;
  LT2_CHECK(!exit_set || cfg.exit_gate, "--exit-step, --exit-threshold and --exit-rule apply to Ouro-form models "
            "with an exit gate; '", cfg.name, "' has none (use --loops to run fewer loops)");
  LT2_CHECK(!o.loops || (*o.loops >= 1 && *o.loops <= cfg.n_loops), "--loops must be in [1, ", cfg.n_loops,
            "] (the model's loops), found ", o.loops.value_or(0));
  const int64_t loops = o.loops.value_or(cfg.n_loops);
  LT2_CHECK(!o.exit_step || (*o.exit_step >= 1 && *o.exit_step <= loops), "--exit-step must be in [1, ", loops,
            "], found ", o.exit_step.value_or(0));
  LT2_CHECK(!o.exit_threshold || (*o.exit_threshold > 0 && *o.exit_threshold <= 1),
            "--exit-threshold must be in (0, 1], found ", o.exit_threshold.value_or(0));
  LT2_CHECK(!(o.exit_step && o.exit_threshold), "give --exit-step or --exit-threshold, not both");
  LT2_CHECK(!(o.all_exits && (o.exit_step || o.exit_threshold)),
            "--exits all scores every loop's exit; it excludes --exit-step and --exit-threshold");
  ForwardOptions fo;
  // A fixed exit step needs no loop past it.
  fo.n_loops = o.exit_step ? *o.exit_step : o.loops.value_or(-1);
  fo.exit_at_loop = o.exit_step.value_or(-1);
  fo.exit_threshold = o.exit_threshold.value_or(-1);
  fo.exit_rule_published = o.exit_rule_published;
  fo.loop_logits = o.all_exits;
  return fo;
}

std::vector<std::string> exit_names(const ModelConfig& cfg, const LoopOptions& o) {
  const int64_t loops = o.loops.value_or(cfg.n_loops);
  if (o.all_exits) {
    std::vector<std::string> names;
    for (int64_t t = 1; t <= loops; ++t) names.push_back(cat("loop ", t));
    return names;
  }
  if (o.exit_step) return {cat("loop ", *o.exit_step)};
  if (cfg.exit_gate) {
    const double q = o.exit_threshold.value_or(cfg.early_exit_threshold);
    return {cat("exit q=", q, o.exit_rule_published ? " (published rule)" : "")};
  }
  return {cat("loop ", loops)};
}

}  // namespace lt2::eval
