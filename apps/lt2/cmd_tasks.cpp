// lt2 tasks run | sweep: the synthetic state-tracking + recall curriculum (src/lt2/tasks/).
#include <torch/torch.h>
#include <unistd.h>

#include <climits>
#include <cstdio>

#include "commands.h"
#include "lt2/tasks/runner.h"
#include "lt2/tasks/sweep.h"
#include "lt2/util/fs.h"

namespace lt2::cli {

namespace {

// Flags shared by `run` and `sweep`; those not given keep the --config file's value or the default.
struct RunFlags {
  std::string config;
  std::optional<std::string> model, task, device, dtype, out_dir;
  std::optional<int64_t> d_model, n_layers, n_heads, pool, max_queries;
  std::optional<int64_t> stages, steps_per_stage, eval_every, eval_examples;
  std::optional<int64_t> batch_size, warmup, log_every, seed;
  std::optional<double> threshold, lr, weight_decay, clip;
  double max_seconds = 0;
  int threads = 0;
  bool json_out = false;
};

void add_run_flags(CLI::App* cmd, RunFlags& f) {
  cmd->add_option("--config", f.config, "Task run config JSON (fields below in snake_case; flags override it)");
  cmd->add_option("--model", f.model, "Model preset name or model config JSON (default tiny-full)");
  cmd->add_option("--d-model", f.d_model, "Override the model width (0: the model config's)");
  cmd->add_option("--layers", f.n_layers, "Override the number of layers N (0: the model config's)");
  cmd->add_option("--heads", f.n_heads, "Override the number of attention heads (0: the model config's)");
  cmd->add_option("--task", f.task, "swap-recall (default; the curriculum task) | mqar (recall only) | s5 (state tracking only)");
  cmd->add_option("--pool", f.pool, "Key and value pool of the recall tasks (default 256; vocab = 3 + 2 x pool; must be >= the last stage's n)");
  cmd->add_option("--max-queries", f.max_queries, "Queries per recall example: min(n, this) (default 32)");
  cmd->add_option("--stages", f.stages, "Curriculum stages; stage k has n = 2^(k+2) (default 6: n = 8 ... 256)");
  cmd->add_option("--steps-per-stage", f.steps_per_stage, "Step budget of each stage; a stage not solved within it ends the run (default 100000)");
  cmd->add_option("--threshold", f.threshold, "Exact-match accuracy that solves a stage (default 0.9)");
  cmd->add_option("--eval-every", f.eval_every, "Evaluate every E steps of a stage (default 100)");
  cmd->add_option("--eval-examples", f.eval_examples, "Held-out examples per evaluation (default 256)");
  cmd->add_option("--batch-size", f.batch_size, "Training examples per step (default 32)");
  cmd->add_option("--lr", f.lr, "Learning rate after warm-up (AdamW, constant; default 1e-3)");
  cmd->add_option("--warmup", f.warmup, "Linear warm-up steps (default 100)");
  cmd->add_option("--weight-decay", f.weight_decay, "AdamW weight decay on matrices (default 0.1)");
  cmd->add_option("--clip", f.clip, "Max global gradient norm, 0 = off (default 1.0)");
  cmd->add_option("--seed", f.seed, "Seed of the initialisation and of the example streams (default 1234)");
  cmd->add_option("--device", f.device, "auto | cpu | cuda (default auto)");
  cmd->add_option("--dtype", f.dtype, "auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16");
  cmd->add_option("--log-every", f.log_every, "A log line every N steps (default 100)");
  cmd->add_option("--out", f.out_dir, "Output folder (default runs/tasks)");
  cmd->add_option("--max-seconds", f.max_seconds, "Stop a run after this wall time, resumably (0 = no limit)");
  cmd->add_option("--threads", f.threads, "Intra-op CPU threads of a run (0 = libtorch's default)");
  cmd->add_flag("--json", f.json_out, "Print a machine-readable summary on stdout at the end");
}

// The config file (if any) with the flags applied.
json flags_to_json(const RunFlags& f) {
  ConfigWithFlags flags(f.config);
  json& j = flags.j;
  flags.set("model", f.model);
  flags.set("task", f.task);
  flags.set("device", f.device);
  flags.set("dtype", f.dtype);
  flags.set("out_dir", f.out_dir);
  flags.set("d_model", f.d_model);
  flags.set("n_layers", f.n_layers);
  flags.set("n_heads", f.n_heads);
  flags.set("pool", f.pool);
  flags.set("max_queries", f.max_queries);
  flags.set("num_stages", f.stages);
  flags.set("steps_per_stage", f.steps_per_stage);
  flags.set("eval_every", f.eval_every);
  flags.set("eval_examples", f.eval_examples);
  flags.set("batch_size", f.batch_size);
  flags.set("warmup", f.warmup);
  flags.set("log_every", f.log_every);
  flags.set("seed", f.seed);
  flags.set("threshold", f.threshold);
  flags.set("lr", f.lr);
  flags.set("weight_decay", f.weight_decay);
  flags.set("clip", f.clip);
  return j;
}

std::string where(const RunFlags& f) { return f.config.empty() ? "task flags" : "'" + f.config + "' with flags"; }

void set_threads(int threads) {
  LT2_CHECK(threads >= 0, "--threads must be >= 0, found ", threads);
  if (threads > 0) torch::set_num_threads(threads);
}

struct RunArgs {
  RunFlags flags;
  std::optional<std::string> pattern;
  std::optional<int64_t> n_loops;
  int64_t stop_at = 0;
  bool resume = false;
};

void run_tasks(const RunArgs& a) {
  set_threads(a.flags.threads);
  json j = flags_to_json(a.flags);
  if (a.pattern) j["pattern"] = *a.pattern;
  if (a.n_loops) j["n_loops"] = *a.n_loops;
  const auto cfg = tasks::TaskRunConfig::from_json(j, where(a.flags));
  LT2_CHECK(a.flags.max_seconds >= 0 && a.stop_at >= 0, "--max-seconds and --stop-at must be >= 0");
  tasks::TaskRunner runner(cfg, a.resume);
  const auto& m = runner.model_config();
  std::printf("model %s: %.3fM parameters, %lld layers x %lld loops, pattern '%s', d %lld\n", m.name.c_str(),
              runner.num_parameters() / 1e6, (long long)m.n_layers, (long long)m.n_loops,
              m.layer_pattern.c_str(), (long long)m.d_model);
  std::printf("task %s, %lld stages (n %lld .. %lld), budget %lld steps/stage, threshold %.2f, batch %lld%s -> %s\n",
              cfg.task.c_str(), (long long)cfg.curriculum.num_stages, (long long)tasks::stage_n(1),
              (long long)tasks::stage_n(cfg.curriculum.num_stages), (long long)cfg.curriculum.steps_per_stage,
              cfg.curriculum.threshold, (long long)cfg.batch_size,
              a.resume ? (" (resumed at step " + std::to_string(runner.start_step()) + ")").c_str() : "",
              cfg.out_dir.c_str());
  std::fflush(stdout);
  const auto s = runner.run({a.stop_at, a.flags.max_seconds});
  std::printf("%s after %lld steps: n_max %lld", tasks::to_string(s.status).c_str(), (long long)s.step,
              (long long)s.n_max);
  for (const auto& r : s.stages)
    std::printf(" | n=%lld %s in %lld steps", (long long)r.n, r.solved ? "solved" : "not solved", (long long)r.steps);
  std::printf("\nresults: %s/results.json%s%s\n", cfg.out_dir.c_str(), s.png.empty() ? "" : ", ", s.png.c_str());
  if (a.flags.json_out) {
    json stages = json::array();
    for (const auto& r : s.stages) stages.push_back(tasks::to_json(r));
    std::printf("%s\n", json{{"status", tasks::to_string(s.status)}, {"n_max", s.n_max}, {"step", s.step},
                             {"stages", stages}, {"train_seconds", s.train_seconds},
                             {"out_dir", cfg.out_dir}, {"png", s.png}}.dump().c_str());
  }
}

struct SweepArgs {
  RunFlags flags;
  std::vector<std::string> models, patterns;
  std::vector<int64_t> loops;
  int jobs = 1;
};

std::string own_executable() {
  char buf[PATH_MAX];
  const ssize_t len = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  LT2_CHECK(len > 0, "cannot find the lt2 executable (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(len));
}

void run_sweep(const SweepArgs& a) {
  LT2_CHECK(a.flags.threads >= 0, "--threads must be >= 0, found ", a.flags.threads);
  tasks::SweepConfig cfg;
  json j = flags_to_json(a.flags);
  if (!j.contains("out_dir")) j["out_dir"] = "runs/tasks-sweep";
  cfg.base = tasks::TaskRunConfig::from_json(j, where(a.flags));
  for (const auto& m : a.models) cfg.models.push_back(tasks::parse_sweep_model(m));
  for (const auto& p : a.patterns) cfg.models.push_back(tasks::pattern_sweep_model(cfg.base.model, p));
  cfg.loops = a.loops;
  cfg.jobs = a.jobs;
  cfg.threads_per_run = a.flags.threads;
  cfg.max_seconds = a.flags.max_seconds;
  json table = tasks::run_sweep(cfg, own_executable());
  std::printf("\n%s\ntables: %s/sweep.md, %s/sweep.json\n", tasks::sweep_markdown(table).c_str(),
              cfg.base.out_dir.c_str(), cfg.base.out_dir.c_str());
  if (a.flags.json_out) {
    for (auto& r : table["runs"]) r.erase("evals");
    std::printf("%s\n", table.dump().c_str());
  }
}

}  // namespace

void add_tasks_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tasks", "Synthetic state-tracking + recall curriculum (swap-recall, MQAR, S5)");
  cmd->require_subcommand(1);

  auto ra = std::make_shared<RunArgs>();
  auto* run = cmd->add_subcommand("run", "Train one model through the curriculum: stage k has n = 2^(k+2)");
  add_run_flags(run, ra->flags);
  run->add_option("--pattern", ra->pattern, "Override the layer pattern (e.g. full, gdn,gdn,gdn,full, window)");
  run->add_option("--loops", ra->n_loops, "Override the loop count T (0: the model config's)");
  run->add_option("--stop-at", ra->stop_at, "Stop after this global step, resumably (0 = no limit)");
  run->add_flag("--resume", ra->resume, "Continue the run in --out exactly where it stopped");
  run->footer(
      "Per stage: train on fresh examples, evaluate every E steps on held-out ones, advance at exact\n"
      "match >= threshold, end the run when a stage spends its budget. Writes to --out: run_config.json,\n"
      "results.json (status, n_max, per-stage steps and final accuracy, every evaluation), curve.png\n"
      "(gnuplot), and a checkpoint ckpt-<step>/ at every evaluation (--resume continues from it).\n"
      "Config fields: model pattern n_loops d_model n_layers n_heads task pool max_queries num_stages\n"
      "steps_per_stage threshold eval_every eval_examples batch_size lr warmup weight_decay beta1 beta2\n"
      "eps clip seed device dtype log_every out_dir");
  run->callback([ra] { run_tasks(*ra); });

  auto sa = std::make_shared<SweepArgs>();
  auto* sweep = cmd->add_subcommand("sweep", "Run a grid of models x loop counts T (one `tasks run` per cell) and tabulate n_max");
  add_run_flags(sweep, sa->flags);
  sweep->add_option("--models", sa->models, "Models of the grid: 'label=preset-or-json' or 'preset-or-json' (repeatable, comma-separated)")->delimiter(',');
  sweep->add_option("--patterns", sa->patterns, "Layer patterns applied to --model, one grid row each (space-separated or repeated; not comma-split, as patterns hold commas)");
  sweep->add_option("--loops", sa->loops, "Loop counts T of the grid, e.g. 1,2,4,8")->delimiter(',')->required();
  sweep->add_option("--jobs", sa->jobs, "Runs at once, each a child `lt2 tasks run` process (default 1)");
  sweep->footer(
      "Each cell runs in --out/<label>/T<t>/ (its log in log.txt). Finished cells are skipped and started\n"
      "ones resume, so re-running the same command continues a sweep. --max-seconds and --threads apply\n"
      "to each run. Writes --out/sweep.md (n_max per model and T, steps per stage), sweep.json, curves.png.");
  sweep->callback([sa] { run_sweep(*sa); });
}

}  // namespace lt2::cli
