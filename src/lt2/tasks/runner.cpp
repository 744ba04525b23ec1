#include "lt2/tasks/runner.h"

#include <chrono>
#include <cmath>

#include "lt2/config/presets.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/tasks/report.h"
#include "lt2/train/autocast.h"
#include "lt2/train/optimizer.h"
#include "lt2/train/run_checkpoint.h"
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
  torch::Device device{torch::kCPU};
  bool autocast = false;
  LoopedLM model{nullptr};
  std::unique_ptr<AdamW> opt;
  std::vector<torch::Tensor> params;
  Curriculum curriculum;
  int64_t step = 0, start_step = 0, saved_step = -1;
  double train_seconds = 0;
  std::FILE* log = nullptr;
  int64_t eval_n = 0;  // n of the cached eval set
  Example eval_set;    // on the device

  void say(const std::string& line) const {
    if (!log) return;
    std::fprintf(log, "%s\n", line.c_str());
    std::fflush(log);
  }
};

TaskRunner::~TaskRunner() = default;

TaskRunner::TaskRunner(TaskRunConfig cfg, bool resume, std::FILE* log)
    : cfg_(std::move(cfg)), impl_(std::make_unique<Impl>()) {
  cfg_.validate();
  auto& I = *impl_;
  I.log = log;
  const bool cuda = torch::cuda::is_available();
  LT2_CHECK(!(cfg_.device == "cuda" && !cuda), "device 'cuda' requested but no CUDA GPU is available");
  I.device = (cfg_.device == "cuda" || (cfg_.device == "auto" && cuda)) ? torch::Device(torch::kCUDA)
                                                                        : torch::Device(torch::kCPU);
  LT2_CHECK(!(cfg_.dtype == "bf16" && !I.device.is_cuda()),
            "dtype 'bf16' (autocast) needs a CUDA device; use fp32 on the CPU");
  I.autocast = I.device.is_cuda() && cfg_.dtype != "fp32";

  const std::string& out = cfg_.out_dir;
  const std::string config_path = out + "/run_config.json";
  std::string ckpt;
  if (resume) {
    ckpt = latest_checkpoint(out);
    LT2_CHECK(!ckpt.empty(), "--resume: no checkpoint in '", out, "' (no 'latest' file)");
    LT2_CHECK(path_exists(config_path), "--resume: '", out, "' has a checkpoint but no run_config.json: not a task run folder");
    const auto stored = TaskRunConfig::from_json(load_json_file(config_path), "'" + config_path + "'");
    const auto diffs = run_config_differences(stored, cfg_);
    std::string listed;
    for (const auto& d : diffs) listed += "\n  " + d;
    LT2_CHECK(diffs.empty(), "--resume: the run in '", out, "' was started with another config:", listed);
    const std::string state_path = ckpt + "/trainer_state.json";
    try {
      const json state = load_json_file(state_path);
      I.curriculum = Curriculum::from_json(state.at("curriculum"));
      I.step = state.at("step").get<int64_t>();
      I.train_seconds = state.at("train_seconds").get<double>();
    } catch (const json::exception& e) {
      throw Error(cat("'", state_path, "' is not the state of a task run: ", e.what()));
    }
    I.model = load_checkpoint(ckpt);
    I.saved_step = I.step;
  } else {
    LT2_CHECK(!path_exists(out + "/latest"), "'", out, "' already holds a run (", out,
              "/latest exists): pass --resume to continue it, or choose another output folder");
    I.curriculum = Curriculum(cfg_.curriculum);
    const ModelConfig mcfg = resolve_model_config(cfg_);
    torch::manual_seed(cfg_.seed);
    I.model = LoopedLM(mcfg);
  }
  I.start_step = I.step;
  const int64_t task_vocab = vocab_size(cfg_.task_params(stage_n(1)));
  LT2_CHECK(I.model->config().vocab_size >= task_vocab, "checkpoint model has vocab_size ",
            I.model->config().vocab_size, " < the task's ", task_vocab);
  I.model->to(I.device);

  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : I.model->named_parameters()) {
    named.emplace_back(p.key(), p.value());
    I.params.push_back(p.value());
  }
  I.opt = std::make_unique<AdamW>(named, AdamWOptions{cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay});
  if (resume) I.opt->load_state_dict(load_tensor_map(ckpt + "/optimizer.safetensors"));

  make_dirs(out);
  write_file_atomic(config_path, cfg_.to_json().dump(2) + "\n");
}

const ModelConfig& TaskRunner::model_config() const { return impl_->model->config(); }
int64_t TaskRunner::num_parameters() const { return impl_->model->num_parameters(); }
int64_t TaskRunner::start_step() const { return impl_->start_step; }

TaskRunSummary TaskRunner::run(const RunLimits& limits) {
  auto& I = *impl_;
  const auto run_start = Clock::now();
  const int64_t B = cfg_.batch_size;
  const auto& mcfg = I.model->config();
  const bool ouro_exit = static_cast<bool>(I.model->exit_gate);

  auto forward_logits = [&](const torch::Tensor& tokens) {
    ForwardOptions fo;
    fo.exit_at_loop = ouro_exit ? mcfg.n_loops : -1;  // Ouro form: the last loop's logits
    return I.model->forward(tokens, nullptr, fo).logits;  // [B, L, V]
  };

  auto evaluate = [&]() {
    const int64_t n = I.curriculum.n();
    if (I.eval_n != n) {  // the held-out set of this stage, generated once
      Example e = make_batch(cfg_.task_params(n), cfg_.seed, Stream::Eval, 0, cfg_.eval_examples);
      I.eval_set = {e.tokens.to(I.device), e.targets.to(I.device), e.mask.to(I.device)};
      I.eval_n = n;
    }
    torch::NoGradGuard ng;
    I.model->eval();
    AnswerCounts counts;
    double loss_sum = 0;
    for (int64_t first = 0; first < cfg_.eval_examples; first += B) {
      const int64_t b = std::min(B, cfg_.eval_examples - first);
      const auto tokens = I.eval_set.tokens.narrow(0, first, b);    // [b, L]
      const auto targets = I.eval_set.targets.narrow(0, first, b);  // [b, L]
      const auto mask = I.eval_set.mask.narrow(0, first, b);        // [b, L]
      AutocastScope ac(I.autocast);
      const auto logits = forward_logits(tokens);
      const AnswerCounts c = count_correct(logits, targets, mask);
      loss_sum += masked_cross_entropy(logits, targets, mask).item<double>() * static_cast<double>(c.answers);
      counts += c;
    }
    I.model->train();
    return std::make_pair(counts, loss_sum / static_cast<double>(counts.answers));
  };

  auto save = [&]() {
    if (I.saved_step == I.step) return;
    const json state{{"step", I.step}, {"curriculum", I.curriculum.to_json()},
                     {"train_seconds", I.train_seconds}, {"run_config", cfg_.to_json()}};
    save_rotating_checkpoint(cfg_.out_dir, I.step, I.model,
                             {safetensors_writer("optimizer.safetensors", I.opt->state_dict()),
                              text_writer("trainer_state.json", state.dump(2) + "\n")},
                             /*keep=*/1);
    I.saved_step = I.step;
  };

  RunStatus status = RunStatus::Running;
  auto write_results = [&]() {
    json stages = json::array();
    for (const auto& r : I.curriculum.results()) stages.push_back(to_json(r));
    json evals = json::array();
    for (const auto& e : I.curriculum.evals()) evals.push_back(to_json(e));
    json j{{"status", to_string(status)},
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
                      {"layer_mixers", I.model->layer_mixers()},
                      {"n_loops", mcfg.n_loops},
                      {"n_layers", mcfg.n_layers},
                      {"d_model", mcfg.d_model},
                      {"n_heads", mcfg.n_heads},
                      {"vocab_size", mcfg.vocab_size},
                      {"parameters", I.model->num_parameters()}}},
           {"config", cfg_.to_json()}};
    if (!I.curriculum.finished())
      j["current_stage"] = {{"stage", I.curriculum.stage()}, {"n", I.curriculum.n()},
                            {"start_step", I.curriculum.stage_start_step()}};
    write_file_atomic(cfg_.out_dir + "/results.json", j.dump(2) + "\n");
  };

  I.model->train();
  double window_loss = 0, window_seconds = 0;
  int64_t window_steps = 0;
  while (!I.curriculum.finished()) {
    if ((limits.stop_at_step > 0 && I.step >= limits.stop_at_step) ||
        (limits.max_seconds > 0 && seconds_since(run_start) >= limits.max_seconds)) {
      status = RunStatus::Stopped;
      break;
    }
    const auto t0 = Clock::now();
    const int64_t stage = I.curriculum.stage(), n = I.curriculum.n();
    torch::manual_seed(cfg_.seed + 1000003ULL * static_cast<uint64_t>(I.step + 1));
    const Example batch = make_batch(cfg_.task_params(n), cfg_.seed, Stream::Train, I.step * B, B);
    torch::Tensor loss;
    {
      AutocastScope ac(I.autocast);
      const auto logits = forward_logits(batch.tokens.to(I.device));
      loss = masked_cross_entropy(logits, batch.targets.to(I.device), batch.mask.to(I.device));
    }
    loss.backward();
    const double grad_norm = clip_grad_norm(I.params, cfg_.clip);  // synchronises the device
    // min_ratio 1: constant after the warm-up (so the total step count does not matter).
    const double lr = lr_at(I.step, I.step + 1, cfg_.warmup, cfg_.lr, /*min_ratio=*/1.0);
    I.opt->step(lr);
    I.opt->zero_grad();
    const double loss_value = loss.item<double>();
    ++I.step;
    LT2_CHECK(std::isfinite(loss_value), "loss is not finite at step ", I.step,
              " (lower the learning rate)");
    const double step_seconds = seconds_since(t0);
    I.train_seconds += step_seconds;
    window_loss += loss_value;
    window_seconds += step_seconds;
    ++window_steps;

    if (I.step % cfg_.log_every == 0) {
      const double k = static_cast<double>(window_steps);
      I.say(format("step %7lld | stage %lld (n %lld) | loss %.4f | gnorm %7.3f | lr %.2e | %7.1f ms/step",
                   (long long)I.step, (long long)stage, (long long)n, window_loss / k, grad_norm, lr,
                   1000 * window_seconds / k));
      window_loss = window_seconds = 0;
      window_steps = 0;
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
  if (I.curriculum.finished()) status = RunStatus::Finished;
  save();  // a stop between evaluations resumes from here
  write_results();

  TaskRunSummary s;
  s.status = status;
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
