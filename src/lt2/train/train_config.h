// TrainConfig: everything `lt2 train` needs besides the model, as JSON with flag overrides.
#pragma once
#include <cstdint>
#include <string>

#include "lt2/config/model_config.h"
#include "lt2/ops/decode_options.h"

namespace lt2 {

// Training objective.
//   ce:        cross-entropy on the last loop (LT2)
//   ouro:      sum_t p_t * CE_t - beta * H(p) over the loop exits (Ouro stage 1)
//   ouro_gate: only the exit gate trains, toward continuing while a loop still lowers the loss
//              by more than `gate_min_gain` (Ouro stage 2)
enum class Objective { CE, Ouro, OuroGate };
// Per-loop activation checkpointing (ForwardOptions::checkpoint_loops): off, on, or chosen from a
// step's measured memory (train/memory_policy.h).
enum class LoopCheckpointing { Off, On, Auto };
std::string to_string(LoopCheckpointing c);
// "auto", "on" or "off"; anything else is an error naming `where`.
LoopCheckpointing parse_loop_checkpointing(const std::string& name, const std::string& where);

struct TrainConfig {
  std::string model;            // path of a model config JSON, or a preset name in configs/
  // Overrides of that model config for a new model (a checkpoint resumed or started from keeps
  // its own): the layer pattern (empty: the config's), and per-mixer options merged over the
  // config's ({"window": {"window": 512}}).
  std::string layer_pattern;
  json mixer_options = json::object();
  std::string init_from;        // checkpoint folder whose weights start the run (fresh optimizer)
  std::string train_data;       // token shard (data/shard.h)
  std::string val_data;         // optional held-out shard
  std::string out_dir = "runs/default";
  std::string device = "auto";  // auto | cpu | cuda
  std::string dtype = "auto";   // auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
  int64_t seq_len = 256;
  int64_t batch_size = 8;       // sequences per micro-batch
  int64_t grad_accum = 1;       // micro-batches per optimizer step
  int64_t steps = 1000;
  double lr = 3e-4;
  double min_lr_ratio = 0.1;    // cosine decays to lr * min_lr_ratio
  int64_t warmup = 100;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;            // max global grad norm (0 = off)
  uint64_t seed = 1234;
  int64_t log_every = 1;
  int64_t eval_every = 200;     // 0 = only at the end
  int64_t eval_batches = 8;
  int64_t save_every = 0;       // 0 = only at the end
  // Checkpoint at every evaluation that lowers the held-out loss (val_data, every eval_every steps)
  // and point `best` at it; rotation never removes that folder (trainer.h: run folder layout).
  bool keep_best = false;
  LoopCheckpointing checkpoint_loops = LoopCheckpointing::Auto;  // JSON: "auto", "on"/true, "off"/false
  bool tf32 = true;  // with bf16 autocast: fp32 matmuls (the recurrences' chunk math) on TF32 tensor cores
  // The cross-entropy objective through the fused, chunked head + loss (ops/loss/lm_head_loss.h:
  // no [tokens x vocab] logits); false: the reference, the model's logits then cross_entropy.
  bool fused_loss = true;
  int64_t loss_chunk_tokens = 0;  // tokens per chunk of the fused loss; 0 = automatic
  // Packed documents (docs/training.md): each row of the shard stream is cut into its documents at
  // the separator token, and no token attends to or carries state from another document
  // (ForwardOptions::documents). false: rows are plain windows of the stream.
  bool pack_documents = false;
  // The separator's token id; -1: the one the shard was prepared with (summary.json and
  // tokenizer.json beside train_data, from `lt2 data prepare`).
  int64_t document_separator = -1;
  Objective objective = Objective::CE;
  double ouro_entropy_beta = 0.05;
  double gate_min_gain = 0.005;
  // Training of mixers with an auxiliary loss (MixerCaps::aux_loss; the sparse-attention indexers
  // of DeepSeek-V3.2): "off"; "dense_warmup" (AuxLossStage::Warmup: only what the auxiliary
  // losses train, on those losses alone); "sparse" (AuxLossStage::Joint: LM loss plus
  // indexer_loss_coef x the auxiliary losses).
  std::string indexer_stage = "off";
  double indexer_loss_coef = 1.0;
  // Data-parallel runs (lt2/train/distributed.h): seconds a rank waits for its peers (joining, each
  // collective) before the job ends with an error; gradient all-reduce bucket size in MiB.
  double dist_timeout = 600;
  double dist_bucket_mb = 25;
  // Kernel switches for the run (the DecodeOptions fields of docs/decode.md), name -> value (a bool,
  // an integer or a string, as DecodeOptions::set reads it): {"residual_norm": false}. The run
  // applies them over the switches in force where it runs (Trainer::run, Trainer::evaluate).
  json kernel_options = json::object();

  // Throws lt2::Error naming the field. Without needs_train_data, train_data may be empty (the
  // trainer's callbacks give the batches: TrainerCallbacks in train/trainer.h).
  void validate(bool needs_train_data = true) const;
  json to_json() const;
  // `model`'s config with layer_pattern and mixer_options applied (load_model_config's errors).
  ModelConfig model_config() const;
  // `base` with kernel_options set (an unknown switch or a bad value throws, naming it).
  DecodeOptions kernel_switches(DecodeOptions base) const;
  static TrainConfig from_json(const json& j, const std::string& where = "train config");
};

std::string to_string(Objective o);

}  // namespace lt2
