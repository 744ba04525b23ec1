// Tiny looped models: the Full+GDN hybrid's model invariant (token-by-token decode == one full
// forward, split prefill == whole, float64; each registered mixer's own runs in
// test_mixer_invariants.cpp), and a quick learning check (loss falls on a repeating random token
// pattern, fp32) for every registered recurrent mixer and the hybrid.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "common/testing.h"
#include "lt2/model/looped_lm.h"
#include "mixers/mixer_testing.h"

namespace {

using namespace lt2;

const std::string kHybrid = "interleaved:4:1:gdn:full";

// Every registered recurrent mixer's name, and the hybrid.
std::vector<std::string> learning_patterns() {
  std::vector<std::string> patterns;
  for (const auto& v : lt2::testing::recurrent_variants())
    if (v.label == v.name) patterns.push_back(v.name);
  patterns.push_back(kHybrid);
  return patterns;
}

// A tiny model of the pattern, the recurrent mixers at their tiny options (mixer_testing.h).
ModelConfig looped_config(const std::string& pattern) {
  auto cfg = lt2::testing::tiny_config(pattern);
  cfg.n_layers = pattern.rfind("interleaved", 0) == 0 ? 5 : 2;
  for (const auto& v : lt2::testing::recurrent_variants())
    if (v.label == v.name) cfg.mixer_options[v.name] = v.options;
  return cfg;
}

LoopedLM make_model(const ModelConfig& cfg, torch::ScalarType dt) {
  return lt2::testing::make_test_model(cfg, 11, dt);
}

class LoopedMixerModel : public ::testing::TestWithParam<std::string> {
 protected:
  // Tiny shapes: one intra-op thread. Under `ctest -j` on 2 cores, OpenMP's spinning threads
  // slow these tests down ~20x.
  void SetUp() override { torch::set_num_threads(1); }
};

TEST(LoopedHybridModel, DecodeEqualsForward) {
  torch::set_num_threads(1);
  auto cfg = looped_config(kHybrid);
  auto m = make_model(cfg, torch::kFloat64);
  lt2::testing::expect_decode_matches_forward(*m, lt2::testing::random_tokens(2, 11, cfg.vocab_size, 3));
}

TEST(LoopedHybridModel, SplitPrefillEqualsWhole) {
  torch::set_num_threads(1);
  auto cfg = looped_config(kHybrid);
  auto m = make_model(cfg, torch::kFloat64);
  lt2::testing::expect_split_prefill_matches_whole(*m, lt2::testing::random_tokens(2, 13, cfg.vocab_size, 4), {3, 6, 9});
}

TEST_P(LoopedMixerModel, LearnsARepeatingPattern) {
  auto cfg = looped_config(GetParam());
  for (auto& [name, opts] : cfg.mixer_options.items()) opts["chunk_size"] = 16;  // fewer, larger chunks
  auto m = make_model(cfg, torch::kFloat32);
  torch::manual_seed(5);
  auto pattern = torch::randint(cfg.vocab_size, {1, 8}, torch::kLong);
  auto tok = pattern.repeat({4, 5});  // [4, 40]
  auto input = tok.narrow(1, 0, 39), target = tok.narrow(1, 1, 39);
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto logits = m->forward(input).logits;
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), target.reshape(-1));
    opt.zero_grad();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("[ loss     ] %-26s step 0: %.3f   step 29: %.3f\n", GetParam().c_str(), first, last);
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, 0.5 * first);
}

INSTANTIATE_TEST_SUITE_P(Patterns, LoopedMixerModel, ::testing::ValuesIn(learning_patterns()),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

}  // namespace
