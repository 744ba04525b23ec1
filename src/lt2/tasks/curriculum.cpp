#include "lt2/tasks/curriculum.h"

#include <algorithm>

#include "lt2/util/error.h"

namespace lt2::tasks {

int64_t stage_n(int64_t stage) {
  LT2_CHECK(stage >= 1 && stage <= 60, "curriculum stage must be in [1, 60], got ", stage);
  return int64_t{1} << (stage + 2);
}

json to_json(const StageResult& r) {
  return {{"stage", r.stage}, {"n", r.n}, {"solved", r.solved}, {"steps", r.steps},
          {"final_accuracy", r.final_accuracy}};
}

StageResult stage_result_from_json(const json& j) {
  const std::string w = "curriculum JSON: stage result";
  return {json_require<int64_t>(j, "stage", w), json_require<int64_t>(j, "n", w), json_require<bool>(j, "solved", w),
          json_require<int64_t>(j, "steps", w), json_require<double>(j, "final_accuracy", w)};
}

json to_json(const EvalRecord& e) {
  return {{"step", e.step}, {"stage", e.stage}, {"n", stage_n(e.stage)}, {"accuracy", e.accuracy},
          {"answer_accuracy", e.answer_accuracy}, {"loss", e.loss}};
}

EvalRecord eval_record_from_json(const json& j) {
  const std::string w = "curriculum JSON: evaluation";
  EvalRecord e{json_require<int64_t>(j, "step", w), json_require<int64_t>(j, "stage", w),
               json_require<double>(j, "accuracy", w), 0.0, 0.0};
  json_get(j, "answer_accuracy", e.answer_accuracy, w);
  json_get(j, "loss", e.loss, w);
  return e;
}

Curriculum::Curriculum(CurriculumConfig cfg) : cfg_(cfg) {
  LT2_CHECK(cfg_.num_stages >= 1, "curriculum needs >= 1 stage, got ", cfg_.num_stages);
  stage_n(cfg_.num_stages);  // validates the range
  LT2_CHECK(cfg_.steps_per_stage >= 1, "steps_per_stage must be >= 1, got ", cfg_.steps_per_stage);
  LT2_CHECK(cfg_.threshold > 0 && cfg_.threshold <= 1, "threshold must be in (0, 1], got ",
            cfg_.threshold);
}

Curriculum::Event Curriculum::record_eval(int64_t step, double accuracy, double answer_accuracy,
                                          double loss) {
  LT2_CHECK(!finished_, "record_eval on a finished curriculum");
  LT2_CHECK(step >= last_step_ && step >= stage_start_, "eval steps must not decrease: got ", step,
            " after ", last_step_);
  last_step_ = step;
  evals_.push_back({step, stage_, accuracy, answer_accuracy, loss});
  const int64_t spent = step - stage_start_;
  if (accuracy >= cfg_.threshold) {
    results_.push_back({stage_, n(), true, spent, accuracy});
    if (stage_ == cfg_.num_stages) {
      finished_ = true;
      return Event::Finished;
    }
    ++stage_;
    stage_start_ = step;
    return Event::Advanced;
  }
  if (spent >= cfg_.steps_per_stage) {
    results_.push_back({stage_, n(), false, spent, accuracy});
    finished_ = true;
    return Event::Finished;
  }
  return Event::Continue;
}

int64_t Curriculum::score() const {
  int64_t best = 0;
  for (const auto& r : results_)
    if (r.solved) best = std::max(best, r.n);
  return best;
}

json Curriculum::to_json() const {
  json j;
  j["config"] = {{"num_stages", cfg_.num_stages},
                 {"steps_per_stage", cfg_.steps_per_stage},
                 {"threshold", cfg_.threshold}};
  j["stage"] = stage_;
  j["stage_start_step"] = stage_start_;
  j["last_step"] = last_step_;
  j["finished"] = finished_;
  j["score"] = score();
  j["results"] = json::array();
  for (const auto& r : results_) j["results"].push_back(lt2::tasks::to_json(r));
  j["evals"] = json::array();
  for (const auto& e : evals_) j["evals"].push_back(lt2::tasks::to_json(e));
  return j;
}

Curriculum Curriculum::from_json(const json& j) {
  const std::string w = "curriculum JSON";
  CurriculumConfig cfg;
  const json c = json_require<json>(j, "config", w);
  cfg.num_stages = json_require<int64_t>(c, "num_stages", w + ": config");
  cfg.steps_per_stage = json_require<int64_t>(c, "steps_per_stage", w + ": config");
  cfg.threshold = json_require<double>(c, "threshold", w + ": config");
  Curriculum cur(cfg);
  cur.stage_ = json_require<int64_t>(j, "stage", w);
  LT2_CHECK(cur.stage_ >= 1 && cur.stage_ <= cfg.num_stages, w, ": stage ", cur.stage_, " outside [1, ",
            cfg.num_stages, "]");
  cur.stage_start_ = json_require<int64_t>(j, "stage_start_step", w);
  cur.last_step_ = json_require<int64_t>(j, "last_step", w);
  cur.finished_ = json_require<bool>(j, "finished", w);
  for (const auto& r : json_require<std::vector<json>>(j, "results", w)) cur.results_.push_back(stage_result_from_json(r));
  for (const auto& e : json_require<std::vector<json>>(j, "evals", w)) cur.evals_.push_back(eval_record_from_json(e));
  return cur;
}

AnswerCounts& AnswerCounts::operator+=(const AnswerCounts& o) {
  examples += o.examples;
  examples_correct += o.examples_correct;
  answers += o.answers;
  answers_correct += o.answers_correct;
  return *this;
}

AnswerCounts count_correct(const torch::Tensor& logits, const torch::Tensor& targets,
                           const torch::Tensor& mask) {
  LT2_CHECK(logits.dim() == 3 && targets.dim() == 2 && mask.sizes() == targets.sizes() &&
                logits.size(0) == targets.size(0) && logits.size(1) == targets.size(1),
            "count_correct: expected logits [B, L, V], targets and mask [B, L]; got ",
            logits.sizes(), ", ", targets.sizes(), ", ", mask.sizes());
  torch::NoGradGuard no_grad;
  const auto scored = mask.to(torch::kBool);                  // [B, L]
  const auto right = logits.argmax(-1) == targets;            // [B, L]
  const auto example_ok = (scored & ~right).any(1).logical_not();  // [B]
  AnswerCounts c;
  c.examples = targets.size(0);
  c.examples_correct = example_ok.sum().item<int64_t>();
  c.answers = scored.sum().item<int64_t>();
  c.answers_correct = (scored & right).sum().item<int64_t>();
  return c;
}

double exact_match_accuracy(const torch::Tensor& logits, const torch::Tensor& targets,
                            const torch::Tensor& mask) {
  const AnswerCounts c = count_correct(logits, targets, mask);
  return static_cast<double>(c.examples_correct) / static_cast<double>(c.examples);
}

torch::Tensor masked_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                   const torch::Tensor& mask) {
  LT2_CHECK(logits.dim() == 3 && targets.dim() == 2 && mask.sizes() == targets.sizes() &&
                logits.size(0) == targets.size(0) && logits.size(1) == targets.size(1),
            "masked_cross_entropy: expected logits [B, L, V], targets and mask [B, L]; got ",
            logits.sizes(), ", ", targets.sizes(), ", ", mask.sizes());
  const auto m = mask.to(torch::kFloat32);                       // [B, L]
  LT2_CHECK(m.sum().item<float>() > 0, "masked_cross_entropy: no scored position");
  const auto logp = torch::log_softmax(logits.to(torch::kFloat32), -1);   // [B, L, V]
  const auto nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);  // [B, L]
  return (nll * m).sum() / m.sum();
}

}  // namespace lt2::tasks
