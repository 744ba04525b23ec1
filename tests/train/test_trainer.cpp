// Trainer: exact resume, learning on a tiny task, the best-validation checkpoint, schedule,
// optimizer groups, config errors.
#include "lt2/util/fs.h"
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "common/testing.h"
#include "train/train_testing.h"
#include "lt2/data/shard.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/train/memory_policy.h"
#include "lt2/train/optimizer.h"
#include "lt2/train/run_checkpoint.h"
#include "lt2/train/trainer.h"

using namespace lt2;
namespace fs = std::filesystem;

namespace {

using lt2::testing::losses_of;
using lt2::testing::tiny_run;

}  // namespace

TEST(Trainer, ResumeIsExact) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_resume").string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  Trainer whole(cfg, false);
  auto all = losses_of(whole);
  ASSERT_EQ(all.size(), 6u);

  auto part = cfg;
  part.out_dir = dir + "/run2";
  part.steps = 3;
  Trainer first(part, false);
  auto head = losses_of(first);
  part.steps = 6;
  Trainer resumed(part, true);
  EXPECT_EQ(resumed.start_step(), 3);
  auto tail = losses_of(resumed);
  ASSERT_EQ(tail.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(head[i], all[i]) << "step " << i + 1;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(tail[i], all[3 + i]) << "step " << 4 + i;
  // The final weights agree bit for bit too.
  auto a = load_checkpoint(latest_checkpoint(cfg.out_dir));
  auto b = load_checkpoint(latest_checkpoint(part.out_dir));
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
}

TEST(Trainer, TinyModelLearns) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_learns").string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  cfg.steps = 60;
  cfg.grad_accum = 1;
  cfg.batch_size = 8;
  Trainer t(cfg, false);
  auto losses = losses_of(t);
  const double first = losses.front(), last = losses.back();
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
  EXPECT_LT(t.evaluate(), 0.6 * first);
}

// checkpoint_loops "auto": the choice follows the measured need against the free memory, per-loop
// recomputation holds less between forward and backward, and the measurement leaves nothing behind
// (a run that chose equals a run told the same policy, loss for loss).
TEST(CheckpointingPolicy, ChoosesFromTheExtrapolatedNeed) {
  const StepMemory stored_one{100, 1000}, stored_two{200, 1600}, recomputed_one{30, 700}, recomputed_two{60, 800};
  // 4 rows, 4 loops: storing every loop needs 3300, only the last 1500; storing the last s loops
  // 1500 + 600 (s - 1).
  auto choose = [&](int64_t available) {
    return choose_checkpointing(4, stored_one, stored_two, recomputed_one, recomputed_two, 500, available, 4);
  };
  auto c = choose(3000);
  EXPECT_EQ(c.stored_bytes, 1000 + 3 * 600 + 500);
  EXPECT_EQ(c.recomputed_bytes, 700 + 3 * 100 + 500);
  EXPECT_TRUE(c.checkpoint_loops());  // 3300 > 0.9 x 3000
  EXPECT_EQ(c.stored_loops, 3);     // 2700 <= 2700
  EXPECT_EQ(c.chosen_bytes, 2700);
  EXPECT_NE(c.summary().find("on (auto): 1 of 4 loops recomputed"), std::string::npos) << c.summary();
  EXPECT_EQ(choose(2500).stored_loops, 2);  // 2100 <= 2250 < 2700
  EXPECT_EQ(choose(4000 * 10).stored_loops, 4);
  EXPECT_FALSE(choose(4000 * 10).checkpoint_loops());
  EXPECT_EQ(choose(1000).stored_loops, 1);  // nothing fits: recompute all but the last
  EXPECT_NE(choose(1000).summary().find("(it may not fit)"), std::string::npos);
  EXPECT_EQ(choose(2000).stored_loops, 1);  // 1500 <= 1800 < 2100
  EXPECT_FALSE(
      choose_checkpointing(1, stored_one, stored_one, recomputed_one, recomputed_one, 0, 1112, 4).checkpoint_loops());
  EXPECT_FALSE(choose_checkpointing(4, stored_one, stored_two, recomputed_one, recomputed_two, 500, 3000, 1)
                   .checkpoint_loops());  // one loop: nothing to recompute
  // 2 layers a loop: storing the last a of 8 layer applications needs 1500 + 300 (a - 2).
  auto layers = [&](int64_t available) {
    return choose_checkpointing(4, stored_one, stored_two, recomputed_one, recomputed_two, 500, available, 4, 2);
  };
  const auto partial = layers(2000);  // 1800 <= 1800 < 2100: one loop and one layer of the loop before
  EXPECT_EQ(partial.stored_loops, 1);
  EXPECT_EQ(partial.partial_layers, 1);
  EXPECT_EQ(partial.chosen_bytes, 1800);
  EXPECT_NE(partial.summary().find("3 of 4 loops recomputed, the last of them only in its first 1 of 2 layers"),
            std::string::npos)
      << partial.summary();
  // A storing measurement that ran out of memory: only the last loop stored, the need unknown.
  const StepMemory out_of_memory{0, -1};
  const auto unmeasured = choose_checkpointing(4, out_of_memory, out_of_memory, recomputed_one, recomputed_two, 500,
                                               4000 * 10, 4);
  EXPECT_FALSE(unmeasured.stored_measured());
  EXPECT_EQ(unmeasured.stored_loops, 1);
  EXPECT_EQ(unmeasured.chosen_bytes, unmeasured.recomputed_bytes);
  EXPECT_NE(unmeasured.summary().find("more than the free memory storing activations"), std::string::npos)
      << unmeasured.summary();
  EXPECT_EQ(layers(2500).stored_loops, 2);  // 2100 <= 2250 < 2400
  EXPECT_EQ(layers(2500).partial_layers, 0);
  EXPECT_EQ(layers(2700).partial_layers, 1);  // 2400 <= 2430
  EXPECT_EQ(layers(1000).stored_loops, 1);
  EXPECT_EQ(layers(1000).partial_layers, 0);
}

namespace {

// The memory of a step on `tokens` (a square loss on the logits), recomputing all loops but the last
// stored_loops (and the last partial_layers layers of the loop before them) when checkpoint_loops.
StepMemory loops_step_memory(LoopedLM& model, const torch::Tensor& tokens, bool checkpoint_loops,
                             int64_t stored_loops, int64_t partial_layers = 0) {
  return measure_step_memory(*model, [&] {
    ForwardOptions fo;
    fo.checkpoint_loops = checkpoint_loops;
    fo.stored_loops = stored_loops;
    fo.partial_loop_layers = partial_layers;
    return model->forward(tokens, nullptr, fo).logits.square().mean();
  }, torch::kCPU);
}

}  // namespace

TEST(CheckpointingPolicy, RecomputingEachLoopHoldsLessAndMeasuringLeavesNoGradients) {
  auto mc = lt2::testing::tiny_config();
  mc.n_loops = 4;
  torch::manual_seed(3);
  LoopedLM model(mc);
  auto tokens = torch::randint(mc.vocab_size, {2, 32}, torch::kLong);
  auto measure = [&](bool recompute) { return loops_step_memory(model, tokens, recompute, 1); };
  const auto stored = measure(false), recomputed = measure(true);
  EXPECT_GT(recomputed.held, 0);
  EXPECT_LT(2 * recomputed.held, stored.held) << "stored " << stored.held << " recomputed " << recomputed.held;
  EXPECT_GE(stored.peak, stored.held);
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

// choose_checkpointing's assumption: storing the last a of the T N layer applications needs about
// the recomputing need plus (a - N) / (T N - N) of the difference to storing all, both what is held
// between forward and backward and the peak: whole loops, and loops with the last layers of the
// loop before them.
TEST(CheckpointingPolicy, StoringSomeLoopsNeedsTheInterpolatedMemory) {
  auto mc = lt2::testing::tiny_config();
  mc.n_loops = 4;
  mc.n_layers = 4;
  torch::manual_seed(3);
  LoopedLM model(mc);
  auto tokens = torch::randint(mc.vocab_size, {2, 64}, torch::kLong);
  auto measure = [&](int64_t stored_loops, int64_t partial) {
    return loops_step_memory(model, tokens, true, stored_loops, partial);
  };
  const auto one = measure(1, 0), all = measure(mc.n_loops, 0);
  const int64_t N = mc.n_layers;
  for (int64_t a = N + 1; a < mc.n_loops * N; ++a) {
    const auto m = measure(a / N, a % N);
    const double f = static_cast<double>(a - N) / static_cast<double>((mc.n_loops - 1) * N);
    const double held = one.held + f * static_cast<double>(all.held - one.held);
    const double peak = one.peak + f * static_cast<double>(all.peak - one.peak);
    EXPECT_NEAR(static_cast<double>(m.held), held, 0.02 * held) << a << " layer applications stored";
    EXPECT_LE(static_cast<double>(m.peak), 1.02 * peak) << a << " layer applications stored";
  }
}

TEST(Trainer, AutoCheckpointingTrainsAsTheChosenPolicy) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_auto_ckpt").string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  cfg.steps = 3;
  ASSERT_EQ(cfg.checkpoint_loops, LoopCheckpointing::Auto);  // the default
  Trainer chose(cfg, false);
  auto a = losses_of(chose);
  auto told = cfg;
  told.out_dir = dir + "/told";
  told.checkpoint_loops = chose.checkpoint_loops() ? LoopCheckpointing::On : LoopCheckpointing::Off;
  Trainer fixed(told, false);
  EXPECT_EQ(losses_of(fixed), a);
  EXPECT_FALSE(chose.checkpoint_loops());  // a tiny model fits any machine
  // What auto measured: storing needs more than recomputing, and both fit what was free.
  const auto choice = chose.checkpointing_choice();
  ASSERT_TRUE(choice.has_value());
  EXPECT_GT(choice->stored_bytes, choice->recomputed_bytes);
  EXPECT_EQ(choice->stored_loops, chose.model()->config().n_loops);  // every loop stored
  EXPECT_GT(choice->available_bytes, choice->stored_bytes);
  EXPECT_FALSE(fixed.checkpointing_choice().has_value());  // the config fixed the policy
}

TEST(Trainer, ResumeWithoutCheckpointFails) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_nockpt").string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  EXPECT_THROW(Trainer(cfg, true), Error);
}

namespace {

// The pattern shard's tokens in another order (step 11 where it steps 7): its loss falls while the model
// learns which tokens occur, then rises as it learns the pattern's order, so the best validation step
// comes before the last.
std::string write_reordered_shard(const std::string& dir) {
  fs::create_directories(dir);
  ShardWriter w(dir + "/train.bin", 50);
  std::vector<int32_t> ids;
  for (int i = 0; i < 2000; ++i) ids.push_back(static_cast<int32_t>((i * 11) % 23));
  w.write(ids);
  w.close();
  return dir + "/train.bin";
}

// A run of `tiny_run` that evaluates every step on the reordered shard and keeps its best checkpoint.
TrainConfig keep_best_run(const std::string& dir) {
  auto c = tiny_run(dir);
  c.val_data = write_reordered_shard(dir + "/val");
  c.eval_every = 1;
  c.keep_best = true;
  c.steps = 30;
  return c;
}

// (step, val_loss) of every evaluation in a run's metrics.jsonl.
std::vector<std::pair<int64_t, double>> val_losses(const std::string& out_dir) {
  std::vector<std::pair<int64_t, double>> out;
  std::istringstream in(read_file(out_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = json::parse(line);
    if (j.contains("val_loss")) out.emplace_back(j["step"].get<int64_t>(), j["val_loss"].get<double>());
  }
  return out;
}

}  // namespace

TEST(RunCheckpoint, RotationKeepsTheBest) {
  const std::string dir = (fs::temp_directory_path() / "lt2_rotation_best").string();
  lt2::remove_tree(dir);
  fs::create_directories(dir);
  auto cfg = lt2::testing::tiny_config();
  cfg.vocab_size = 50;
  LoopedLM model(cfg);
  for (int64_t step = 1; step <= 5; ++step) save_rotating_checkpoint(dir, step, model, {}, 2, /*best=*/step == 2);
  EXPECT_EQ(read_checkpoint_pointer(dir + "/best"), "ckpt-2");
  EXPECT_EQ(read_checkpoint_pointer(dir + "/latest"), "ckpt-5");
  for (int64_t step = 1; step <= 5; ++step)
    EXPECT_EQ(fs::exists(dir + "/ckpt-" + std::to_string(step)), step == 2 || step >= 4) << "ckpt-" << step;
  // A newer best frees the old one: the two newest remain.
  save_rotating_checkpoint(dir, 6, model, {}, 2, /*best=*/true);
  EXPECT_EQ(read_checkpoint_pointer(dir + "/best"), "ckpt-6");
  for (int64_t step = 1; step <= 6; ++step)
    EXPECT_EQ(fs::exists(dir + "/ckpt-" + std::to_string(step)), step >= 5) << "ckpt-" << step;
}

TEST(Trainer, KeepBestPointsAtTheLowestValidationLoss) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_best").string();
  lt2::remove_tree(dir);
  auto cfg = keep_best_run(dir);
  Trainer(cfg, false).run();
  const auto evals = val_losses(cfg.out_dir);
  ASSERT_EQ(evals.size(), 30u);
  const auto lowest = *std::min_element(evals.begin(), evals.end(),
                                        [](const auto& a, const auto& b) { return a.second < b.second; });
  ASSERT_LT(lowest.first, cfg.steps) << "the reordered shard's loss should rise as the pattern is learnt";
  const std::string best = cfg.out_dir + "/" + read_checkpoint_pointer(cfg.out_dir + "/best");
  EXPECT_EQ(best, cfg.out_dir + "/ckpt-" + std::to_string(lowest.first));
  const json state = load_json_file(best + "/trainer_state.json");
  EXPECT_EQ(state["best_step"], lowest.first);
  EXPECT_EQ(state["best_val_loss"].get<double>(), lowest.second);
  EXPECT_EQ(latest_checkpoint(cfg.out_dir), cfg.out_dir + "/ckpt-30");

  // A run stopped (with a checkpoint) after the best step and resumed ends with the same best checkpoint.
  auto part = cfg;
  part.out_dir = dir + "/run2";
  part.save_every = lowest.first + 2;
  TrainerCallbacks stop;
  stop.stop_before = [&](int64_t step) { return step == part.save_every; };
  Trainer(part, false, stop).run();
  ASSERT_EQ(latest_checkpoint(part.out_dir), part.out_dir + "/ckpt-" + std::to_string(part.save_every));
  Trainer(part, true).run();
  EXPECT_EQ(read_checkpoint_pointer(part.out_dir + "/best"), "ckpt-" + std::to_string(lowest.first));
  const json resumed = load_json_file(latest_checkpoint(part.out_dir) + "/trainer_state.json");
  EXPECT_EQ(resumed["best_step"], lowest.first);
  EXPECT_EQ(resumed["best_val_loss"].get<double>(), lowest.second);
}

TEST(TrainConfig, ErrorsNameTheField) {
  try {
    TrainConfig::from_json(json::parse(R"({"model": "x", "train_data": "y", "lr": "fast"})"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'lr'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TrainConfig::from_json(json::parse(R"({"learning_rate": 1})")), Error);
  auto c = TrainConfig::from_json(json::parse(R"({"model": "x", "train_data": "y", "objective": "ouro"})"));
  EXPECT_EQ(c.objective, Objective::Ouro);
  c.device = "tpu";
  EXPECT_THROW(c.validate(), Error);
  c.device = "cpu";
  c.keep_best = true;  // needs val_data and eval_every > 0
  c.eval_every = 10;
  EXPECT_THROW(c.validate(), Error);
  c.val_data = "v";
  c.validate();
  c.eval_every = 0;
  EXPECT_THROW(c.validate(), Error);
}

TEST(TrainConfig, KernelOptionsAreCheckedAndRoundTrip) {
  auto c = TrainConfig::from_json(
      json::parse(R"({"model": "x", "train_data": "y", "kernel_options": {"residual_norm": false, "scan_value_block": 16,
                      "pdl_off": "gemv"}})"));
  c.validate();
  const auto o = c.kernel_switches(DecodeOptions{});
  EXPECT_FALSE(o.residual_norm);
  EXPECT_EQ(o.scan_value_block, 16);
  EXPECT_TRUE(o.row_norm);  // the others keep the base's values
  EXPECT_EQ(TrainConfig::from_json(c.to_json()).kernel_options, c.kernel_options);
  for (const auto& [options, expected] :
       {std::pair<const char*, const char*>{R"({"no_such_kernel": 1})", "unknown decode option 'no_such_kernel'"},
        {R"({"scan_value_block": 24})", "scan_value_block"},
        {R"({"residual_norm": 0.5})", "must be a bool, an integer or a string"},
        {R"(["residual_norm"])", "must be an object"}}) {
    c.kernel_options = json::parse(options);
    try {
      c.validate();
      ADD_FAILURE() << options << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'kernel_options'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

// The run's kernel switches are in force during its steps, over the caller's, and
// the caller's come back after.
TEST(Trainer, KernelOptionsAreInForceDuringTheRun) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_kernel_options").string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  cfg.steps = 2;
  cfg.kernel_options = json{{"residual_norm", false}};
  DecodeOptions caller;
  caller.rope = false;
  const DecodeOptionsGuard outer(caller);
  Trainer t(cfg, false);
  std::vector<std::pair<bool, bool>> seen;  // (residual_norm, rope) at each step
  t.on_step = [&](const StepMetrics&) { seen.emplace_back(decode_options().residual_norm, decode_options().rope); };
  t.run();
  ASSERT_EQ(seen.size(), 2u);
  for (const auto& [residual_norm, rope] : seen) {
    EXPECT_FALSE(residual_norm);
    EXPECT_FALSE(rope);
  }
  EXPECT_TRUE(decode_options().residual_norm);
  EXPECT_FALSE(decode_options().rope);
}

TEST(Schedule, WarmupThenCosine) {
  EXPECT_DOUBLE_EQ(lr_at(0, 100, 10, 1.0, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(9, 100, 10, 1.0, 0.1), 1.0);
  EXPECT_NEAR(lr_at(10, 100, 10, 1.0, 0.1), 1.0, 1e-12);
  EXPECT_NEAR(lr_at(55, 100, 10, 1.0, 0.1), 0.55, 1e-12);
  EXPECT_NEAR(lr_at(100, 100, 10, 1.0, 0.1), 0.1, 1e-12);
}

TEST(AdamW, NoDecayOnGainsAndRho) {
  EXPECT_TRUE(takes_weight_decay("layers.0.mixer.wq.weight", torch::zeros({4, 4})));
  EXPECT_FALSE(takes_weight_decay("layers.0.ffn_norm.weight", torch::zeros({4})));
  EXPECT_FALSE(takes_weight_decay("rho", torch::zeros({4, 4})));
  // One step on a known gradient matches the AdamW formula.
  auto w = torch::tensor({1.0, -2.0}, torch::kFloat64).view({1, 2}).requires_grad_(true);
  AdamW opt({{"w", w}}, AdamWOptions{0.9, 0.95, 1e-8, 0.1, nullptr});
  w.mutable_grad() = torch::tensor({0.5, -0.25}, torch::kFloat64).view({1, 2});
  opt.step(0.01);
  // step 1: m_hat = g, v_hat = g^2 -> update = g/|g| = sign(g); w = w(1 - lr wd) - lr sign(g)
  EXPECT_NEAR(w[0][0].item<double>(), 1.0 * (1 - 0.001) - 0.01, 1e-9);
  EXPECT_NEAR(w[0][1].item<double>(), -2.0 * (1 - 0.001) + 0.01, 1e-9);
}

// Per-parameter learning-rate scales (distillation's lower rate outside the student mixers): the
// same step as the formula above at lr x scale, state saved and restored by name.
TEST(AdamW, LearningRateScaleByName) {
  auto fast = torch::tensor({1.0, -2.0}, torch::kFloat64).view({1, 2}).requires_grad_(true);
  auto slow = fast.detach().clone().requires_grad_(true);
  AdamWOptions o{0.9, 0.95, 1e-8, 0.0, nullptr};
  o.lr_scale = [](const std::string& name) { return name == "slow" ? 0.25 : 1.0; };
  AdamW opt({{"fast", fast}, {"slow", slow}}, o);
  for (auto* p : {&fast, &slow}) p->mutable_grad() = torch::tensor({0.5, -0.25}, torch::kFloat64).view({1, 2});
  opt.step(0.01);
  EXPECT_NEAR(fast[0][0].item<double>(), 1.0 - 0.01, 1e-9);
  EXPECT_NEAR(slow[0][0].item<double>(), 1.0 - 0.0025, 1e-9);
  EXPECT_NEAR(slow[0][1].item<double>(), -2.0 + 0.0025, 1e-9);
  AdamW again({{"fast", fast}, {"slow", slow}}, o);
  again.load_state_dict(opt.state_dict());
  EXPECT_TRUE(torch::equal(again.state_dict().at("exp_avg/slow"), opt.state_dict().at("exp_avg/slow")));
  o.lr_scale = [](const std::string&) { return -1.0; };
  try {
    AdamW bad({{"fast", fast}}, o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("learning-rate scale of 'fast'"), std::string::npos) << e.what();
  }
}

namespace {
std::string write_config(const std::string& dir, ModelConfig cfg) {
  cfg.vocab_size = 0;
  cfg.save(dir + "/model.json");
  return dir + "/model.json";
}
}  // namespace

TEST(Trainer, OuroObjectiveThenGateOnlyStage) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_ouro").string();
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  cfg.model = write_config(dir, lt2::testing::tiny_config("full", ModelForm::Ouro));
  cfg.objective = Objective::Ouro;
  cfg.steps = 25;
  Trainer stage1(cfg, false);
  auto losses = losses_of(stage1);
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  // Stage 2 starts from stage 1's weights and moves only the exit gate.
  auto gate = cfg;
  gate.init_from = latest_checkpoint(cfg.out_dir);
  gate.out_dir = dir + "/gate";
  gate.objective = Objective::OuroGate;
  gate.steps = 5;
  Trainer stage2(gate, false);
  auto before = stage2.model()->named_parameters();
  std::map<std::string, torch::Tensor> start;
  for (const auto& p : before) start[p.key()] = p.value().detach().clone();
  losses_of(stage2);
  for (const auto& p : stage2.model()->named_parameters()) {
    const bool moved = !torch::equal(p.value(), start[p.key()]);
    EXPECT_EQ(moved, p.key().rfind("exit_gate.", 0) == 0) << p.key();
  }
}

namespace {

// A tiny run of GDN and DSA (top-4) layers in a fresh `dir`.
TrainConfig tiny_dsa_run(const std::string& dir) {
  lt2::remove_tree(dir);
  auto cfg = tiny_run(dir);
  auto mcfg = lt2::testing::tiny_config("interleaved:1:1:gdn:dsa");
  mcfg.mixer_options = json::parse(R"({"dsa": {"topk": 4}})");
  cfg.model = write_config(dir, mcfg);
  return cfg;
}

}  // namespace

TEST(Trainer, DsaIndexerWarmupTrainsOnlyTheIndexer) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_dsa").string();
  auto cfg = tiny_dsa_run(dir);
  cfg.indexer_stage = "dense_warmup";
  cfg.steps = 15;
  cfg.lr = 1e-2;
  Trainer warm(cfg, false);
  std::map<std::string, torch::Tensor> start;
  for (const auto& p : warm.model()->named_parameters()) start[p.key()] = p.value().detach().clone();
  auto kl = losses_of(warm);
  EXPECT_LT(kl.back(), kl.front()) << "the indexer KL falls";
  int moved = 0;
  for (const auto& p : warm.model()->named_parameters()) {
    const bool changed = !torch::equal(p.value(), start[p.key()]);
    moved += changed;
    if (changed) {
      EXPECT_NE(p.key().find(".index_"), std::string::npos) << "moved: " << p.key();
    }
  }
  EXPECT_GT(moved, 0);
  // The sparse stage trains everything on LM loss + indexer KL.
  auto sparse = cfg;
  sparse.init_from = latest_checkpoint(cfg.out_dir);
  sparse.out_dir = dir + "/sparse";
  sparse.indexer_stage = "sparse";
  sparse.steps = 20;
  sparse.lr = 3e-3;
  Trainer second(sparse, false);
  auto lm = losses_of(second);
  EXPECT_LT(lm.back(), lm.front());
}

// Per-loop checkpointing trains the indexer stages as stored activations do: the same losses step by step.
TEST(Trainer, DsaIndexerStagesTrainUnderPerLoopCheckpointing) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_dsa_ckpt").string();
  auto cfg = tiny_dsa_run(dir);
  cfg.steps = 4;
  for (const char* stage : {"dense_warmup", "sparse"}) {
    std::vector<double> losses[2];
    for (int on = 0; on < 2; ++on) {
      auto c = cfg;
      c.indexer_stage = stage;
      c.out_dir = dir + "/" + stage + (on ? "/on" : "/off");
      c.checkpoint_loops = on ? LoopCheckpointing::On : LoopCheckpointing::Off;
      Trainer t(c, false);
      losses[on] = losses_of(t);
    }
    ASSERT_EQ(losses[0].size(), losses[1].size());
    for (size_t i = 0; i < losses[0].size(); ++i)
      EXPECT_NEAR(losses[1][i], losses[0][i], 1e-5 * std::abs(losses[0][i])) << stage << " step " << i;
  }
}

namespace {

// Callbacks of a client with its own data and state: batches drawn from (step, micro), a constant
// learning rate, a stop test, checkpoints from the after-step hook carrying a counter of its own.
struct CallbackClient {
  int64_t stop_at = 0;
  int64_t counter = 0;  // the client's state: steps seen, over every resume
  std::vector<double> losses;
  std::unique_ptr<Trainer> trainer;

  CallbackClient(const TrainConfig& cfg, bool resume, int64_t stop) : stop_at(stop) {
    TrainerCallbacks cb;
    cb.model_config = [] {
      auto m = lt2::testing::tiny_config();
      m.vocab_size = 50;
      return m;
    };
    // The trainer seeds the RNG from (seed, step, micro) before asking for a micro-batch.
    cb.batch = [](int64_t, int64_t) {
      auto x = torch::randint(50, {2, 17}, torch::kLong);
      return Batch{x.narrow(1, 0, 16), x.narrow(1, 1, 16), {}, nullptr};
    };
    cb.lr = [](int64_t) { return 3e-3; };
    cb.stop_before = [this](int64_t step) { return step >= stop_at; };
    cb.after_step = [this](const StepMetrics& m) {
      losses.push_back(m.loss);
      ++counter;
      if (m.step % 2 == 0) trainer->save(m.step);
    };
    cb.save_state = [this] { return json{{"counter", counter}}; };
    cb.load_state = [this](const json& state) { counter = state.at("counter").get<int64_t>(); };
    cb.keep_checkpoints = 1;
    cb.run_files = false;
    cb.step_lines = false;
    trainer = std::make_unique<Trainer>(cfg, resume, std::move(cb));
  }
};

}  // namespace

TEST(Trainer, CallbacksDriveTheLoopAndResumeExactly) {
  const std::string dir = (fs::temp_directory_path() / "lt2_trainer_callbacks").string();
  lt2::remove_tree(dir);
  TrainConfig cfg;
  cfg.model = "unused: the callbacks give the model config";
  cfg.out_dir = dir + "/whole";
  cfg.device = "cpu";
  cfg.grad_accum = 2;
  cfg.steps = 1000;  // the stop test ends the run
  CallbackClient whole(cfg, false, 6);
  whole.trainer->run();
  ASSERT_EQ(whole.losses.size(), 6u);
  EXPECT_FALSE(fs::exists(cfg.out_dir + "/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(cfg.out_dir + "/ckpt-4"));  // one checkpoint kept
  EXPECT_EQ(latest_checkpoint(cfg.out_dir), cfg.out_dir + "/ckpt-6");

  cfg.out_dir = dir + "/split";
  CallbackClient first(cfg, false, 4);
  first.trainer->run();
  CallbackClient second(cfg, true, 6);
  EXPECT_EQ(second.trainer->start_step(), 4);
  EXPECT_EQ(second.counter, 4);  // restored by load_state
  second.trainer->run();
  EXPECT_EQ(second.counter, 6);
  ASSERT_EQ(second.losses.size(), 2u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(first.losses[i], whole.losses[i]) << "step " << i + 1;
  for (int i = 0; i < 2; ++i) EXPECT_EQ(second.losses[i], whole.losses[4 + i]) << "step " << 5 + i;
  auto a = load_checkpoint(latest_checkpoint(dir + "/whole"));
  auto b = load_checkpoint(latest_checkpoint(dir + "/split"));
  auto pb = b->named_parameters();
  for (const auto& p : a->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
}
