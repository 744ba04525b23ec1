// The training stages of a distillation, each a Trainer run (lt2/train/trainer.h) that starts from a
// student checkpoint (`cfg.init_from`) or resumes its run folder (`cfg.out_dir`).
#pragma once
#include <string>
#include <vector>

#include "lt2/data/shard.h"
#include "lt2/model/looped_lm.h"
#include "lt2/train/trainer.h"

namespace lt2::distill {

struct StageResult {
  StepMetrics last;        // the last step's metrics (step 0 when none ran)
  std::string checkpoint;  // the run folder's latest checkpoint
  torch::Device device{torch::kCPU};  // where it ran, and whether under bf16 autocast
  bool autocast = false;
};

// Stage 1: only the student mixers of `layers` train, on alignment_loss against `teacher`.
StageResult run_align(LoopedLMImpl& teacher, const TrainConfig& cfg, const std::vector<int64_t>& layers, bool resume);

// Stage 2: everything trains on kd_loss against `teacher` with per-loop `weights`; the student
// mixers of `layers` at the schedule's learning rate, the rest at `other_lr_scale` times it.
// `step_lines` false: no log line per step (the selection's probes).
StageResult run_kd(LoopedLMImpl& teacher, const TrainConfig& cfg, const std::vector<int64_t>& layers,
                   const std::vector<double>& weights, double other_lr_scale, bool resume, bool step_lines = true);

// Stage 3: cross-entropy (cfg.objective), no teacher: `lt2 train` from the kd student.
StageResult run_long(const TrainConfig& cfg, bool resume);

// Mean kd_loss of `student` against `teacher` over `batches` held-out batches of `shard`
// (BatchSampler::eval_batch), without gradients, on `device` (bf16 autocast when `autocast`).
double held_out_kl(LoopedLMImpl& teacher, LoopedLMImpl& student, std::shared_ptr<const ShardReader> shard, const TrainConfig& cfg,
                   int64_t batches, const std::vector<double>& weights, torch::Device device, bool autocast);

}  // namespace lt2::distill
