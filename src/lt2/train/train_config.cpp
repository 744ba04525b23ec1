#include "lt2/train/train_config.h"

#include <utility>

#include "lt2/config/presets.h"

namespace lt2 {

std::string to_string(LoopCheckpointing c) {
  switch (c) {
    case LoopCheckpointing::Off: return "off";
    case LoopCheckpointing::On: return "on";
    case LoopCheckpointing::Auto: return "auto";
  }
  return "?";
}

LoopCheckpointing parse_loop_checkpointing(const std::string& name, const std::string& where) {
  for (auto c : {LoopCheckpointing::Off, LoopCheckpointing::On, LoopCheckpointing::Auto})
    if (name == to_string(c)) return c;
  throw Error(cat(where, ": 'checkpoint_loops' must be auto, on, off, true or false, found '", name, "'"));
}

std::string to_string(Objective o) {
  switch (o) {
    case Objective::CE: return "ce";
    case Objective::Ouro: return "ouro";
    case Objective::OuroGate: return "ouro_gate";
  }
  return "?";
}

void TrainConfig::validate(bool needs_train_data) const {
  const std::string w = "train config";
  LT2_CHECK(!model.empty() || !init_from.empty(), w,
            ": 'model' (a model config path or preset name) or 'init_from' (a checkpoint) is required");
  LT2_CHECK(!needs_train_data || !train_data.empty(), w, ": 'train_data' (a token shard) is required");
  LT2_CHECK(device == "auto" || device == "cpu" || device == "cuda", w,
            ": 'device' must be auto, cpu or cuda, found '", device, "'");
  LT2_CHECK(dtype == "auto" || dtype == "fp32" || dtype == "bf16", w,
            ": 'dtype' must be auto, fp32 or bf16, found '", dtype, "'");
  for (const auto& [field, v] : {std::pair{"seq_len", seq_len}, {"batch_size", batch_size}, {"grad_accum", grad_accum},
                                  {"steps", steps}, {"log_every", log_every}, {"eval_batches", eval_batches}})
    LT2_CHECK(v > 0, w, ": '", field, "' must be > 0, found ", v);
  LT2_CHECK(warmup >= 0, w, ": 'warmup' must be >= 0, found ", warmup);
  for (const auto& [field, v] : {std::pair{"eval_every", eval_every}, {"save_every", save_every}})
    LT2_CHECK(v >= 0, w, ": '", field, "' must be >= 0 (0: at the end only), found ", v);
  LT2_CHECK(!keep_best || (eval_every > 0 && !val_data.empty()), w,
            ": 'keep_best' picks the checkpoint of lowest held-out loss, so it needs 'val_data' and 'eval_every' > 0 "
            "(found val_data '", val_data, "', eval_every ", eval_every, ")");
  LT2_CHECK(lr > 0, w, ": 'lr' must be > 0, found ", lr);
  LT2_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, w, ": 'min_lr_ratio' must be in [0, 1], found ", min_lr_ratio);
  LT2_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, w, ": betas must be in [0, 1), found ", beta1, " and ",
            beta2);
  LT2_CHECK(clip >= 0, w, ": 'clip' must be >= 0 (0 = off), found ", clip);
  LT2_CHECK(indexer_stage == "off" || indexer_stage == "dense_warmup" || indexer_stage == "sparse", w,
            ": 'indexer_stage' must be off, dense_warmup or sparse, found '", indexer_stage, "'");
  LT2_CHECK(indexer_loss_coef >= 0, w, ": 'indexer_loss_coef' must be >= 0");
  LT2_CHECK(loss_chunk_tokens >= 0, w, ": 'loss_chunk_tokens' must be >= 0 (0 = automatic), found ",
            loss_chunk_tokens);
  LT2_CHECK(mixer_options.is_object(), w, ": 'mixer_options' must be an object of mixer names, found ",
            mixer_options.dump());
  for (const auto& [mixer, options] : mixer_options.items())
    LT2_CHECK(options.is_object(), w, ": 'mixer_options.", mixer, "' must be an object of options, found ",
              options.dump());
  LT2_CHECK(document_separator >= -1, w, ": 'document_separator' must be a token id or -1 (the shard's), found ",
            document_separator);
  LT2_CHECK(dist_timeout > 0, w, ": 'dist_timeout' must be > 0 seconds, found ", dist_timeout);
  LT2_CHECK(dist_bucket_mb > 0, w, ": 'dist_bucket_mb' must be > 0, found ", dist_bucket_mb);
  kernel_switches(DecodeOptions{});
}

DecodeOptions TrainConfig::kernel_switches(DecodeOptions base) const {
  const std::string w = "train config: 'kernel_options'";
  LT2_CHECK(kernel_options.is_object(), w, " must be an object of kernel switches (docs/decode.md), found ",
            kernel_options.dump());
  for (const auto& [name, value] : kernel_options.items()) {
    std::string text;
    if (value.is_boolean()) text = value.get<bool>() ? "1" : "0";
    else if (value.is_number_integer()) text = std::to_string(value.get<int64_t>());
    else if (value.is_string()) text = value.get<std::string>();
    else throw Error(cat(w, ".", name, " must be a bool, an integer or a string, found ", value.dump()));
    try {
      base.set(name, text);
    } catch (const Error& e) {
      throw Error(cat(w, ": ", e.what()));
    }
  }
  return base;
}

ModelConfig TrainConfig::model_config() const {
  ModelConfig m = load_model_config(model);
  if (!layer_pattern.empty()) m.layer_pattern = layer_pattern;
  for (const auto& [mixer, options] : mixer_options.items()) {
    json& merged = m.mixer_options[mixer];
    if (!merged.is_object()) merged = json::object();
    merged.update(options);
  }
  m.validate();
  return m;
}

json TrainConfig::to_json() const {
  return json{{"model", model}, {"layer_pattern", layer_pattern}, {"mixer_options", mixer_options},
              {"init_from", init_from}, {"train_data", train_data}, {"val_data", val_data},
              {"out_dir", out_dir}, {"device", device}, {"dtype", dtype},
              {"seq_len", seq_len}, {"batch_size", batch_size}, {"grad_accum", grad_accum},
              {"steps", steps}, {"lr", lr}, {"min_lr_ratio", min_lr_ratio}, {"warmup", warmup},
              {"weight_decay", weight_decay}, {"beta1", beta1}, {"beta2", beta2}, {"eps", eps},
              {"clip", clip}, {"seed", seed}, {"log_every", log_every},
              {"eval_every", eval_every}, {"eval_batches", eval_batches},
              {"save_every", save_every}, {"keep_best", keep_best},
              {"checkpoint_loops", to_string(checkpoint_loops)}, {"tf32", tf32},
              {"fused_loss", fused_loss}, {"loss_chunk_tokens", loss_chunk_tokens},
              {"pack_documents", pack_documents}, {"document_separator", document_separator},
              {"objective", to_string(objective)}, {"ouro_entropy_beta", ouro_entropy_beta},
              {"gate_min_gain", gate_min_gain}, {"indexer_stage", indexer_stage},
              {"indexer_loss_coef", indexer_loss_coef}, {"dist_timeout", dist_timeout},
              {"dist_bucket_mb", dist_bucket_mb}, {"kernel_options", kernel_options}};
}

TrainConfig TrainConfig::from_json(const json& j, const std::string& where) {
  TrainConfig c;
  json_reject_unknown_fields(j, c.to_json(), where);
  json_get(j, "model", c.model, where);
  json_get(j, "layer_pattern", c.layer_pattern, where);
  if (auto it = j.find("mixer_options"); it != j.end()) c.mixer_options = *it;
  if (auto it = j.find("kernel_options"); it != j.end()) c.kernel_options = *it;
  json_get(j, "init_from", c.init_from, where);
  json_get(j, "train_data", c.train_data, where);
  json_get(j, "val_data", c.val_data, where);
  json_get(j, "out_dir", c.out_dir, where);
  json_get(j, "device", c.device, where);
  json_get(j, "dtype", c.dtype, where);
  json_get(j, "seq_len", c.seq_len, where);
  json_get(j, "batch_size", c.batch_size, where);
  json_get(j, "grad_accum", c.grad_accum, where);
  json_get(j, "steps", c.steps, where);
  json_get(j, "lr", c.lr, where);
  json_get(j, "min_lr_ratio", c.min_lr_ratio, where);
  json_get(j, "warmup", c.warmup, where);
  json_get(j, "weight_decay", c.weight_decay, where);
  json_get(j, "beta1", c.beta1, where);
  json_get(j, "beta2", c.beta2, where);
  json_get(j, "eps", c.eps, where);
  json_get(j, "clip", c.clip, where);
  json_get(j, "seed", c.seed, where);
  json_get(j, "log_every", c.log_every, where);
  json_get(j, "eval_every", c.eval_every, where);
  json_get(j, "eval_batches", c.eval_batches, where);
  json_get(j, "save_every", c.save_every, where);
  json_get(j, "keep_best", c.keep_best, where);
  if (auto it = j.find("checkpoint_loops"); it != j.end()) {  // a boolean (older configs) or a policy name
    if (it->is_boolean()) {
      c.checkpoint_loops = it->get<bool>() ? LoopCheckpointing::On : LoopCheckpointing::Off;
    } else {
      c.checkpoint_loops = parse_loop_checkpointing(it->is_string() ? it->get<std::string>() : it->dump(), where);
    }
  }
  json_get(j, "tf32", c.tf32, where);
  json_get(j, "fused_loss", c.fused_loss, where);
  json_get(j, "loss_chunk_tokens", c.loss_chunk_tokens, where);
  json_get(j, "pack_documents", c.pack_documents, where);
  json_get(j, "document_separator", c.document_separator, where);
  std::string obj = to_string(c.objective);
  json_get(j, "objective", obj, where);
  if (obj == "ce") c.objective = Objective::CE;
  else if (obj == "ouro") c.objective = Objective::Ouro;
  else if (obj == "ouro_gate") c.objective = Objective::OuroGate;
  else throw Error(cat(where, ": 'objective' must be ce, ouro or ouro_gate, found '", obj, "'"));
  json_get(j, "ouro_entropy_beta", c.ouro_entropy_beta, where);
  json_get(j, "gate_min_gain", c.gate_min_gain, where);
  json_get(j, "indexer_stage", c.indexer_stage, where);
  json_get(j, "indexer_loss_coef", c.indexer_loss_coef, where);
  json_get(j, "dist_timeout", c.dist_timeout, where);
  json_get(j, "dist_bucket_mb", c.dist_bucket_mb, where);
  return c;
}

}  // namespace lt2
