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
  torch::manual_seed(11);
  LoopedLM m(cfg);
  m->to(dt);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())  // non-zero loop gates so every path is exercised
    if (p.key() == "rho" || p.key().find("wgate") != std::string::npos) p.value().normal_(0, 0.3);
  return m;
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
  torch::NoGradGuard ng;
  torch::manual_seed(3);
  auto tok = torch::randint(cfg.vocab_size, {2, 11}, torch::kLong);
  auto full = m->forward(tok).logits;
  auto state = m->make_state(2, 16, torch::TensorOptions().dtype(torch::kFloat64));
  for (int64_t t = 0; t < tok.size(1); ++t)
    EXPECT_LT(rel_err(m->forward(tok.narrow(1, t, 1), state.get()).logits, full.narrow(1, t, 1)), 1e-10)
        << "token " << t;
}

TEST_P(LoopedMixerModel, SplitPrefillEqualsWhole) {
  auto cfg = looped_config(GetParam());
  auto m = make_model(cfg, torch::kFloat64);
  torch::NoGradGuard ng;
  torch::manual_seed(4);
  auto tok = torch::randint(cfg.vocab_size, {2, 13}, torch::kLong);
  auto full = m->forward(tok).logits;
  for (int64_t a : {3, 6, 9}) {
    auto state = m->make_state(2, 16, torch::TensorOptions().dtype(torch::kFloat64));
    auto first = m->forward(tok.narrow(1, 0, a), state.get()).logits;
    auto second = m->forward(tok.narrow(1, a, 13 - a), state.get()).logits;
    EXPECT_LT(rel_err(torch::cat({first, second}, 1), full), 1e-10) << "split at " << a;
  }
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
