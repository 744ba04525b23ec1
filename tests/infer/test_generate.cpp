// lt2::generate runs on the Engine: its tokens equal those of the plain decode loop (a forward with
// a state per chunk of the prompt, then one forward per token), greedy and sampled, for LT2 and
// Ouro forms; stop tokens and on_token end it early.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "lt2/infer/generate.h"

using namespace lt2;
using lt2::testing::make_test_model;
using lt2::testing::tiny_config;

namespace {

// The decode loop generate ran before it moved onto the Engine: the reference.
std::vector<int64_t> plain_decode(LoopedLM m, const std::vector<int64_t>& prompt, const GenerateOptions& o) {
  torch::NoGradGuard ng;
  m->eval();
  const int64_t P = static_cast<int64_t>(prompt.size());
  auto state = m->make_state(1, P + o.max_new_tokens, torch::TensorOptions().dtype(torch::kFloat64));
  Sampler sampler(o.sampling, o.seed);
  Tensor last;
  for (int64_t begin = 0; begin < P; begin += o.prefill_chunk) {
    const int64_t n = std::min(o.prefill_chunk, P - begin);
    auto chunk = torch::tensor(std::vector<int64_t>(prompt.begin() + begin, prompt.begin() + begin + n)).view({1, n});
    last = m->forward(chunk, state.get()).logits.select(1, n - 1).squeeze(0);
  }
  std::vector<int64_t> out;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    out.push_back(sampler.sample(last));
    if (i + 1 == o.max_new_tokens) break;
    last = m->forward(torch::full({1, 1}, out.back(), torch::kLong), state.get()).logits.select(1, 0).squeeze(0);
  }
  return out;
}

}  // namespace

TEST(Generate, EqualsThePlainDecodeLoop) {
  const std::vector<int64_t> prompt{5, 17, 3, 40, 22, 9, 1};
  for (auto form : {ModelForm::LT2, ModelForm::Ouro}) {
    for (const std::string pattern : {"full", "gdn", "interleaved:1:1:gdn:full", "mamba2", "window"}) {
      for (double temperature : {0.0, 1.0}) {
        SCOPED_TRACE(pattern + (form == ModelForm::Ouro ? " ouro" : " lt2") + " temperature " +
                     std::to_string(temperature));
        auto cfg = tiny_config(pattern, form);
        GenerateOptions o;
        o.max_new_tokens = 12;
        o.prefill_chunk = 3;
        o.sampling.temperature = temperature;
        o.seed = 11;
        const auto want = plain_decode(make_test_model(cfg), prompt, o);
        const auto got = generate(make_test_model(cfg), prompt, o);
        EXPECT_EQ(got.tokens, want);
        EXPECT_EQ(got.prompt_tokens, static_cast<int64_t>(prompt.size()));
        EXPECT_GT(got.state_bytes, 0);
      }
    }
  }
}

TEST(Generate, StopsAtAStopTokenOrWhenToldTo) {
  auto m = make_test_model(tiny_config("gdn"));
  GenerateOptions o;
  o.max_new_tokens = 10;
  const auto all = generate(m, {1, 2, 3}, o).tokens;
  ASSERT_EQ(all.size(), 10u);
  o.stop_tokens = {all[3]};
  const auto stopped = generate(make_test_model(tiny_config("gdn")), {1, 2, 3}, o).tokens;
  const auto first = std::find(all.begin(), all.end(), all[3]) - all.begin();
  EXPECT_EQ(stopped, std::vector<int64_t>(all.begin(), all.begin() + first + 1));
  int seen = 0;
  const auto told = generate(make_test_model(tiny_config("gdn")), {1, 2, 3}, GenerateOptions{},
                             [&](int64_t) { return ++seen < 4; });
  EXPECT_EQ(told.tokens.size(), 4u);
}

TEST(Generate, RejectsBadInput) {
  auto m = make_test_model(tiny_config("gdn"));
  EXPECT_THROW(generate(m, {}, GenerateOptions{}), Error);
  EXPECT_THROW(generate(m, {1, 1000}, GenerateOptions{}), Error);
  GenerateOptions o;
  o.prefill_chunk = 0;
  EXPECT_THROW(generate(m, {1}, o), Error);
}
