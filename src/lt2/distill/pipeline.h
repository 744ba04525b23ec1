// `lt2 distill`: converts a looped transformer (lt2 or Ouro checkpoint, or a preset with random
// weights) into an LT2 hybrid in the stages of spec/models.md §4, each an ordinary training run of
// the Trainer (lt2/train/trainer.h: log line per step, metrics.jsonl, checkpoints, exact --resume,
// progress bar) in its own folder under the output folder:
//   align   stage 1: only the student mixers train, toward the teacher attention's outputs on
//           the same inputs in every (layer, loop) (distill/losses.h: alignment_loss)
//   select  KL-guided layer selection (distill/selection.h): which layers to restore to full
//           attention; selection.json / selection.md
//   kd      stage 2: KL(teacher || student) per loop exit, the student mixers at `lr`, the rest at
//           `other_lr`, on the hybrid with the selected (or configured) layers kept full attention
//   long    stage 3: plain cross-entropy at a longer sequence length, no teacher
// Output folder: distill_config.json, init-align/ and init-kd/ (the students each stage starts
// from), align/, select/, kd/, long/ (run folders; each stage's student is its run's latest
// checkpoint, an ordinary lt2 checkpoint).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "lt2/distill/config.h"

namespace lt2::distill {

// The teacher: a checkpoint folder (lt2 or Ouro), or a model preset / config JSON built with random
// weights from `seed` (vocab_size 0 takes the training shard's). On the CPU, in eval mode, frozen.
LoopedLM load_teacher(const std::string& teacher, const TrainConfig& train);

struct DistillRun {
  std::string teacher;  // what load_teacher takes
  DistillConfig config;
  std::string out;      // output folder
  bool resume = false;  // continue each stage from its run folder's latest checkpoint
};

// Runs the stages in order; a stage whose run folder already holds its final checkpoint is skipped
// under `resume`. Returns the last stage's student checkpoint folder.
std::string run_distill(const DistillRun& run, const std::vector<Stage>& stages);

// The newest checkpoint of a stage's run folder under `out`; throws naming the stage to run first
// when there is none.
std::string stage_student(const std::string& out, Stage s);

}  // namespace lt2::distill
