// Training throughput of the real trainer (lt2 train's loop) on a model preset, with random
// tokens: median step time, tokens/s and MFU, as one JSON line.
//   train_bench --model lt-100m --seq-len 2048 --batch-size 16 --steps 30 [--checkpoint-loops[=auto|on|off]]
//   train_bench --model lt-100m --pattern interleaved:4:1:gdn:window --mixer-options '{"window": {"window": 512}}'
//   train_bench --model lt2-gdn-100m --profile 2   (CUDA: then the per-kernel GPU time of 2 more steps)
//   train_bench --model lt-100m --profile 1 --profile-ops   (each kernel per launching operator and shape)

#include "lt2/util/fs.h"
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>

#include "lt2/data/shard.h"
#include "lt2/infer/kernel_profile.h"
#include "lt2/kernels/kernels.h"
#include "lt2/train/flops.h"
#include "lt2/train/trainer.h"
#include "kernel_switches.h"
#include "profile_flags.h"

int main(int argc, char** argv) {
  CLI::App app{"Training throughput of lt2's trainer on random tokens"};
  lt2::TrainConfig cfg;
  cfg.model = "lt-100m";
  cfg.seq_len = 2048;
  cfg.batch_size = 16;
  cfg.steps = 30;
  cfg.warmup = 5;
  cfg.eval_every = 0;
  cfg.eval_batches = 1;
  cfg.log_every = 5;
  std::string out = "/tmp/lt2_train_bench";
  int64_t warm = 5;
  app.add_option("--model", cfg.model, "Model preset or config JSON")->capture_default_str();
  app.add_option("--pattern", cfg.layer_pattern, "Layer pattern over the preset's (TrainConfig::layer_pattern)");
  std::string mixer_options;
  app.add_option("--mixer-options", mixer_options,
                 "Mixer options over the preset's, as a JSON object of mixer names (TrainConfig::mixer_options)");
  app.add_option("--seq-len", cfg.seq_len)->capture_default_str();
  app.add_option("--batch-size", cfg.batch_size)->capture_default_str();
  app.add_option("--grad-accum", cfg.grad_accum)->capture_default_str();
  app.add_option("--steps", cfg.steps)->capture_default_str();
  app.add_option("--warm", warm, "Steps excluded from the timing")->capture_default_str();
  app.add_option("--device", cfg.device)->capture_default_str();
  app.add_option("--dtype", cfg.dtype)->capture_default_str();
  std::string checkpoint_loops = "off";
  app.add_flag("--checkpoint-loops{on}", checkpoint_loops,
               "Per-loop activation checkpointing: off (the default: store activations), on (alone: on), or auto "
               "(lt2 train's default: chosen from the first step's measured memory)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--indexer-stage", cfg.indexer_stage,
                 "off, dense_warmup or sparse: DSA's indexer stage (TrainConfig::indexer_stage)")->capture_default_str();
  app.add_option("--tf32", cfg.tf32, "With bf16: fp32 matmuls on TF32 tensor cores (1) or in fp32 (0)")->capture_default_str();
  app.add_option("--out", out, "Scratch folder")->capture_default_str();
  ProfileFlags profile;
  profile.add_to(app, "CUDA: after timing, print the per-kernel GPU time of this many further training steps");
  KernelSwitchFlags switches;
  switches.add_to(app);
  CLI11_PARSE(app, argc, argv);
  try {
    const KernelSwitchFlags::Scope kernel_switches(switches.assignments);
    if (!mixer_options.empty()) cfg.mixer_options = lt2::json::parse(mixer_options);
    lt2::remove_tree(out);
    std::filesystem::create_directories(out);
    const int64_t vocab = 32768;
    {
      lt2::ShardWriter w(out + "/tokens.bin", vocab);
      std::mt19937 rng(1);
      std::vector<int32_t> ids(4'000'000);
      for (auto& t : ids) t = static_cast<int32_t>(rng() % vocab);
      w.write(ids);
      w.close();
    }
    cfg.train_data = out + "/tokens.bin";
    cfg.out_dir = out + "/run";
    cfg.save_every = 0;
    cfg.checkpoint_loops = lt2::parse_loop_checkpointing(checkpoint_loops, "--checkpoint-loops");
    if (profile.runs > 0 && cfg.steps < 2)
      throw std::runtime_error("--profile needs --steps >= 2 (a run's last step also evaluates and saves)");
    // Trainer::run trains from its first step to cfg.steps; the profile reruns the first step alone,
    // a whole optimizer step like the timed ones.
    int64_t stop_at = cfg.steps;
    lt2::TrainerCallbacks callbacks;
    callbacks.stop_before = [&](int64_t step) { return step >= stop_at; };
    lt2::Trainer trainer(cfg, false, callbacks);
    std::vector<double> ms;
    trainer.on_step = [&](const lt2::StepMetrics& m) {
      if (m.step > warm) ms.push_back(m.ms);
    };
    trainer.run();
    std::sort(ms.begin(), ms.end());
    const double median = ms.empty() ? 0 : ms[ms.size() / 2];
    const double tokens = static_cast<double>(cfg.batch_size * cfg.grad_accum * cfg.seq_len);
    const double flops = 3 * lt2::forward_flops_per_token(*trainer.model(), cfg.seq_len);
    const std::string dev = lt2::kernels::device_name(0);
    const double peak = lt2::peak_flops(dev);
    lt2::json j{{"model", cfg.model},
                {"layer_pattern", trainer.model()->config().layer_pattern},
                {"mixer_options", cfg.mixer_options},
                {"options", switches.assignments},
                {"parameters", trainer.model()->num_parameters()},
                {"seq_len", cfg.seq_len},
                {"batch_size", cfg.batch_size},
                {"grad_accum", cfg.grad_accum},
                {"checkpoint_policy", checkpoint_loops}, {"checkpoint_loops", trainer.checkpoint_loops()},
                {"stored_loops", trainer.checkpoint_loops() ? trainer.stored_loops() : trainer.model()->config().n_loops},
                {"partial_loop_layers", trainer.partial_loop_layers()},
                {"tf32", cfg.tf32},
                {"device", dev.empty() ? "cpu" : dev},
                {"median_step_ms", median},
                {"tokens_per_s", tokens / (median / 1000)},
                {"train_flops_per_token", flops},
                {"peak_flops", peak},
                {"mfu", peak > 0 ? flops * tokens / (median / 1000) / peak : 0.0},
                {"timed_steps", ms.size()}};
    if (const auto c = trainer.checkpointing_choice())  // what "auto" measured
      j["checkpoint_need"] = {{"stored_bytes", c->stored_measured() ? lt2::json(c->stored_bytes) : lt2::json(nullptr)},
                              {"recomputed_bytes", c->recomputed_bytes},
                              {"chosen_bytes", c->chosen_bytes},
                              {"available_bytes", c->available_bytes}};
    if (profile.runs > 0) {
      trainer.on_step = nullptr;
      stop_at = 1;
      const auto p = lt2::profile_device_activity([&] { trainer.run(); }, profile.runs, profile.by_op);
      std::printf("%s\n", lt2::kernel_profile_table(p, profile.rows(30)).c_str());
      if (p.steps > 0) j["profile"] = p.to_json(profile.rows(30));
    }
    std::printf("RESULT %s\n", j.dump().c_str());
  } catch (const c10::Error& e) {  // libtorch's message without its stack trace: one line a table row can quote
    std::fprintf(stderr, "train_bench: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
