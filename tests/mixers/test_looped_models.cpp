// Tiny looped models built on each linear-time mixer (and the Full+GDN hybrid): the model
// invariant (token-by-token decode == one full forward, split prefill == whole, float64) and a
// quick learning check (loss falls on a repeating random token pattern, fp32).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "common/testing.h"
#include "lt2/model/looped_lm.h"

namespace {

using namespace lt2;
using lt2::testing::rel_err;

ModelConfig looped_config(const std::string& pattern) {
  auto cfg = lt2::testing::tiny_config(pattern);
  cfg.n_layers = pattern.rfind("interleaved", 0) == 0 ? 5 : 2;
  for (const char* m : {"gdn", "kda", "mamba2", "retnet", "deltanet", "gla", "hgrn2", "linear"})
    cfg.mixer_options[m] = json{{"chunk_size", 4}};
  cfg.mixer_options["mamba2"]["state_size"] = 8;
  cfg.mixer_options["hgrn2"]["num_heads"] = 2;
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

TEST_P(LoopedMixerModel, DecodeEqualsForward) {
  auto cfg = looped_config(GetParam());
  auto m = make_model(cfg, torch::kFloat64);
  lt2::testing::expect_decode_matches_forward(*m, lt2::testing::random_tokens(2, 11, cfg.vocab_size, 3));
}

TEST_P(LoopedMixerModel, SplitPrefillEqualsWhole) {
  auto cfg = looped_config(GetParam());
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

INSTANTIATE_TEST_SUITE_P(Patterns, LoopedMixerModel,
                         ::testing::Values("gdn", "kda", "mamba2", "retnet", "deltanet", "gla", "hgrn2",
                                           "linear", "interleaved:4:1:gdn:full"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

}  // namespace
