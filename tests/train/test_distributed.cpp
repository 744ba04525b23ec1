// Data-parallel training over Gloo on the loopback: the real `lt2` binary (LT2_CLI) runs as
// separate ranks. Two ranks give one rank's run; a 2-rank checkpoint resumes on one rank; a
// killed rank, or a peer missing at start, ends the job with an error within the timeout.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "lt2/model/checkpoint_io.h"
#include "lt2/train/distributed.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"
#include "train/dist_testing.h"
#include "train/subprocess.h"
#include "train/train_testing.h"

using namespace lt2;
using namespace lt2::testing;
namespace fs = std::filesystem;

namespace {

const std::string kLt2 = LT2_CLI;
// Bound on a whole tiny `lt2 train` run on a loaded 2-core machine (it takes a few seconds).
constexpr double kRunLimit = 60;

std::string fresh_dir(const std::string& name) {
  const std::string dir = (fs::temp_directory_path() / name).string();
  lt2::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

// The tiny run of the trainer tests with a global batch of 4 micro-batches x 2 sequences, small
// gradient buckets (several per step) and a short timeout; written as `lt2 train --config` JSON.
std::string write_dp_config(const std::string& dir, int64_t steps) {
  auto c = tiny_run(dir);
  c.batch_size = 2;
  c.grad_accum = 4;
  c.steps = steps;
  c.warmup = 1;
  c.dist_bucket_mb = 0.01;
  c.dist_timeout = 10;
  const std::string path = dir + "/train.json";
  write_file_atomic(path, c.to_json().dump(2));
  return path;
}

Exit run_lt2(const std::vector<std::string>& flags, const std::string& log,
             const std::vector<std::string>& env = {}) {
  std::vector<std::string> args{kLt2, "train"};
  args.insert(args.end(), flags.begin(), flags.end());
  auto p = start_process(args, env, log);
  return wait_process(p, kRunLimit);
}

// Training losses of a run folder, by step.
std::vector<double> losses_of(const std::string& out_dir) {
  std::vector<double> out;
  std::istringstream in(read_text(out_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    auto j = json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

std::map<std::string, torch::Tensor> final_weights(const std::string& out_dir) {
  std::map<std::string, torch::Tensor> out;
  auto m = load_checkpoint(latest_checkpoint(out_dir));
  for (const auto& p : m->named_parameters()) out[p.key()] = p.value().clone();
  return out;
}

// Largest relative difference between two runs' weights (fp32 round-off: ~1e-7 per operation).
double max_weight_rel_err(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) worst = std::max(worst, rel_err(b.at(name), t));
  return worst;
}

std::vector<std::string> rank_env(int rank, int world, int port) {
  return {"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
          "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(DataParallel, LocalMicroBatchesShareTheGlobalBatch) {
  EXPECT_EQ(local_micro_batches(4, 0, 1), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(local_micro_batches(4, 0, 2), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(local_micro_batches(4, 1, 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(local_micro_batches(6, 2, 3), (std::vector<int64_t>{2, 5}));
  try {
    local_micro_batches(3, 0, 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "grad_accum (3) must be a multiple of the number of ranks (2)")) << e.what();
  }
}

TEST(DataParallel, EnvironmentErrorsNameTheVariable) {
  EXPECT_FALSE(DistEnv::from_environment());  // no WORLD_SIZE: not a job
  ScopedEnv job({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"}});
  try {
    DistEnv::from_environment();
    FAIL();
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "MASTER_PORT")) << e.what();
  }
  ScopedEnv port({{"MASTER_PORT", "29555"}});
  auto env = DistEnv::from_environment();
  ASSERT_TRUE(env);
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->world_size, 2);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_port, 29555);
  ScopedEnv bad_rank({{"RANK", "2"}});
  EXPECT_THROW(DistEnv::from_environment(), Error);
}

TEST(DataParallel, GradientBucketsGiveThePlainGradients) {
  expect_buckets_match_plain_backward(torch::kCPU, /*checkpoint_loops=*/false);
}

TEST(DataParallel, GradientBucketsGiveThePlainGradientsWithCheckpointedLoops) {
  expect_buckets_match_plain_backward(torch::kCPU, /*checkpoint_loops=*/true);
}

TEST(DataParallel, TrainerInAOneRankGlooJobMatchesAPlainRun) {
  expect_one_rank_job_matches_plain_run("cpu", 1e-6);
}

TEST(DataParallel, GradientBucketsRejectAGraphThatChanged) {
  // Counted without activation checkpointing (one AccumulateGrad run per parameter), then a
  // backward with it (one run per loop): the buckets cannot know when gradients are final.
  auto cfg = tiny_config();
  auto model = make_test_model(cfg, 5, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
  GradientBuckets buckets(one_rank_group(torch::kCPU), named, 4096);
  auto x = random_tokens(2, 8, cfg.vocab_size);
  buckets.begin_last_backward();
  model->forward(x).logits.mean().backward();
  buckets.finish(1);
  ForwardOptions fo;
  fo.checkpoint_loops = true;
  buckets.begin_last_backward();
  try {
    model->forward(x, nullptr, fo).logits.mean().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "graph changed")) << e.what();
  }
}

TEST(DataParallel, TwoGlooRanksMatchOneRank) {
  const std::string dir = fresh_dir("lt2_dp_match");
  const std::string cfg = write_dp_config(dir, 4);
  auto one = run_lt2({"--config", cfg, "--out", dir + "/one"}, dir + "/one.log");
  ASSERT_TRUE(one.ok()) << read_text(dir + "/one.log");
  // Two ranks, with per-loop activation checkpointing: each shared weight's gradient arrives once
  // per loop, and the buckets must still wait for the last arrival.
  auto two = run_lt2({"--config", cfg, "--out", dir + "/two", "--nproc", "2", "--checkpoint-loops"}, dir + "/two.log");
  const std::string log = read_text(dir + "/two.log");
  ASSERT_TRUE(two.ok()) << log;
  EXPECT_TRUE(contains(log, "on 2 ranks")) << log;
  // Rank 0 alone logs: one line per step.
  size_t step_lines = 0;
  for (size_t at = log.find("step      1/"); at != std::string::npos; at = log.find("step      1/", at + 1)) ++step_lines;
  EXPECT_EQ(step_lines, 1u) << log;
  auto a = losses_of(dir + "/one"), b = losses_of(dir + "/two");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
  const double err = max_weight_rel_err(final_weights(dir + "/one"), final_weights(dir + "/two"));
  EXPECT_LT(err, 1e-5);
  std::printf("two Gloo ranks vs one: largest weight relative difference %.2e after 4 steps (%.1f s vs %.1f s)\n",
              err, two.seconds, one.seconds);
}

TEST(DataParallel, TwoRankCheckpointResumesOnOneRank) {
  const std::string dir = fresh_dir("lt2_dp_resume");
  const std::string cfg = write_dp_config(dir, 6);
  const std::string out = dir + "/run";
  auto two = run_lt2({"--config", cfg, "--out", out, "--nproc", "2", "--save-every", "3"}, dir + "/two.log");
  ASSERT_TRUE(two.ok()) << read_text(dir + "/two.log");
  const auto two_losses = losses_of(out);
  const auto two_weights = final_weights(out);
  ASSERT_EQ(two_losses.size(), 6u);
  // Back to the step-3 checkpoint, and on from there with one rank.
  write_file_atomic(out + "/latest", "ckpt-3\n");
  auto one = run_lt2({"--config", cfg, "--out", out, "--resume"}, dir + "/one.log");
  const std::string log = read_text(dir + "/one.log");
  ASSERT_TRUE(one.ok()) << log;
  EXPECT_TRUE(contains(log, "resumed at step 3")) << log;
  const auto resumed = losses_of(out);
  ASSERT_EQ(resumed.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(resumed[i], two_losses[i], 1e-5 * std::abs(two_losses[i])) << "step " << i + 1;
  EXPECT_LT(max_weight_rel_err(two_weights, final_weights(out)), 1e-5);
}

namespace {

// Two ranks of a long run started directly (as torchrun would), once rank 0 has logged step 2.
std::vector<Process> two_training_ranks(const std::string& dir, double timeout) {
  const std::string cfg = write_dp_config(dir, 1000000);
  const int port = free_port();
  std::vector<Process> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.push_back(start_process({kLt2, "train", "--config", cfg, "--out", dir + "/run", "--dist-timeout", std::to_string(timeout)},
                                  rank_env(r, 2, port), dir + "/rank" + std::to_string(r) + ".log"));
  const bool training = wait_until([&] { return contains(read_text(dir + "/rank0.log"), "step      2/"); }, kRunLimit);
  EXPECT_TRUE(training) << read_text(dir + "/rank0.log") << read_text(dir + "/rank1.log");
  return ranks;
}

}  // namespace

TEST(DataParallel, KilledRankEndsTheJobWithinTheTimeout) {
  const std::string dir = fresh_dir("lt2_dp_killed");
  const double timeout = 5;
  auto ranks = two_training_ranks(dir, timeout);
  kill(ranks[1].pid(), SIGKILL);
  wait_process(ranks[1], kRunLimit);
  auto e = wait_process(ranks[0], timeout + kRunLimit);
  const std::string log = read_text(dir + "/rank0.log");
  ASSERT_TRUE(e.finished) << log;
  EXPECT_FALSE(e.ok()) << log;
  EXPECT_LT(e.seconds, timeout + 3) << log;
  // Rank 1 dies during a step: rank 0 fails in that step's gradient all-reduce, or, where rank 1
  // had finished that all-reduce when it was killed, in the step's loss sum right after it.
  EXPECT_TRUE(contains(log, "rank 0 of 2: gradient all-reduce") || contains(log, "rank 0 of 2: loss sum")) << log;
  EXPECT_TRUE(contains(log, "failed: a peer rank stopped")) << log;
  std::printf("rank 0 ended %.2f s after rank 1 was killed: %s", e.seconds, log.substr(log.find("lt2: error")).c_str());
}

TEST(DataParallel, FrozenRankEndsTheJobAfterTheTimeout) {
  // A peer that stops answering without closing its connections (SIGSTOP): only the timeout can tell.
  const std::string dir = fresh_dir("lt2_dp_frozen");
  const double timeout = 3;
  auto ranks = two_training_ranks(dir, timeout);
  kill(ranks[1].pid(), SIGSTOP);
  auto e = wait_process(ranks[0], timeout + kRunLimit);
  kill(ranks[1].pid(), SIGKILL);
  wait_process(ranks[1], kRunLimit);
  const std::string log = read_text(dir + "/rank0.log");
  ASSERT_TRUE(e.finished) << log;
  EXPECT_FALSE(e.ok()) << log;
  EXPECT_GE(e.seconds, timeout) << log;
  EXPECT_LT(e.seconds, timeout + 3) << log;
  EXPECT_TRUE(contains(log, "did not answer within 3 s")) << log;
  std::printf("rank 0 ended %.2f s after rank 1 froze (timeout %.0f s)\n", e.seconds, timeout);
}

TEST(DataParallel, LauncherStopsTheJobWhenARankDies) {
  const std::string dir = fresh_dir("lt2_dp_launcher");
  const std::string cfg = write_dp_config(dir, 1000000);
  auto launcher = start_process({kLt2, "train", "--config", cfg, "--out", dir + "/run", "--nproc", "2"}, {},
                                dir + "/launcher.log");
  std::string log;
  const bool training = wait_until([&] {
    log = read_text(dir + "/launcher.log");
    return contains(log, "step      2/");
  }, kRunLimit);
  ASSERT_TRUE(training) << log;
  const auto at = log.find("rank 1 pid ");
  ASSERT_NE(at, std::string::npos) << log;
  const pid_t rank1 = std::stoi(log.substr(at + 11));
  kill(rank1, SIGKILL);
  auto e = wait_process(launcher, kRunLimit);
  log = read_text(dir + "/launcher.log");
  ASSERT_TRUE(e.finished) << log;
  EXPECT_FALSE(e.ok()) << log;
  EXPECT_TRUE(contains(log, "rank 1 (pid " + std::to_string(rank1) + ") was killed by signal 9")) << log;
  std::printf("launcher ended %.2f s after rank 1 was killed\n", e.seconds);
}

TEST(DataParallel, MissingPeerAtStartEndsWithinTheTimeout) {
  const std::string dir = fresh_dir("lt2_dp_missing");
  const std::string cfg = write_dp_config(dir, 4);
  const double timeout = 3;
  // Rank 0 hosts the store but rank 1 never comes; rank 1 of another job finds no store at all.
  auto alone0 = start_process({kLt2, "train", "--config", cfg, "--out", dir + "/a", "--dist-timeout", std::to_string(timeout)},
                              rank_env(0, 2, free_port()), dir + "/rank0.log");
  auto alone1 = start_process({kLt2, "train", "--config", cfg, "--out", dir + "/b", "--dist-timeout", std::to_string(timeout)},
                              rank_env(1, 2, free_port()), dir + "/rank1.log");
  auto e0 = wait_process(alone0, kRunLimit);
  auto e1 = wait_process(alone1, kRunLimit);
  const std::string log0 = read_text(dir + "/rank0.log"), log1 = read_text(dir + "/rank1.log");
  for (const auto& [e, log] : {std::pair{e0, log0}, std::pair{e1, log1}}) {
    ASSERT_TRUE(e.finished) << log;
    EXPECT_FALSE(e.ok()) << log;
    EXPECT_GE(e.since_start, timeout) << log;
    EXPECT_LT(e.since_start, timeout + 10) << log;
  }
  EXPECT_TRUE(contains(log0, "missing rank(s): 1")) << log0;
  EXPECT_TRUE(contains(log1, "cannot reach the rendezvous store")) << log1;
  std::printf("missing peer: rank 0 ended after %.2f s, lone rank 1 after %.2f s (timeout %.0f s)\n", e0.since_start,
              e1.since_start, timeout);
}
