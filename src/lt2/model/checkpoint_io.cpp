#include "lt2/model/checkpoint_io.h"

#include "lt2/io/ouro.h"
#include "lt2/util/fs.h"

namespace lt2 {

void save_checkpoint(const std::string& dir, const LoopedLM& model, const std::vector<FileWriter>& extra) {
  std::vector<FileWriter> files = extra;
  files.push_back(safetensors_writer("model.safetensors", module_tensors(*model), {{"format", "pt"}}));
  files.push_back(text_writer("config.json", model->config().to_json().dump(2) + "\n"));
  write_folder_atomic(dir, files);
}

namespace {

// The folder's config, and whether it came from an Ouro config.json (weights under HF names).
ModelConfig read_config(const std::string& dir, bool* ouro) {
  LT2_CHECK(path_exists(dir), "checkpoint folder '", dir, "' does not exist");
  const std::string path = dir + "/config.json";
  const json j = load_json_file(path);
  const std::string where = "'" + path + "'";
  LT2_CHECK(j.is_object(), where, ": expected a JSON object, found ", json_type_name(j));
  *ouro = is_ouro_config(j);
  if (*ouro) {
    ModelConfig cfg = ouro_model_config(j, where);
    cfg.validate();
    return cfg;
  }
  LT2_CHECK(!j.contains("model_type"), where, ": unknown model_type ", j["model_type"].dump(),
            " (lt2 loads its own checkpoints, whose config.json has no model_type, and \"ouro\")");
  // A Hugging Face config without model_type would otherwise fail on its first unknown field.
  for (const char* hf_field : {"architectures", "hidden_size", "num_hidden_layers", "total_ut_steps"})
    LT2_CHECK(!j.contains(hf_field), where, ": no 'model_type' (expected \"ouro\" in a Hugging Face config; found ",
              "the Hugging Face field '", hf_field, "' but no model_type)");
  return ModelConfig::from_json(j, where);
}

}  // namespace

ModelConfig load_checkpoint_config(const std::string& dir) {
  bool ouro = false;
  return read_config(dir, &ouro);
}

int64_t check_checkpoint_weights(const std::string& dir, const LoopedLM& model) {
  bool ouro = false;
  const ModelConfig cfg = read_config(dir, &ouro);
  std::string source;
  const TensorSpecs specs = read_model_weight_specs(dir, &source);
  if (ouro)
    check_weights_match(*model, specs, source, ouro_key_map(cfg), ouro_ignored_keys(cfg));
  else
    check_weights_match(*model, specs, source);
  return static_cast<int64_t>(specs.size());
}

LoopedLM load_checkpoint(const std::string& dir, std::optional<torch::ScalarType> dtype) {
  bool ouro = false;
  const ModelConfig cfg = read_config(dir, &ouro);
  std::string source;
  const TensorMap weights = open_model_weights(dir, &source);
  LoopedLM model(cfg);
  const torch::ScalarType target = dtype.value_or(default_load_dtype(weights));
  LT2_CHECK(c10::isFloatingType(target), "load_checkpoint: the model dtype must be floating-point, found ",
            c10::toString(target));
  model->to(target);
  if (ouro)
    load_weights_into(*model, weights, source, ouro_key_map(cfg), ouro_ignored_keys(cfg));
  else
    load_weights_into(*model, weights, source);
  return model;
}

}  // namespace lt2
