// Trainer: the training loop of lt2, behind `lt2 train` and `lt2 tasks run`. One log line per step
// (step, loss, grad norm, lr, ms, tokens/s, MFU on GPU), a JSONL metrics file, evaluation on a
// held-out shard, checkpoints every K steps and at the end, and an exact --resume (the batches and
// the per-micro-batch RNG depend only on the step and the micro-batch).
//
// Clients with their own data, schedule and evaluation (the task curriculum, tasks/runner.h) plug
// into the same loop through TrainerCallbacks: a batch source, a loss, a learning-rate schedule,
// a stop test before each step, a hook after each step (evaluate, checkpoint, change stage), and
// extra state saved in and restored from every checkpoint.
//
// Data-parallel when the environment describes a job (WORLD_SIZE, RANK, ...: torchrun or
// `lt2 train --nproc`; lt2/train/distributed.h): each rank runs its share of the step's
// micro-batches, the gradients are summed over the ranks, and the global batch, hence the run,
// is the same whatever the number of ranks (to fp32 round-off). Rank 0 alone logs and writes the
// run folder; a checkpoint resumes on any number of ranks that divides grad_accum.
//
// Run folder layout (cfg.out_dir):
//   train_config.json          the resolved training config
//   metrics.jsonl              one JSON object per logged step / evaluation
//   ckpt-<step>/               config.json, model.safetensors, optimizer.safetensors,
//                              trainer_state.json (+ tokenizer.json when the data has one)
//   latest                     name of the newest complete checkpoint folder
//   best                       with keep_best: name of the checkpoint of lowest held-out loss
//                              (trainer_state.json: best_step, best_val_loss), kept by rotation
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "lt2/model/looped_lm.h"
#include "lt2/train/memory_policy.h"
#include "lt2/train/train_config.h"

namespace lt2 {

struct StepMetrics {
  int64_t step = 0;  // steps done, this one included
  double loss = 0, grad_norm = 0, lr = 0, ms = 0, tokens_per_s = 0, mfu = 0;
};

// One micro-batch, on the CPU (the trainer moves it): inputs and targets [B, T] int64; mask [B, T]
// marks the positions a custom loss scores (undefined when every position counts). documents: the
// inputs' packed documents (TrainConfig::pack_documents; the trainer sets them), or null.
struct Batch {
  torch::Tensor inputs, targets, mask;
  std::shared_ptr<const PackedDocuments> documents;
};

// What a client plugs into the loop; every member is optional (unset: the `lt2 train` behaviour).
struct TrainerCallbacks {
  // The model of a fresh run (no resume, no init_from); the trainer seeds the RNG from cfg.seed
  // and builds it. Default: cfg.model with the training shard's vocabulary.
  std::function<ModelConfig()> model_config;
  // Micro-batch `micro` of step `step`: a function of (step, micro) and of the client's state
  // (a curriculum stage), never of what ran before, so resume stays exact. Default: the training
  // shard (cfg.train_data, then not required).
  std::function<Batch(int64_t step, int64_t micro)> batch;
  // The loss of one micro-batch, under autocast; `fo` carries what the trainer decided for every
  // forward that trains (per-loop checkpointing, the batch's packed documents). Default: cfg.objective on every position (plus
  // the DSA indexer loss of cfg.indexer_stage).
  std::function<torch::Tensor(LoopedLM& model, const Batch& batch, const ForwardOptions& fo)> loss;
  // Which parameters train, by name (the others are frozen); applied after the model is built or
  // loaded, resumes included. Default: all of them (as the objective allows).
  std::function<bool(const std::string& name)> trainable;
  // Each parameter's learning rate as a multiple of the schedule's, by name. Default: 1 for all.
  std::function<double(const std::string& name)> lr_scale;
  // The learning rate of step `step` (0-based). Default: warm-up, then cosine to cfg.steps.
  std::function<double(int64_t step)> lr;
  // Called before step `step` (0-based): true ends run() there.
  std::function<bool(int64_t step)> stop_before;
  // Called after every step (after its log line and on_step): evaluate, checkpoint with save(),
  // move to another stage.
  std::function<void(const StepMetrics&)> after_step;
  // Extra fields of trainer_state.json, written with every checkpoint; on --resume, called with
  // that file's contents before anything trains.
  std::function<json()> save_state;
  std::function<void(const json&)> load_state;
  int keep_checkpoints = 2;   // newest ckpt-* folders kept
  bool run_files = true;      // train_config.json and metrics.jsonl in cfg.out_dir
  bool step_lines = true;     // the step line every cfg.log_every steps (and a progress bar on a tty)
  bool data_parallel = true;  // join the data-parallel job the environment describes, if any
};

class Trainer {
 public:
  // With resume, continues from `cfg.out_dir/latest` (an error if there is none).
  Trainer(TrainConfig cfg, bool resume, TrainerCallbacks callbacks = {});
  // Trains until cfg.steps (or until callbacks.stop_before says so); returns the last step's
  // metrics (step 0 when none ran).
  StepMetrics run();
  // Mean loss over cfg.eval_batches held-out batches (train shard when no val shard). In a
  // data-parallel job every rank evaluates its share and every rank must call it.
  double evaluate();
  // Writes ckpt-<step> and points `latest` (and with `best`, `best`) at it; keeps the two newest
  // checkpoints and the best one. Only rank 0 writes (the others return "").
  std::string save(int64_t step, bool best = false);

  LoopedLM& model() { return model_; }
  const TrainConfig& config() const { return cfg_; }
  torch::Device device() const;
  bool autocast() const;  // bf16 autocast in forward (CUDA, dtype auto or bf16)
  int64_t start_step() const { return start_step_; }
  // Whether forwards recompute loops in backward: cfg.checkpoint_loops, with "auto" resolved
  // at the start of run() (train/memory_policy.h; every rank takes the same decision).
  bool checkpoint_loops() const;
  // With checkpoint_loops: the last loops that keep their activations (1 where the config says on;
  // "auto" stores as many as fit).
  int64_t stored_loops() const;
  // And the last layers of the loop before them that keep theirs (0 but where "auto" chose more).
  int64_t partial_loop_layers() const;
  // What "auto" measured and chose (nullopt where the config fixed the policy, or before run()).
  std::optional<CheckpointingChoice> checkpointing_choice() const;
  // This process's rank and the number of ranks (0 and 1 outside a data-parallel job).
  int rank() const;
  int world_size() const;
  // Called after every step (tests, progress display).
  std::function<void(const StepMetrics&)> on_step;

 private:
  struct Impl;
  // Micro-batch `micro` of step `step` on the training device.
  Batch micro_batch(int64_t step, int64_t micro);
  // The loss of one micro-batch (callbacks.loss or the objective), under autocast.
  torch::Tensor micro_loss(const Batch& b, bool checkpoint_loops, int64_t stored_loops, int64_t partial_loop_layers = 0);
  // Resolves checkpoint_loops "auto" from measured memory and logs the decision.
  void choose_checkpointing();
  TrainConfig cfg_;
  TrainerCallbacks cb_;
  LoopedLM model_{nullptr};
  std::shared_ptr<Impl> impl_;
  int64_t start_step_ = 0;
};

// The device a run of `cfg` trains on outside a data-parallel job (cfg.device; "auto": CUDA when
// there is a GPU), and whether its forward runs under bf16 autocast there.
torch::Device training_device(const TrainConfig& cfg);
bool training_autocast(const TrainConfig& cfg, torch::Device device);

// The newest complete checkpoint folder of a run, or "" when none.
std::string latest_checkpoint(const std::string& out_dir);

}  // namespace lt2
