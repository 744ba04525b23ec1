// Kill anywhere: `lt2 train`, `lt2 tasks run` and `lt2 distill` on a tiny model are killed with
// SIGKILL at seeded random moments (a third of them anywhere, startup included, a third while a
// checkpoint is being written, a third while it trains) and resumed with --resume each time. After
// every kill: (a) the newest complete checkpoint of every run folder loads (weights, optimizer state,
// trainer state); (c) a temporary file a kill left is gone once the next process has trained a step.
// Every run that reaches its last step ends with (b) the weights of an uninterrupted run, bit for
// bit, and no temporary file.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "cli/cli_testing.h"
#include "common/testing.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/train/trainer.h"
#include "lt2/util/json.h"
#include "tasks/tasks_testing.h"
#include "train/train_testing.h"

using namespace lt2;
using namespace lt2::testing;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kKills = 20;
// The kill moments' seed; --gtest_random_seed=N draws other ones.
uint64_t kill_seed() {
  const int flag = GTEST_FLAG_GET(random_seed);
  return flag != 0 ? static_cast<uint64_t>(flag) : 20261203;
}

// The pid in a temporary file's name (`<name>.tmp.<pid>`), or -1 for a checkpoint folder being
// written (`ckpt-<step>.tmp`).
long temporary_pid(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  return at == std::string::npos ? -1 : std::stol(name.substr(at + 5));
}

// Paths under the run folder that an unfinished write makes: `ckpt-<step>.tmp` folders and
// `<name>.tmp.<pid>` files, with their modification times.
std::map<std::string, fs::file_time_type> temporaries(const std::string& out_dir) {
  std::map<std::string, fs::file_time_type> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(out_dir, ec); it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    const bool folder = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
    if (folder || name.find(".tmp.") != std::string::npos)
      out[it->path().lexically_relative(out_dir).string()] = fs::last_write_time(it->path(), ec);
  }
  return out;
}

// Whether temporary `path` (from temporaries()) belongs to the process `pid` started at `spawned`:
// a file carries its pid, a checkpoint folder is newer than the process.
bool owned_by(const std::string& path, fs::file_time_type mtime, pid_t pid, fs::file_time_type spawned) {
  const long owner = temporary_pid(fs::path(path).filename().string());
  return owner < 0 ? mtime >= spawned : owner == pid;
}

// Whether process `pid` is writing a checkpoint: a temporary of its own under a ckpt-* folder or
// for a `latest` file, in any run folder.
bool writing_checkpoint(const std::string& out_dir, pid_t pid, fs::file_time_type spawned) {
  for (const auto& [path, mtime] : temporaries(out_dir)) {
    if (!owned_by(path, mtime, pid, spawned)) continue;
    for (const auto& part : fs::path(path))
      if (part.string().rfind("ckpt-", 0) == 0 || part.string().rfind("latest", 0) == 0) return true;
  }
  return false;
}

int64_t latest_step(const std::string& out_dir) {
  const std::string latest = latest_checkpoint(out_dir);
  return latest.empty() ? 0 : std::stoll(fs::path(latest).filename().string().substr(5));
}

// Whether a process's output (a line per step with log_every 1: "step N | ...") shows a trained step.
bool trained_a_step(const std::string& log) {
  std::istringstream in(read_text(log));
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step ", 0) == 0) return true;
  return false;
}

std::map<std::string, torch::Tensor> weights_of(const std::string& ckpt) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : module_tensors(*load_checkpoint(ckpt))) out[name] = t.clone();
  return out;
}

// (a): every file of the checkpoint `latest` names in each run folder loads and says its step.
void expect_latest_loads(const std::vector<std::string>& run_dirs, const std::string& context) {
  for (const auto& run_dir : run_dirs) {
    const std::string ckpt = latest_checkpoint(run_dir);
    if (ckpt.empty()) continue;
    try {
      load_checkpoint(ckpt);
      load_tensor_map(ckpt + "/optimizer.safetensors");
      EXPECT_EQ(json_require<int64_t>(load_json_file(ckpt + "/trainer_state.json"), "step", ckpt), latest_step(run_dir))
          << context;
    } catch (const std::exception& e) {
      ADD_FAILURE() << context << ": the newest checkpoint '" << ckpt << "' does not load: " << e.what();
    }
  }
}

// Kills `lt2 <command> --out OUT` (a command that checkpoints into its run folders under OUT, in
// the order given, "" for OUT itself, and continues with --resume) kKills times in `dir` and checks
// (a), (b) and (c) against an uninterrupted run, whose result is the last run folder's checkpoint.
void kill_anywhere(const std::string& dir, const std::vector<std::string>& command,
                   const std::vector<std::string>& run_folders = {""}) {
  const auto run_dirs = [&](const std::string& out) {
    std::vector<std::string> dirs;
    for (const auto& f : run_folders) dirs.push_back(f.empty() ? out : out + "/" + f);
    return dirs;
  };
  const auto has_checkpoint = [&](const std::string& out) {
    for (const auto& d : run_dirs(out))
      if (!latest_checkpoint(d).empty()) return true;
    return false;
  };
  const std::string program = "lt2 " + command[0] + (command[0] == "tasks" ? " " + command[1] : "");
  const auto start = Clock::now();
  std::vector<std::string> ref_args = command;
  ref_args.insert(ref_args.end(), {"--out", dir + "/reference"});
  const CliRun ref = run_cli(ref_args, dir + "/reference.log");
  ASSERT_EQ(ref.code, 0) << ref.output;
  const double run_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto expected = weights_of(latest_checkpoint(run_dirs(dir + "/reference").back()));
  const int64_t last_step = latest_step(run_dirs(dir + "/reference").back());

  const uint64_t seed = kill_seed();
  std::mt19937_64 rng(seed);
  int runs = 0, finished = 0, kills = 0, in_write = 0, before_first_checkpoint = 0;
  std::string out = dir + "/run0";
  // Ends a run that reached its last step: (b) and no temporary file.
  auto check_finished_run = [&](const std::string& context) {
    EXPECT_EQ(latest_step(run_dirs(out).back()), last_step) << context;
    const auto got = weights_of(latest_checkpoint(run_dirs(out).back()));
    ASSERT_EQ(got.size(), expected.size());
    for (const auto& [name, t] : expected) EXPECT_TRUE(torch::equal(got.at(name), t)) << context << ": " << name;
    std::string left;
    for (const auto& [path, mtime] : temporaries(out)) left += " '" + path + "'";
    EXPECT_TRUE(left.empty()) << context << ": temporary files left after a finished run:" << left;
    ++finished;
    out = dir + "/run" + std::to_string(++runs);
  };

  // Starts of the command until kKills of them were killed (a start may finish before its moment).
  int starts = 0;
  for (; kills < kKills && starts < 3 * kKills; ++starts) {
    const std::string context = "start " + std::to_string(starts) + " (seed " + std::to_string(seed) + ")";
    const bool resume = has_checkpoint(out);
    std::vector<std::string> argv{kLt2};
    argv.insert(argv.end(), command.begin(), command.end());
    argv.insert(argv.end(), {"--out", out});
    if (resume) argv.push_back("--resume");
    const std::string log = dir + "/start" + std::to_string(starts) + ".log";
    const auto spawned = fs::file_time_type::clock::now();
    Process p = start_process(argv, {"OMP_NUM_THREADS=1"}, log);
    const int when = static_cast<int>(rng() % 3);  // 0: any moment, 1: in a checkpoint write, 2: while training
    // Waits (checking every 200 us: a checkpoint write takes milliseconds) until `moment()`, the
    // child's exit or the deadline.
    auto wait_for = [&](const std::function<bool()>& moment, double seconds) {
      const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
      while (!p.poll() && !moment() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(200));
    };
    if (when == 1) {  // within the first 2 ms of a checkpoint write
      wait_for([&] { return writing_checkpoint(out, p.pid(), spawned); }, 2 * run_seconds + 10);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    } else if (when == 2) {  // once a step is done (startup takes most of a run), at a random moment after it
      wait_for([&] { return trained_a_step(log); }, 2 * run_seconds + 10);
      wait_for([] { return false; }, std::uniform_real_distribution<double>(0, run_seconds / 4)(rng));
    } else {
      wait_for([] { return false; }, std::uniform_real_distribution<double>(0, run_seconds)(rng));
    }
    p.kill(SIGKILL);
    p.wait();
    if (p.status().ok()) {  // it finished before the kill
      check_finished_run(context);
      continue;
    }
    ASSERT_TRUE(p.status().signaled()) << context << ": " << program << " " << p.status().describe() << "\n" << read_text(log);
    ++kills;
    in_write += writing_checkpoint(out, p.pid(), spawned);
    before_first_checkpoint += !has_checkpoint(out);
    expect_latest_loads(run_dirs(out), context);
    // (c): once this process trained a step, what earlier kills left is gone.
    if (trained_a_step(log)) {
      for (const auto& [path, mtime] : temporaries(out)) {
        EXPECT_TRUE(owned_by(path, mtime, p.pid(), spawned)) << context << ": '" << path << "' was left by an earlier process";
      }
    }
  }
  // The run in progress goes to its end without a kill.
  const bool resume = has_checkpoint(out);
  std::vector<std::string> args = command;
  args.insert(args.end(), {"--out", out});
  if (resume) args.push_back("--resume");
  const CliRun last = run_cli(args, dir + "/last.log");
  ASSERT_EQ(last.code, 0) << last.output;
  check_finished_run("the last run");

  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("kill-anywhere (%s, seed %llu): %d kills in %d starts (%d during a checkpoint write, %d before the first "
              "checkpoint), %d runs finished with the reference weights bit for bit; uninterrupted run %.2f s, "
              "test %.1f s\n",
              program.c_str(), (unsigned long long)seed, kills, starts, in_write, before_first_checkpoint, finished, run_seconds, seconds);
  EXPECT_EQ(kills, kKills);
  EXPECT_GT(in_write, 0) << "no kill landed in a checkpoint write";
  remove_tree(dir);
}

}  // namespace

TEST(KillAnywhere, TrainResumesToTheWeightsOfAnUninterruptedRun) {
  const std::string dir = (fs::temp_directory_path() / "lt2_kill_anywhere_train").string();
  remove_tree(dir);
  auto c = tiny_run(dir);
  c.steps = 10;
  c.save_every = 1;  // a checkpoint every step: many kills land in one
  c.log_every = 1;   // a line per step tells whether a process trained one
  c.batch_size = 2;
  c.grad_accum = 1;
  c.eval_batches = 1;
  const std::string cfg = dir + "/train.json";
  write_file_atomic(cfg, c.to_json().dump(2));
  kill_anywhere(dir, {"train", "--config", cfg});
}

// A task run checkpoints at every evaluation (every 2 steps here) with its curriculum state: kills
// land before, in and after stage changes (stage 1 is solved at step 4, stage 2 spends its budget).
TEST(KillAnywhere, TasksRunResumesToTheWeightsOfAnUninterruptedRun) {
  const std::string dir = (fs::temp_directory_path() / "lt2_kill_anywhere_tasks").string();
  remove_tree(dir);
  make_dirs(dir);
  auto c = tiny_task_run(dir, dir + "/run");
  c.log_every = 1;
  const std::string cfg = dir + "/tasks.json";
  write_file_atomic(cfg, c.to_json().dump(2));
  kill_anywhere(dir, {"tasks", "run", "--config", cfg});
}

// lt2 distill, every stage, on a tiny Ouro-form teacher: each stage a run folder that checkpoints
// every step; kills land in alignment, in the selection's probe, in KD and in the long stage, and
// between them.
TEST(KillAnywhere, DistillResumesToTheWeightsOfAnUninterruptedRun) {
  const std::string dir = (fs::temp_directory_path() / "lt2_kill_anywhere_distill").string();
  remove_tree(dir);
  make_dirs(dir);
  const std::string teacher = dir + "/teacher";
  save_checkpoint(teacher, make_test_model(tiny_config("full", ModelForm::Ouro), 7, torch::kFloat32));
  const json config = {
      {"train", {{"train_data", write_pattern_shard(dir + "/data", 3000, 1)}, {"device", "cpu"}, {"batch_size", 2},
                 {"seq_len", 16}, {"eval_batches", 1}, {"eval_every", 0}, {"save_every", 1}, {"log_every", 1},
                 {"warmup", 1}}},
      {"student", {{"mixer", "gdn"}, {"keep_fraction", 0.5}}},
      {"align", {{"steps", 3}, {"lr", 1e-2}}},
      {"select", {{"method", "shared"}, {"probe_steps", 2}, {"eval_batches", 1}}},
      {"kd", {{"steps", 3}, {"lr", 1e-2}, {"other_lr", 1e-3}}},
      {"long", {{"steps", 3}, {"seq_len", 24}, {"lr", 1e-3}}}};
  const std::string cfg = dir + "/distill.json";
  write_file_atomic(cfg, config.dump(2));
  kill_anywhere(dir, {"distill", "--teacher", teacher, "--config", cfg, "--stage", "all"}, {"align", "kd", "long"});
}
