#include "lt2/tasks/runner.h"

#include <chrono>
#include <cmath>
#include <limits>

#include "lt2/config/presets.h"
#include "lt2/tasks/report.h"
#include "lt2/train/autocast.h"
#include "lt2/train/optimizer.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"
#include "lt2/util/gnuplot.h"

namespace lt2::tasks {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

template <typename... Args>
std::string format(const char* f, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

// Fields that do not change what a run computes: a run may resume with other values.
const char* const kCosmeticFields[] = {"out_dir", "log_every"};


}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

TaskParams TaskRunConfig::task_params(int64_t n) const {
  TaskParams p;
  p.kind = task_kind();
  p.n = n;
  p.pool = pool;
  p.max_queries = max_queries;
  return p;
}

void TaskRunConfig::validate() const {
  const std::string w = "task run config";
  LT2_CHECK(!model.empty(), w, ": 'model' (a preset name or a model config JSON) is required");
  parse_task(task);
  Curriculum check(curriculum);  // validates num_stages, steps_per_stage, threshold
  const int64_t last_n = stage_n(curriculum.num_stages);
  if (task_kind() != TaskKind::S5)
    LT2_CHECK(pool >= last_n, w, ": 'pool' (", pool, ") must be >= the n of the last stage (",
              last_n, " at stage ", curriculum.num_stages, "); raise 'pool' or lower 'num_stages'");
  LT2_CHECK(max_queries >= 1, w, ": 'max_queries' must be >= 1, found ", max_queries);
  LT2_CHECK(n_loops >= 0 && d_model >= 0 && n_layers >= 0 && n_heads >= 0, w,
            ": n_loops, d_model, n_layers and n_heads must be >= 0 (0 = the model config's)");
  LT2_CHECK(eval_every >= 1, w, ": 'eval_every' must be >= 1, found ", eval_every);
  LT2_CHECK(eval_examples >= 1, w, ": 'eval_examples' must be >= 1, found ", eval_examples);
  LT2_CHECK(batch_size >= 1, w, ": 'batch_size' must be >= 1, found ", batch_size);
  LT2_CHECK(lr > 0, w, ": 'lr' must be > 0, found ", lr);
  LT2_CHECK(warmup >= 0, w, ": 'warmup' must be >= 0, found ", warmup);
  LT2_CHECK(weight_decay >= 0, w, ": 'weight_decay' must be >= 0, found ", weight_decay);
  LT2_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, w, ": betas must be in [0, 1)");
  LT2_CHECK(eps > 0, w, ": 'eps' must be > 0");
  LT2_CHECK(clip >= 0, w, ": 'clip' must be >= 0 (0 = off), found ", clip);
  LT2_CHECK(device == "auto" || device == "cpu" || device == "cuda", w,
            ": 'device' must be auto, cpu or cuda, found '", device, "'");
  LT2_CHECK(dtype == "auto" || dtype == "fp32" || dtype == "bf16", w,
            ": 'dtype' must be auto, fp32 or bf16, found '", dtype, "'");
  LT2_CHECK(log_every >= 1, w, ": 'log_every' must be >= 1, found ", log_every);
  LT2_CHECK(!out_dir.empty(), w, ": 'out_dir' is required");
}

json TaskRunConfig::to_json() const {
  return json{{"model", model}, {"pattern", pattern}, {"n_loops", n_loops}, {"d_model", d_model},
              {"n_layers", n_layers}, {"n_heads", n_heads}, {"task", task}, {"pool", pool},
              {"max_queries", max_queries}, {"num_stages", curriculum.num_stages},
              {"steps_per_stage", curriculum.steps_per_stage}, {"threshold", curriculum.threshold},
              {"eval_every", eval_every}, {"eval_examples", eval_examples},
              {"batch_size", batch_size}, {"lr", lr}, {"warmup", warmup},
              {"weight_decay", weight_decay}, {"beta1", beta1}, {"beta2", beta2}, {"eps", eps},
              {"clip", clip}, {"seed", seed}, {"device", device}, {"dtype", dtype},
              {"log_every", log_every}, {"out_dir", out_dir}};
}

TaskRunConfig TaskRunConfig::from_json(const json& j, const std::string& where) {
  LT2_CHECK(j.is_object(), where, ": expected a JSON object, found ", json_type_name(j));
  TaskRunConfig c;
  json_reject_unknown_fields(j, c.to_json(), where);
  json_get(j, "model", c.model, where);
  json_get(j, "pattern", c.pattern, where);
  json_get(j, "n_loops", c.n_loops, where);
  json_get(j, "d_model", c.d_model, where);
  json_get(j, "n_layers", c.n_layers, where);
  json_get(j, "n_heads", c.n_heads, where);
  json_get(j, "task", c.task, where);
  json_get(j, "pool", c.pool, where);
  json_get(j, "max_queries", c.max_queries, where);
  json_get(j, "num_stages", c.curriculum.num_stages, where);
  json_get(j, "steps_per_stage", c.curriculum.steps_per_stage, where);
  json_get(j, "threshold", c.curriculum.threshold, where);
  json_get(j, "eval_every", c.eval_every, where);
  json_get(j, "eval_examples", c.eval_examples, where);
  json_get(j, "batch_size", c.batch_size, where);
  json_get(j, "lr", c.lr, where);
  json_get(j, "warmup", c.warmup, where);
  json_get(j, "weight_decay", c.weight_decay, where);
  json_get(j, "beta1", c.beta1, where);
  json_get(j, "beta2", c.beta2, where);
  json_get(j, "eps", c.eps, where);
  json_get(j, "clip", c.clip, where);
  json_get(j, "seed", c.seed, where);
  json_get(j, "device", c.device, where);
  json_get(j, "dtype", c.dtype, where);
  json_get(j, "log_every", c.log_every, where);
  json_get(j, "out_dir", c.out_dir, where);
  return c;
}

std::vector<std::string> run_config_differences(const TaskRunConfig& a, const TaskRunConfig& b) {
  json ja = a.to_json(), jb = b.to_json();
  for (const char* key : kCosmeticFields) {
    ja.erase(key);
    jb.erase(key);
  }
  std::vector<std::string> diffs;
  for (const auto& [key, value] : ja.items())
    if (value != jb[key]) diffs.push_back(cat(key, ": ", value.dump(), " -> ", jb[key].dump()));
  return diffs;
}

ModelConfig resolve_model_config(const TaskRunConfig& cfg) {
  cfg.validate();
  ModelConfig m = load_model_config(cfg.model);
  if (!cfg.pattern.empty()) m.layer_pattern = cfg.pattern;
  if (cfg.n_loops > 0) m.n_loops = cfg.n_loops;
  if (cfg.d_model > 0) m.d_model = cfg.d_model;
  if (cfg.n_layers > 0) m.n_layers = cfg.n_layers;
  if (cfg.n_heads > 0) m.n_heads = cfg.n_heads;
  const int64_t task_vocab = vocab_size(cfg.task_params(stage_n(1)));
  if (m.vocab_size == 0) m.vocab_size = task_vocab;
  LT2_CHECK(m.vocab_size >= task_vocab, "model '", cfg.model, "' has vocab_size ", m.vocab_size,
            " but task ", cfg.task, " (pool ", cfg.pool, ") uses ", task_vocab,
            " tokens; set vocab_size to 0 (= the task's) or >= ", task_vocab);
  // The model does not depend on max_seq_len; keep the config truthful about what it sees.
  m.max_seq_len = std::max(m.max_seq_len, seq_len(cfg.task_params(stage_n(cfg.curriculum.num_stages))));
  m.validate();
  return m;
}

std::string to_string(RunStatus s) {
  switch (s) {
    case RunStatus::Running: return "running";
    case RunStatus::Stopped: return "stopped";
    case RunStatus::Finished: return "finished";
  }
  return "?";
}

json read_results(const std::string& out_dir) {
  const std::string path = out_dir + "/results.json";
  return path_exists(path) ? load_json_file(path) : json();
}

// ---------------------------------------------------------------------------------------------
// Runner

struct TaskRunner::Impl {
  Curriculum curriculum;
  std::unique_ptr<Trainer> trainer;
  int64_t step = 0, start_step = 0, saved_step = -1;
  double train_seconds = 0;
  std::FILE* log = nullptr;
  int64_t eval_n = 0;  // n of the cached eval set
  Example eval_set;    // on the device
  // This run() call: its limits and start, and how it ended.
  RunLimits limits;
  Clock::time_point run_start;
  RunStatus status = RunStatus::Running;
  // Steps since the last log line.
  double window_loss = 0, window_seconds = 0;
  int64_t window_steps = 0;

  void say(const std::string& line) const {
    if (!log) return;
    std::fprintf(log, "%s\n", line.c_str());
    std::fflush(log);
  }
};

TaskRunner::~TaskRunner() = default;

namespace {

// The trainer settings of a task run: one micro-batch of batch_size examples per step, no step
// budget (the curriculum ends the run), no evaluation or checkpoint schedule of its own.
TrainConfig trainer_config(const TaskRunConfig& c) {
  TrainConfig t;
  t.model = c.model;
  t.out_dir = c.out_dir;
  t.device = c.device;
  t.dtype = c.dtype;
  t.batch_size = c.batch_size;
  t.grad_accum = 1;
  t.steps = std::numeric_limits<int64_t>::max();
  t.lr = c.lr;
  t.warmup = c.warmup;
  t.weight_decay = c.weight_decay;
  t.beta1 = c.beta1;
  t.beta2 = c.beta2;
  t.eps = c.eps;
  t.clip = c.clip;
  t.seed = c.seed;
  t.log_every = c.log_every;
  t.eval_every = 0;
  t.save_every = 0;
  return t;
}

// Logits of the exit the task scores: the last loop's (Ouro form: its exit at loop T).
torch::Tensor forward_logits(LoopedLM& model, const torch::Tensor& tokens, ForwardOptions fo = {}) {
  fo.exit_at_loop = model->exit_gate ? model->config().n_loops : -1;
  return model->forward(tokens, nullptr, fo).logits;  // [B, L, V]
}

}  // namespace

TaskRunner::TaskRunner(TaskRunConfig cfg, bool resume, std::FILE* log)
    : cfg_(std::move(cfg)), impl_(std::make_unique<Impl>()) {
  cfg_.validate();
  auto& I = *impl_;
  I.log = log;
  const std::string out = cfg_.out_dir;
  const std::string config_path = out + "/run_config.json";
  if (resume) {
    const std::string ckpt = latest_checkpoint(out);
    LT2_CHECK(!ckpt.empty(), "--resume: no checkpoint in '", out, "' (no 'latest' file)");
    LT2_CHECK(path_exists(config_path), "--resume: '", out, "' has a checkpoint but no run_config.json: not a task run folder");
    const auto stored = TaskRunConfig::from_json(load_json_file(config_path), "'" + config_path + "'");
    const auto diffs = run_config_differences(stored, cfg_);
    std::string listed;
    for (const auto& d : diffs) listed += "\n  " + d;
    LT2_CHECK(diffs.empty(), "--resume: the run in '", out, "' was started with another config:", listed);
  } else {
    LT2_CHECK(!path_exists(out + "/latest"), "'", out, "' already holds a run (", out,
              "/latest exists): pass --resume to continue it, or choose another output folder");
    I.curriculum = Curriculum(cfg_.curriculum);
  }

  // The curriculum as callbacks of the trainer's loop.
  TrainerCallbacks cb;
  cb.model_config = [this] { return resolve_model_config(cfg_); };
  // Step s trains on train-stream examples [s B, (s + 1) B) of the current stage's n.
  cb.batch = [this](int64_t step, int64_t) {
    const int64_t B = cfg_.batch_size;
    Example e = make_batch(cfg_.task_params(impl_->curriculum.n()), cfg_.seed, Stream::Train, step * B, B);
    return Batch{e.tokens, e.targets, e.mask, nullptr};
  };
  cb.loss = [](LoopedLM& model, const Batch& b, const ForwardOptions& fo) {
    return masked_cross_entropy(forward_logits(model, b.inputs, fo), b.targets, b.mask);
  };
  // min_ratio 1: constant after the warm-up (so the total step count does not matter).
  cb.lr = [this](int64_t step) { return lr_at(step, step + 1, cfg_.warmup, cfg_.lr, /*min_ratio=*/1.0); };
  cb.stop_before = [this](int64_t) {
    auto& I = *impl_;
    if (I.curriculum.finished()) return true;
    if ((I.limits.stop_at_step > 0 && I.step >= I.limits.stop_at_step) ||
        (I.limits.max_seconds > 0 && seconds_since(I.run_start) >= I.limits.max_seconds)) {
      I.status = RunStatus::Stopped;
      return true;
    }
    return false;
  };
  cb.after_step = [this](const StepMetrics& m) { on_step(m); };
  cb.save_state = [this] {
    return json{{"curriculum", impl_->curriculum.to_json()}, {"train_seconds", impl_->train_seconds},
                {"run_config", cfg_.to_json()}};
  };
  cb.load_state = [this, out](const json& state) {
    const std::string where = cat("'", latest_checkpoint(out), "/trainer_state.json' (the state of a task run)");
    impl_->curriculum = Curriculum::from_json(json_require<json>(state, "curriculum", where));
    impl_->train_seconds = json_require<double>(state, "train_seconds", where);
  };
  cb.keep_checkpoints = 1;
  cb.run_files = false;   // run_config.json and results.json instead
  cb.step_lines = false;  // a line per log_every steps with the stage: on_step
  cb.data_parallel = false;
  I.trainer = std::make_unique<Trainer>(trainer_config(cfg_), resume, std::move(cb));
  I.step = I.start_step = I.trainer->start_step();
  if (resume) I.saved_step = I.step;
  const auto& model = I.trainer->model();
  const int64_t task_vocab = vocab_size(cfg_.task_params(stage_n(1)));
  LT2_CHECK(model->config().vocab_size >= task_vocab, "checkpoint model has vocab_size ",
            model->config().vocab_size, " < the task's ", task_vocab);

  make_dirs(out);
  write_file_atomic(config_path, cfg_.to_json().dump(2) + "\n");
}

const ModelConfig& TaskRunner::model_config() const { return impl_->trainer->model()->config(); }
int64_t TaskRunner::num_parameters() const { return impl_->trainer->model()->num_parameters(); }
int64_t TaskRunner::start_step() const { return impl_->start_step; }

std::pair<AnswerCounts, double> TaskRunner::evaluate() {
  auto& I = *impl_;
  Trainer& t = *I.trainer;
  LoopedLM& model = t.model();
  const int64_t B = cfg_.batch_size;
  const int64_t n = I.curriculum.n();
  if (I.eval_n != n) {  // the held-out set of this stage, generated once
    Example e = make_batch(cfg_.task_params(n), cfg_.seed, Stream::Eval, 0, cfg_.eval_examples);
    I.eval_set = {e.tokens.to(t.device()), e.targets.to(t.device()), e.mask.to(t.device())};
    I.eval_n = n;
  }
  torch::NoGradGuard ng;
  model->eval();
  AnswerCounts counts;
  double loss_sum = 0;
  for (int64_t first = 0; first < cfg_.eval_examples; first += B) {
    const int64_t b = std::min(B, cfg_.eval_examples - first);
    const auto tokens = I.eval_set.tokens.narrow(0, first, b);    // [b, L]
    const auto targets = I.eval_set.targets.narrow(0, first, b);  // [b, L]
    const auto mask = I.eval_set.mask.narrow(0, first, b);        // [b, L]
    AutocastScope ac(t.autocast());
    const auto logits = forward_logits(model, tokens);
    const AnswerCounts c = count_correct(logits, targets, mask);
    loss_sum += masked_cross_entropy(logits, targets, mask).item<double>() * static_cast<double>(c.answers);
    counts += c;
  }
  model->train();
  return {counts, loss_sum / static_cast<double>(counts.answers)};
}

void TaskRunner::save() {
  auto& I = *impl_;
  if (I.saved_step == I.step) return;
  I.trainer->save(I.step);
  I.saved_step = I.step;
}

void TaskRunner::write_results() {
  auto& I = *impl_;
  const auto& model = I.trainer->model();
  const auto& mcfg = model->config();
  json stages = json::array();
  for (const auto& r : I.curriculum.results()) stages.push_back(to_json(r));
  json evals = json::array();
  for (const auto& e : I.curriculum.evals()) evals.push_back(to_json(e));
  json j{{"status", to_string(I.status)},
         {"task", cfg_.task},
         {"step", I.step},
         {"n_max", I.curriculum.score()},
         {"stages", stages},
         {"evals", evals},
         {"eval_examples", cfg_.eval_examples},
         {"train_seconds", I.train_seconds},
         {"ms_per_step", I.step > 0 ? 1000 * I.train_seconds / static_cast<double>(I.step) : 0.0},
         {"model", {{"name", mcfg.name},
                    {"layer_pattern", mcfg.layer_pattern},
                    {"layer_mixers", model->layer_mixers()},
                    {"n_loops", mcfg.n_loops},
                    {"n_layers", mcfg.n_layers},
                    {"d_model", mcfg.d_model},
                    {"n_heads", mcfg.n_heads},
                    {"vocab_size", mcfg.vocab_size},
                    {"parameters", model->num_parameters()}}},
         {"config", cfg_.to_json()}};
  if (!I.curriculum.finished())
    j["current_stage"] = {{"stage", I.curriculum.stage()}, {"n", I.curriculum.n()},
                          {"start_step", I.curriculum.stage_start_step()}};
  write_file_atomic(cfg_.out_dir + "/results.json", j.dump(2) + "\n");
}

// After each trainer step: the log line every log_every steps, and an evaluation every eval_every
// steps of a stage (and at its budget's end) that may advance the curriculum, then a checkpoint
// and results.json.
void TaskRunner::on_step(const StepMetrics& m) {
  auto& I = *impl_;
  const int64_t stage = I.curriculum.stage(), n = I.curriculum.n();
  I.step = m.step;
  const double step_seconds = m.ms / 1000;
  I.train_seconds += step_seconds;
  I.window_loss += m.loss;
  I.window_seconds += step_seconds;
  ++I.window_steps;

  if (I.step % cfg_.log_every == 0) {
    const double k = static_cast<double>(I.window_steps);
    I.say(format("step %7lld | stage %lld (n %lld) | loss %.4f | gnorm %7.3f | lr %.2e | %7.1f ms/step",
                 (long long)I.step, (long long)stage, (long long)n, I.window_loss / k, m.grad_norm, m.lr,
                 1000 * I.window_seconds / k));
    I.window_loss = I.window_seconds = 0;
    I.window_steps = 0;
  }
  const int64_t in_stage = I.step - I.curriculum.stage_start_step();
  if (in_stage % cfg_.eval_every == 0 || I.step == I.curriculum.stage_end_step()) {
    const auto [counts, eval_loss] = evaluate();
    const double exact = static_cast<double>(counts.examples_correct) / static_cast<double>(counts.examples);
    const double answers = static_cast<double>(counts.answers_correct) / static_cast<double>(counts.answers);
    const auto event = I.curriculum.record_eval(I.step, exact, answers, eval_loss);
    std::string what;
    if (event == Curriculum::Event::Advanced)
      what = format(" | solved in %lld steps -> stage %lld (n %lld)", (long long)in_stage,
                    (long long)I.curriculum.stage(), (long long)I.curriculum.n());
    else if (event == Curriculum::Event::Finished)
      what = format(I.curriculum.results().back().solved ? " | solved in %lld steps: curriculum done"
                                                         : " | budget of %lld steps spent: curriculum done",
                    (long long)in_stage);
    I.say(format("eval  %7lld | stage %lld (n %lld) | exact match %.4f | answers %.4f | loss %.4f",
                 (long long)I.step, (long long)stage, (long long)n, exact, answers, eval_loss) + what);
    save();
    write_results();
  }
}

TaskRunSummary TaskRunner::run(const RunLimits& limits) {
  auto& I = *impl_;
  I.limits = limits;
  I.run_start = Clock::now();
  I.status = RunStatus::Running;
  I.window_loss = I.window_seconds = 0;
  I.window_steps = 0;
  I.trainer->run();  // until the curriculum finishes or a limit is hit (stop_before)
  if (I.curriculum.finished()) I.status = RunStatus::Finished;
  save();  // a stop between evaluations resumes from here
  write_results();

  const auto& mcfg = I.trainer->model()->config();
  TaskRunSummary s;
  s.status = I.status;
  s.step = I.step;
  s.n_max = I.curriculum.score();
  s.stages = I.curriculum.results();
  s.evals = I.curriculum.evals();
  s.train_seconds = I.train_seconds;
  const std::string title = cat(mcfg.name, " (", mcfg.layer_pattern, ", T ", mcfg.n_loops, ") on ",
                                cfg_.task, ": n_max ", s.n_max);
  if (find_gnuplot().empty())
    I.say("gnuplot not found: no curve.png (results.json holds the curve)");
  else if (plot_learning_curve(cfg_.out_dir + "/curve.png", s.evals, cfg_.curriculum.threshold, title))
    s.png = cfg_.out_dir + "/curve.png";
  return s;
}

}  // namespace lt2::tasks
