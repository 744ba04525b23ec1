// The LT2 paper's curriculum as a state machine independent of the model, plus the
// masked metrics and loss of the synthetic tasks.
//
// Stage k (1-based) trains on n = 2^(k+2): 8, 16, 32, 64, 128, 256 for k = 1..6. A stage starts
// at the step where the previous one was solved (step 0 for stage 1). record_eval(step, acc):
//   - acc >= threshold (0.90): the stage is solved; the next stage starts at `step`, or the
//     curriculum finishes after the last stage;
//   - else, if step - stage start >= steps_per_stage: the stage failed, the curriculum finishes;
//   - else nothing changes.
// The score is the largest n solved (0 if none). The state round-trips through JSON (resume).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "lt2/util/json.h"

namespace lt2::tasks {

struct CurriculumConfig {
  int64_t num_stages = 6;            // stages 1..num_stages
  int64_t steps_per_stage = 100000;  // step budget of each stage
  double threshold = 0.90;           // exact-match accuracy that solves a stage
};

// n of stage k: 2^(k+2).
int64_t stage_n(int64_t stage);

struct StageResult {
  int64_t stage = 0, n = 0;
  bool solved = false;
  int64_t steps = 0;          // steps spent in the stage (to solve it, or the budget used)
  double final_accuracy = 0;  // accuracy of its last evaluation
};

struct EvalRecord {
  int64_t step = 0, stage = 0;
  double accuracy = 0;         // exact match: what the curriculum decides on
  double answer_accuracy = 0;  // fraction of scored answers right (diagnostic)
  double loss = 0;             // masked cross-entropy on the eval examples (diagnostic)
};

// JSON forms of the records (results.json, resume state); from_json throws json::exception on a
// missing field.
json to_json(const StageResult& r);
StageResult stage_result_from_json(const json& j);
json to_json(const EvalRecord& e);  // also carries n = stage_n(stage)
EvalRecord eval_record_from_json(const json& j);

class Curriculum {
 public:
  enum class Event { Continue, Advanced, Finished };

  explicit Curriculum(CurriculumConfig cfg = {});

  // Records an evaluation of the current stage at global `step` (non-decreasing, >= the stage's
  // start). Only `accuracy` (exact match) decides; the diagnostics are kept in evals(). Throws
  // lt2::Error once finished.
  Event record_eval(int64_t step, double accuracy, double answer_accuracy = 0, double loss = 0);

  bool finished() const { return finished_; }
  int64_t stage() const { return stage_; }           // current stage (the last one once finished)
  int64_t n() const { return stage_n(stage_); }      // n of the current stage
  int64_t stage_start_step() const { return stage_start_; }
  int64_t stage_end_step() const { return stage_start_ + cfg_.steps_per_stage; }  // budget end
  int64_t score() const;                             // largest n solved, 0 if none
  const CurriculumConfig& config() const { return cfg_; }
  const std::vector<StageResult>& results() const { return results_; }
  const std::vector<EvalRecord>& evals() const { return evals_; }

  json to_json() const;
  static Curriculum from_json(const json& j);

 private:
  CurriculumConfig cfg_;
  int64_t stage_ = 1, stage_start_ = 0, last_step_ = 0;
  bool finished_ = false;
  std::vector<StageResult> results_;  // closed stages, in order
  std::vector<EvalRecord> evals_;
};

// Argmax predictions scored against the targets on the masked positions.
struct AnswerCounts {
  int64_t examples = 0, examples_correct = 0;  // an example is correct if all its answers are
  int64_t answers = 0, answers_correct = 0;    // scored positions
  AnswerCounts& operator+=(const AnswerCounts& o);
};
// logits [B, L, V], targets [B, L] int64, mask [B, L] bool. An example without scored positions
// counts as correct.
AnswerCounts count_correct(const torch::Tensor& logits, const torch::Tensor& targets,
                           const torch::Tensor& mask);

// Fraction of examples whose scored positions are all predicted right (argmax).
double exact_match_accuracy(const torch::Tensor& logits, const torch::Tensor& targets,
                            const torch::Tensor& mask);

// Mean cross-entropy (fp32) over the scored positions; logits [B, L, V], targets, mask [B, L].
torch::Tensor masked_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                   const torch::Tensor& mask);

}  // namespace lt2::tasks
