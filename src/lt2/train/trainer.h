// Trainer: the `lt2 train` loop. One log line per step (step, loss, grad norm, lr, ms, tokens/s,
// MFU on GPU), a JSONL metrics file, evaluation on a held-out shard, checkpoints every K steps and
// at the end, and an exact --resume (the batches and the per-micro-batch RNG depend only on the
// step and the micro-batch).
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
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "lt2/model/looped_lm.h"
#include "lt2/train/train_config.h"

namespace lt2 {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0, ms = 0, tokens_per_s = 0, mfu = 0;
};

class Trainer {
 public:
  // With resume, continues from `cfg.out_dir/latest` (an error if there is none).
  Trainer(TrainConfig cfg, bool resume);
  // Trains until cfg.steps; returns the last step's metrics.
  StepMetrics run();
  // Mean loss over cfg.eval_batches held-out batches (train shard when no val shard). In a
  // data-parallel job every rank evaluates its share and every rank must call it.
  double evaluate();
  // Writes ckpt-<step> and points `latest` at it; keeps the two newest checkpoints. Only rank 0
  // writes (the others return "").
  std::string save(int64_t step);

  LoopedLM& model() { return model_; }
  const TrainConfig& config() const { return cfg_; }
  int64_t start_step() const { return start_step_; }
  // This process's rank and the number of ranks (0 and 1 outside a data-parallel job).
  int rank() const;
  int world_size() const;
  // Called after every step (tests, progress display).
  std::function<void(const StepMetrics&)> on_step;

 private:
  struct Impl;
  TrainConfig cfg_;
  LoopedLM model_{nullptr};
  std::shared_ptr<Impl> impl_;
  int64_t start_step_ = 0;
};

// The newest complete checkpoint folder of a run, or "" when none.
std::string latest_checkpoint(const std::string& out_dir);

}  // namespace lt2
