// Helpers of the trainer tests: a learnable token shard, a tiny model config, a tiny run.
#pragma once
#include <filesystem>
#include <random>
#include <string>

#include "common/testing.h"
#include "lt2/data/shard.h"
#include "lt2/train/train_config.h"
#include "lt2/train/trainer.h"

namespace lt2::testing {

// A shard of a noisy repeating pattern: learnable, so the loss must fall.
inline std::string write_pattern_shard(const std::string& dir, int64_t n, uint64_t seed) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/train.bin";
  ShardWriter w(path, 50);
  std::mt19937 rng(seed);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(rng() % 10 == 0 ? rng() % 50 : (i * 7) % 23);
  w.write(ids);
  w.close();
  return path;
}

inline std::string write_model_config(const std::string& dir) {
  auto cfg = tiny_config();
  cfg.vocab_size = 0;  // from the data
  cfg.save(dir + "/model.json");
  return dir + "/model.json";
}

// A few CPU steps of the tiny model on the pattern shard, run folder `dir`/run.
inline TrainConfig tiny_run(const std::string& dir) {
  std::filesystem::create_directories(dir);
  TrainConfig c;
  c.model = write_model_config(dir);
  c.train_data = write_pattern_shard(dir, 4000, 1);
  c.out_dir = dir + "/run";
  c.device = "cpu";
  c.seq_len = 16;
  c.batch_size = 4;
  c.grad_accum = 2;
  c.steps = 6;
  c.lr = 3e-3;
  c.warmup = 2;
  c.eval_every = 0;
  c.eval_batches = 2;
  return c;
}

// The loss of every step of t.run().
inline std::vector<double> losses_of(Trainer& t) {
  std::vector<double> out;
  t.on_step = [&](const StepMetrics& m) { out.push_back(m.loss); };
  t.run();
  return out;
}

}  // namespace lt2::testing
