// The curriculum runner (`lt2 tasks run`): a tiny model learns stage 1 of MQAR on the CPU,
// resuming gives the same results as an uninterrupted run, results.json holds what it documents,
// bad configs give errors that name the problem; sweep grids and tables.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "io/io_testing.h"
#include "lt2/io/checkpoint.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/tasks/runner.h"
#include "lt2/tasks/sweep.h"
#include "lt2/train/trainer.h"
#include "lt2/util/gnuplot.h"
#include "lt2/util/json.h"
#include "tasks/tasks_testing.h"

using namespace lt2;
using namespace lt2::tasks;
using lt2::testing::expect_error;
using lt2::testing::TempDir;
using lt2::testing::tiny_task_run;
using lt2::testing::write_task_model;

namespace {

// The tiny run of tasks_testing.h in `dir`/`out` (the resume test checks that it crosses a stage).
TaskRunConfig tiny_run(const TempDir& dir, const std::string& out) { return tiny_task_run(dir.path(), dir / out); }

// Every parameter of the run's newest checkpoint by name.
TensorMap final_weights(const std::string& out_dir) {
  return module_tensors(*load_checkpoint(latest_checkpoint(out_dir)));
}

void expect_same_evals(const std::vector<EvalRecord>& a, const std::vector<EvalRecord>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].step, b[i].step) << "eval " << i;
    EXPECT_EQ(a[i].stage, b[i].stage) << "eval " << i;
    EXPECT_EQ(a[i].accuracy, b[i].accuracy) << "eval " << i;
    EXPECT_EQ(a[i].answer_accuracy, b[i].answer_accuracy) << "eval " << i;
    EXPECT_EQ(a[i].loss, b[i].loss) << "eval " << i;  // bit for bit
  }
}

class TaskRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

}  // namespace

// The check: a tiny model learns stage 1 of MQAR (n = 8) on the CPU within a minute.
// Two full-attention layers of width 128 form the induction circuit MQAR needs; a pool of 8 keys
// and values keeps the vocabulary small. Width 64 stalled at 0.4-0.47 of answers right (0 exact
// match): for 1,500 steps at batch 32, and for 2 of 4 seeds at batch 64; this setting solved
// stage 1 in 150-300 steps for each of 8 seeds tried.
TEST_F(TaskRunnerTest, TinyModelLearnsMqarStage1) {
  TempDir dir;
  TaskRunConfig c;
  c.model = write_task_model(dir.path(), 128, 2, 4, 1);
  c.task = "mqar";
  c.pool = 8;
  c.curriculum = {1, 800, 0.9};
  c.eval_every = 50;
  c.eval_examples = 200;
  c.batch_size = 32;
  c.lr = 1e-3;
  c.warmup = 50;
  c.device = "cpu";
  c.out_dir = dir / "run";
  const auto t0 = std::chrono::steady_clock::now();
  TaskRunner runner(c, false, nullptr);
  const auto s = runner.run();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ mqar     ] stage 1 solved: %d after %lld steps, exact match %.3f, %.1f s\n",
              s.stages.empty() ? 0 : s.stages[0].solved, (long long)s.step,
              s.stages.empty() ? 0.0 : s.stages[0].final_accuracy, seconds);
  EXPECT_EQ(s.status, RunStatus::Finished);
  ASSERT_EQ(s.stages.size(), 1u);
  EXPECT_TRUE(s.stages[0].solved);
  EXPECT_GE(s.stages[0].final_accuracy, 0.9);
  EXPECT_EQ(s.n_max, 8);

  // The saved model, scored independently on held-out examples the runner never evaluated.
  auto model = load_checkpoint(latest_checkpoint(c.out_dir));
  model->eval();
  torch::NoGradGuard ng;
  const Example held_out = make_batch(c.task_params(8), c.seed, Stream::Eval, 100000, 200);
  const auto logits = model->forward(held_out.tokens).logits;  // [200, L, V]
  const double exact = exact_match_accuracy(logits, held_out.targets, held_out.mask);
  std::printf("[ mqar     ] exact match on 200 other held-out examples: %.3f\n", exact);
  EXPECT_GE(exact, 0.9);
}

TEST_F(TaskRunnerTest, ResumeGivesTheSameResultsAsAnUninterruptedRun) {
  TempDir dir;
  const auto whole_cfg = tiny_run(dir, "whole");
  const auto whole = TaskRunner(whole_cfg, false, nullptr).run();
  ASSERT_EQ(whole.status, RunStatus::Finished);
  // The run must cross a stage boundary for the check to cover the curriculum state.
  ASSERT_GE(whole.evals.back().stage, 2) << "the tiny run no longer reaches stage 2";

  auto split_cfg = tiny_run(dir, "split");
  // Stopped between evaluations (step 5), then at one (step 8), then run to the end.
  EXPECT_EQ(TaskRunner(split_cfg, false, nullptr).run({5, 0}).status, RunStatus::Stopped);
  EXPECT_EQ(read_results(split_cfg.out_dir).at("status"), "stopped");
  EXPECT_EQ(TaskRunner(split_cfg, true, nullptr).run({8, 0}).status, RunStatus::Stopped);
  split_cfg.log_every = 7;  // cosmetic: may change on resume
  TaskRunner resumed(split_cfg, true, nullptr);
  EXPECT_EQ(resumed.start_step(), 8);
  const auto split = resumed.run();

  EXPECT_EQ(split.status, RunStatus::Finished);
  EXPECT_EQ(split.step, whole.step);
  EXPECT_EQ(split.n_max, whole.n_max);
  expect_same_evals(split.evals, whole.evals);
  ASSERT_EQ(split.stages.size(), whole.stages.size());
  for (size_t i = 0; i < whole.stages.size(); ++i) {
    EXPECT_EQ(split.stages[i].solved, whole.stages[i].solved);
    EXPECT_EQ(split.stages[i].steps, whole.stages[i].steps);
  }
  const auto a = final_weights(whole_cfg.out_dir), b = final_weights(split_cfg.out_dir);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;

  // Resuming a finished run trains nothing and keeps its results.
  const auto again = TaskRunner(split_cfg, true, nullptr).run();
  EXPECT_EQ(again.step, whole.step);
  expect_same_evals(again.evals, whole.evals);
}

TEST_F(TaskRunnerTest, ResultsJsonHoldsStagesEvalsModelAndConfig) {
  TempDir dir;
  const auto cfg = tiny_run(dir, "run");
  const auto s = TaskRunner(cfg, false, nullptr).run();
  const json r = load_json_file(cfg.out_dir + "/results.json");
  EXPECT_EQ(r.at("status"), "finished");
  EXPECT_EQ(r.at("task"), "mqar");
  EXPECT_EQ(r.at("step").get<int64_t>(), s.step);
  EXPECT_EQ(r.at("n_max").get<int64_t>(), s.n_max);
  EXPECT_EQ(r.at("eval_examples").get<int64_t>(), 50);
  EXPECT_FALSE(r.contains("current_stage"));  // only while a stage is open

  // Stages: consecutive from 1, n = 2^(k+2), all solved but possibly the last.
  const auto& stages = r.at("stages");
  ASSERT_EQ(stages.size(), s.stages.size());
  int64_t step_sum = 0, n_max = 0;
  for (size_t i = 0; i < stages.size(); ++i) {
    const auto st = stage_result_from_json(stages[i]);
    EXPECT_EQ(st.stage, static_cast<int64_t>(i) + 1);
    EXPECT_EQ(st.n, int64_t{8} << i);
    if (i + 1 < stages.size()) {
      EXPECT_TRUE(st.solved);
    }
    EXPECT_EQ(st.solved, st.final_accuracy >= 0.04);
    if (st.solved) n_max = st.n;
    step_sum += st.steps;
  }
  EXPECT_EQ(n_max, s.n_max);
  EXPECT_EQ(step_sum, s.step);  // stages tile the run

  // Evals: every eval_every steps of a stage (and at its budget end), accuracies in [0, 1].
  const auto& evals = r.at("evals");
  ASSERT_EQ(evals.size(), s.evals.size());
  int64_t stage_start = 0, prev_stage = 1, prev_step = 0;
  for (const auto& e : evals) {
    const auto rec = eval_record_from_json(e);
    if (rec.stage != prev_stage) stage_start = prev_step;
    EXPECT_EQ(e.at("n").get<int64_t>(), stage_n(rec.stage));
    const int64_t in_stage = rec.step - stage_start;
    EXPECT_TRUE(in_stage % 2 == 0 || in_stage == 8) << "eval at step " << rec.step;
    EXPECT_GE(rec.accuracy, 0.0);
    EXPECT_LE(rec.accuracy, rec.answer_accuracy);  // one query per example: equal, in fact
    EXPECT_LE(rec.answer_accuracy, 1.0);
    EXPECT_GT(rec.loss, 0.0);
    prev_stage = rec.stage;
    prev_step = rec.step;
  }

  // Model and config.
  const auto& m = r.at("model");
  EXPECT_EQ(m.at("d_model").get<int64_t>(), 32);
  EXPECT_EQ(m.at("n_loops").get<int64_t>(), 2);
  EXPECT_EQ(m.at("vocab_size").get<int64_t>(), 3 + 2 * 32);
  EXPECT_EQ(m.at("layer_mixers").size(), 1u);
  EXPECT_GT(m.at("parameters").get<int64_t>(), 0);
  EXPECT_TRUE(run_config_differences(TaskRunConfig::from_json(r.at("config")), cfg).empty());
  EXPECT_TRUE(run_config_differences(
                  TaskRunConfig::from_json(load_json_file(cfg.out_dir + "/run_config.json")), cfg)
                  .empty());

  // One checkpoint kept, named by `latest`; the curve when gnuplot is installed.
  int ckpts = 0;
  for (const auto& name : dir.list("run")) ckpts += name.rfind("ckpt-", 0) == 0;
  EXPECT_EQ(ckpts, 1);
  EXPECT_EQ(latest_checkpoint(cfg.out_dir), cfg.out_dir + "/ckpt-" + std::to_string(s.step));
  EXPECT_EQ(path_exists(cfg.out_dir + "/curve.png"), !find_gnuplot().empty());
  EXPECT_EQ(s.png.empty(), find_gnuplot().empty());
}

TEST_F(TaskRunnerTest, BadConfigsGiveErrorsNamingTheProblem) {
  TempDir dir;
  const auto good = tiny_run(dir, "run");
  auto with = [&](auto edit) {
    auto c = good;
    edit(c);
    return c;
  };
  auto make = [](const TaskRunConfig& c, bool resume = false) { TaskRunner r(c, resume, nullptr); };

  expect_error([&] { TaskRunConfig::from_json(json{{"stpes_per_stage", 5}}); }, {"stpes_per_stage"});
  expect_error([&] { TaskRunConfig::from_json(json{{"lr", "fast"}}); }, {"field 'lr' must be a number, found string \"fast\""});
  expect_error([&] { make(with([](auto& c) { c.task = "sorting"; })); }, {"sorting", "swap-recall"});
  expect_error([&] { make(with([](auto& c) { c.pool = 16; })); }, {"pool", "32", "stage 3"});
  expect_error([&] { make(with([](auto& c) { c.curriculum.threshold = 1.5; })); }, {"threshold"});
  expect_error([&] { make(with([](auto& c) { c.eval_every = 0; })); }, {"eval_every"});
  expect_error([&] { make(with([](auto& c) { c.device = "tpu"; })); }, {"device", "tpu"});
  expect_error([&] { make(with([](auto& c) { c.dtype = "bf16"; })); }, {"bf16", "CUDA"});
  expect_error([&] { make(with([](auto& c) { c.model = "no-such-model"; })); }, {"no-such-model", "preset"});
  expect_error([&] { make(with([](auto& c) { c.pattern = "full,nope"; })); }, {"nope"});
  expect_error([&] { make(with([](auto& c) { c.n_heads = 3; })); }, {"n_heads"});
  const std::string small_vocab = dir / "small_vocab.json";
  write_file_atomic(small_vocab, json{{"vocab_size", 20}, {"d_model", 32}, {"n_layers", 1}, {"n_heads", 2}}.dump());
  expect_error([&] { make(with([&](auto& c) { c.model = small_vocab; })); }, {"vocab_size", "20", "67"});

  // Run folders: --resume needs a run; a fresh run must not overwrite one; a resume must keep
  // the settings that change results.
  expect_error([&] { make(good, true); }, {"--resume", "no checkpoint"});
  TaskRunner(good, false, nullptr).run({2, 0});
  expect_error([&] { make(good, false); }, {"already holds a run", "--resume"});
  expect_error([&] { make(with([](auto& c) { c.lr = 5e-3; }), true); }, {"another config", "lr"});
}

TEST(TaskSweep, GridLabelsFoldersAndErrors) {
  const auto named = parse_sweep_model("full-attn=configs/tasks/full.json");
  EXPECT_EQ(named.label, "full-attn");
  EXPECT_EQ(named.model, "configs/tasks/full.json");
  EXPECT_EQ(parse_sweep_model("configs/tasks/gdn-nsa.json").label, "gdn-nsa");
  EXPECT_EQ(pattern_sweep_model("tiny-full", "gdn,gdn,gdn,full").label, "gdn_gdn_gdn_full");
  expect_error([] { parse_sweep_model("a b=tiny-full"); }, {"label", "a b"});

  SweepConfig cfg;
  cfg.base.out_dir = "/tmp/sweep";
  cfg.models = {named, pattern_sweep_model("tiny-full", "window")};
  cfg.loops = {1, 4};
  const auto cells = sweep_cells(cfg);
  ASSERT_EQ(cells.size(), 4u);
  EXPECT_EQ(cells[1].run.out_dir, "/tmp/sweep/full-attn/T4");
  EXPECT_EQ(cells[1].run.n_loops, 4);
  EXPECT_EQ(cells[1].run.model, "configs/tasks/full.json");
  EXPECT_EQ(cells[2].run.pattern, "window");
  EXPECT_EQ(cells[2].run.model, "tiny-full");

  auto dup = cfg;
  dup.models.push_back(named);
  expect_error([&] { sweep_cells(dup); }, {"full-attn", "label"});
  auto no_loops = cfg;
  no_loops.loops.clear();
  expect_error([&] { sweep_cells(no_loops); }, {"--loops"});
  auto zero_jobs = cfg;
  zero_jobs.jobs = 0;
  expect_error([&] { sweep_cells(zero_jobs); }, {"--jobs"});
}

TEST(TaskSweep, TableFromRunFolders) {
  TempDir dir;
  SweepConfig cfg;
  cfg.base = tiny_run(dir, "sweep");
  cfg.models = {pattern_sweep_model(cfg.base.model, "full")};
  cfg.loops = {1, 2};
  auto cells = sweep_cells(cfg);
  torch::set_num_threads(1);
  TaskRunner(cells[0].run, false, nullptr).run();        // finished
  TaskRunner(cells[1].run, false, nullptr).run({3, 0});  // stopped in stage 1 or 2
  const json table = sweep_table(cfg);
  ASSERT_EQ(table.at("runs").size(), 2u);
  EXPECT_EQ(table.at("runs")[0].at("status"), "finished");
  EXPECT_EQ(table.at("runs")[1].at("status"), "stopped");
  EXPECT_TRUE(table.at("runs")[1].contains("current_stage"));
  const std::string md = sweep_markdown(table);
  const std::string n_max = std::to_string(read_results(cells[0].run.out_dir).at("n_max").get<int64_t>());
  EXPECT_NE(md.find("| full | " + n_max + " | "), std::string::npos) << md;
  EXPECT_NE(md.find("* |"), std::string::npos) << md;  // the stopped run is marked
  EXPECT_NE(md.find("| … "), std::string::npos) << md;  // with its open stage
  EXPECT_NE(md.find("| n=8 | n=16 | n=32 |"), std::string::npos) << md;
}
