// The curriculum runner behind `lt2 tasks run`: trains a looped model on a synthetic task (tasks/
// generators.h) stage by stage (tasks/curriculum.h), evaluating every `eval_every` steps of a
// stage on held-out examples, and resumes exactly after an interruption. The loop is the
// Trainer's (train/trainer.h); the curriculum plugs into it as callbacks: the current stage's
// batches, the masked loss, the constant schedule, a stop test, evaluation and stage switching
// after each step, and its state in every checkpoint.
//
// Step s trains on train-stream examples [s B, (s + 1) B) of the current stage's n; the torch RNG
// is re-seeded from (seed, s) (random patterns draw from it), so a step depends only on its
// number, the stage and the weights. Evaluations use eval-stream examples [0, eval_examples) of
// the stage's n. The learning rate warms up linearly over `warmup` steps, then stays constant
// (the curriculum decides how long training lasts).
//
// Run folder (out_dir):
//   run_config.json   the resolved TaskRunConfig (checked on --resume)
//   results.json      status, n_max, per-stage results, every evaluation (rewritten at each one)
//   curve.png         exact-match and per-answer accuracy vs step, stage starts marked (gnuplot)
//   ckpt-<step>/      config.json, model.safetensors, optimizer.safetensors, trainer_state.json
//                     (step, curriculum, timing), written at every evaluation and when the run stops
//   latest            name of the newest complete checkpoint folder
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "lt2/config/model_config.h"
#include "lt2/tasks/curriculum.h"
#include "lt2/tasks/generators.h"
#include "lt2/train/trainer.h"

namespace lt2::tasks {

struct TaskRunConfig {
  // Model: a preset name or model-config JSON, then these overrides (empty / 0 = keep).
  std::string model = "tiny-full";
  std::string pattern;
  int64_t n_loops = 0, d_model = 0, n_layers = 0, n_heads = 0;
  // Task (tasks/generators.h).
  std::string task = "swap-recall";
  int64_t pool = 256;        // keys and values of the recall tasks; must cover the last stage's n
  int64_t max_queries = 32;
  // Curriculum.
  CurriculumConfig curriculum;
  int64_t eval_every = 100;     // steps of a stage between evaluations
  int64_t eval_examples = 256;  // held-out examples per evaluation
  // Optimisation: AdamW (train/optimizer.h), linear warm-up then a constant learning rate.
  int64_t batch_size = 32;
  double lr = 1e-3;
  int64_t warmup = 100;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;  // max global grad norm (0 = off)
  uint64_t seed = 1234;
  std::string device = "auto";  // auto | cpu | cuda
  std::string dtype = "auto";   // auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
  int64_t log_every = 100;      // a log line every N steps
  std::string out_dir = "runs/tasks";

  TaskKind task_kind() const { return parse_task(task); }
  TaskParams task_params(int64_t n) const;
  void validate() const;  // throws lt2::Error naming the field
  json to_json() const;
  static TaskRunConfig from_json(const json& j, const std::string& where = "task run config");
};

// Fields of two run configs that differ and change what a run computes (everything except
// out_dir and log_every), as "field: a -> b" lines; empty when a run may resume under `b`.
std::vector<std::string> run_config_differences(const TaskRunConfig& a, const TaskRunConfig& b);

// The model config of a run: the preset or file with the overrides applied, vocab_size set to the
// task's (an explicit one must cover it), max_seq_len raised to the longest sequence of the
// curriculum. Validated.
ModelConfig resolve_model_config(const TaskRunConfig& cfg);

// When to stop a run early, resumably (a checkpoint is written at the stop).
struct RunLimits {
  int64_t stop_at_step = 0;  // stop once this global step is done (0 = no limit)
  double max_seconds = 0;    // stop after this much wall time in this process (0 = no limit)
};

enum class RunStatus { Running, Stopped, Finished };
std::string to_string(RunStatus s);  // "running", "stopped", "finished"

struct TaskRunSummary {
  RunStatus status = RunStatus::Running;
  int64_t step = 0;   // global steps done
  int64_t n_max = 0;  // largest n solved (0 if none)
  std::vector<StageResult> stages;  // closed stages, in order
  std::vector<EvalRecord> evals;
  double train_seconds = 0;  // wall time in training steps, over every resume
  std::string png;           // the learning-curve plot, "" when gnuplot is absent
};

class TaskRunner {
 public:
  // With resume, continues from out_dir/latest (an error if there is none, or if out_dir's
  // run_config.json differs from `cfg`); without, out_dir must not hold a run yet.
  // Log lines go to `log` (nullptr: silent).
  TaskRunner(TaskRunConfig cfg, bool resume, std::FILE* log = stdout);
  ~TaskRunner();
  // Trains until the curriculum finishes or a limit is hit; writes results.json and curve.png.
  TaskRunSummary run(const RunLimits& limits = {});

  const TaskRunConfig& config() const { return cfg_; }
  const ModelConfig& model_config() const;
  int64_t num_parameters() const;
  int64_t start_step() const;

 private:
  // The curriculum's parts of the trainer's loop (train/trainer.h, TrainerCallbacks).
  void on_step(const StepMetrics& m);
  std::pair<AnswerCounts, double> evaluate();  // on the stage's held-out examples: counts, loss
  void save();                                 // a checkpoint of this step, unless there is one
  void write_results();
  struct Impl;
  TaskRunConfig cfg_;
  std::unique_ptr<Impl> impl_;
};

// results.json of a run folder, or a null JSON when there is none yet.
json read_results(const std::string& out_dir);

}  // namespace lt2::tasks
