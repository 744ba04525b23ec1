// Rolling windows, perplexity against an independent forward, batching, per-exit scoring, and
// acc / acc_norm on log-likelihoods the test chooses.
#include <cmath>
#include <numeric>
#include <sstream>

#include "eval_testing.h"
#include "lt2/eval/perplexity.h"
#include "lt2/eval/tasks.h"

using namespace lt2;
using namespace lt2::eval;
using eval_testing::byte_tokenizer;
using eval_testing::tiny_model;

TEST(EvalRolling, MatchesTheHarnessGolden) {
  // lm-evaluation-harness's test_get_rolling_token_windows_v1 (34 tokens, max 10), made disjoint.
  std::vector<int32_t> x(34);
  std::iota(x.begin(), x.end(), 0);
  const auto w = rolling_windows(x, -100, 10);
  ASSERT_EQ(w.size(), 4u);
  auto range = [](int a, int b) {
    std::vector<int32_t> v(b - a);
    std::iota(v.begin(), v.end(), a);
    return v;
  };
  EXPECT_EQ(w[0].context, std::vector<int32_t>{-100});
  EXPECT_EQ(w[0].continuation, range(0, 10));
  EXPECT_EQ(w[1].context, std::vector<int32_t>{9});
  EXPECT_EQ(w[1].continuation, range(10, 20));
  EXPECT_EQ(w[3].context, range(23, 30));
  EXPECT_EQ(w[3].continuation, range(30, 34));
}

TEST(EvalRolling, EveryTokenOnceWithAllTheContextThatFits) {
  for (int64_t max : {1, 2, 4, 7}) {
    for (int64_t n : {int64_t(1), max - 1, max, max + 1, 2 * max, 2 * max + 1, 3 * max + 2}) {
      if (n < 1) continue;
      std::vector<int32_t> tokens(n);
      std::iota(tokens.begin(), tokens.end(), 100);
      const auto w = rolling_windows(tokens, 7, max);
      std::vector<int32_t> scored;
      for (size_t i = 0; i < w.size(); ++i) {
        SCOPED_TRACE(::testing::Message() << "max " << max << ", n " << n << ", window " << i);
        ASSERT_FALSE(w[i].continuation.empty());
        EXPECT_LE((int64_t)w[i].continuation.size(), max);
        if (i == 0) {
          EXPECT_EQ(w[i].context, std::vector<int32_t>{7});
        } else {  // the input (context + continuation minus its last token) fills the window
          EXPECT_EQ((int64_t)(w[i].context.size() + w[i].continuation.size()), max + 1);
          EXPECT_EQ(w[i].context.back() + 1, w[i].continuation.front());  // the tokens right before
        }
        scored.insert(scored.end(), w[i].continuation.begin(), w[i].continuation.end());
      }
      EXPECT_EQ(scored, tokens);
      EXPECT_EQ((int64_t)w.size(), (n + max - 1) / max);
    }
  }
  EXPECT_TRUE(rolling_windows({}, 0, 4).empty());
}

TEST(EvalPerplexity, EqualsOneFullForwardWhenTheDocumentFits) {
  auto tok = byte_tokenizer();
  auto model = tiny_model();
  const std::string text = "It is a truth universally acknowledged.";
  Scorer scorer(*model, {/*max_length=*/128, /*batch_tokens=*/4096, {}});
  std::ostringstream per_token;
  const auto res = evaluate_perplexity(scorer, tok, {{text, text, {}}}, 256, &per_token, true);
  // Independent: [prefix] + tokens through one forward, log-softmax, the log-prob of each next token.
  const auto ids = tok.encode(text);
  std::vector<int64_t> input{256};
  input.insert(input.end(), ids.begin(), ids.end() - 1);
  torch::NoGradGuard ng;
  auto lp = torch::log_softmax(model->forward(torch::tensor(input).view({1, -1})).logits[0].to(torch::kFloat64), -1);
  double expected = 0;
  for (size_t i = 0; i < ids.size(); ++i) expected += lp[i][ids[i]].item<double>();
  EXPECT_NEAR(res.loglikelihood[0], expected, 1e-4 * std::abs(expected));
  EXPECT_EQ(res.tokens, (int64_t)ids.size());
  EXPECT_EQ(res.words, 6);
  EXPECT_EQ(res.bytes, (int64_t)text.size());
  EXPECT_NEAR(res.bits_per_byte(0), -expected / (text.size() * std::log(2.0)), 1e-4);
  EXPECT_NEAR(res.word_perplexity(0), std::exp(-expected / 6), 1e-3 * res.word_perplexity(0));
  // One JSON line per token, in order.
  std::istringstream lines(per_token.str());
  std::string line;
  int64_t n = 0;
  double sum = 0;
  while (std::getline(lines, line)) {
    auto j = json::parse(line);
    EXPECT_EQ(j["index"], n);
    EXPECT_EQ(j["token"], ids[n]);
    sum += j["logprob"].get<double>();
    ++n;
  }
  EXPECT_EQ(n, (int64_t)ids.size());
  EXPECT_NEAR(sum, expected, 1e-4 * std::abs(expected));
}

TEST(EvalScorer, BatchingAndPaddingDoNotChangeScores) {
  auto model = tiny_model();
  std::vector<TokenRequest> reqs{{{1, 2, 3}, {4, 5}}, {{9}, {8, 7, 6, 5, 4, 3}}, {{5, 5, 5, 5, 5, 5, 5, 5}, {1}},
                                 {{3, 1, 4, 1, 5, 9, 2, 6}, {5, 3, 5}}};
  Scorer one(*model, {/*max_length=*/6, /*batch_tokens=*/1, {}});   // one request per forward
  Scorer many(*model, {/*max_length=*/6, /*batch_tokens=*/1000, {}}); // all in one padded batch
  const auto a = one.score(reqs), b = many.score(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_EQ(a[i].logprobs[0].size(), reqs[i].continuation.size());
    for (size_t j = 0; j < reqs[i].continuation.size(); ++j) EXPECT_NEAR(a[i].logprobs[0][j], b[i].logprobs[0][j], 1e-5);
    EXPECT_EQ(a[i].greedy, b[i].greedy);
  }
  // Truncation keeps the last max_length + 1 tokens: a shorter start of the same tail scores the same.
  const auto cut = many.score({{{1, 5, 9, 2, 6}, {5, 3, 5}}});
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(cut[0].logprobs[0][j], b[3].logprobs[0][j], 1e-5);
}

TEST(EvalScorer, ExitsAllGivesEveryLoopAndTheLastIsTheDefault) {
  for (auto form : {ModelForm::LT2, ModelForm::Ouro}) {
    auto model = tiny_model(form);
    std::vector<TokenRequest> reqs{{{1, 2, 3}, {4, 5, 6}}};
    LoopOptions all;
    all.all_exits = true;
    Scorer per_loop(*model, {64, 4096, all});
    Scorer last(*model, {64, 4096, {}});
    ASSERT_EQ(per_loop.num_exits(), 3);
    EXPECT_EQ(per_loop.exit_names()[0], "loop 1");
    const auto a = per_loop.score(reqs), b = last.score(reqs);
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(a[0].logprobs[2][j], b[0].logprobs[0][j], 1e-5);
    EXPECT_GT(std::abs(a[0].logprobs[0][0] - a[0].logprobs[2][0]), 1e-6);  // the loops differ
    // Fewer loops (LT2 --loops) / an earlier exit (Ouro --exit-step) give that loop's column.
    LoopOptions two;
    (form == ModelForm::Ouro ? two.exit_step : two.loops) = 2;
    const auto c = Scorer(*model, {64, 4096, two}).score(reqs);
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(c[0].logprobs[0][j], a[0].logprobs[1][j], 1e-5);
  }
}

TEST(EvalScorer, ExitSettingsAreCheckedAgainstTheModel) {
  auto lt2_cfg = tiny_model()->config();
  LoopOptions o;
  o.exit_step = 1;
  eval_testing::expect_error([&] { forward_options(lt2_cfg, o); }, {"--exit-step", "exit gate"});
  o = {};
  o.loops = 9;
  eval_testing::expect_error([&] { forward_options(lt2_cfg, o); }, {"--loops", "[1, 3]"});
  auto ouro_cfg = tiny_model(ModelForm::Ouro)->config();
  o = {};
  o.all_exits = true;
  o.exit_threshold = 0.5;
  eval_testing::expect_error([&] { forward_options(ouro_cfg, o); }, {"--exits all"});
  o = {};
  o.exit_threshold = 1.0;
  o.exit_rule_published = true;
  EXPECT_TRUE(forward_options(ouro_cfg, o).exit_rule_published);
  EXPECT_EQ(exit_names(ouro_cfg, o)[0], "exit q=1 (published rule)");
}

TEST(EvalScorer, EncodePairMovesTrailingSpacesToTheContinuation) {
  auto tok = byte_tokenizer();
  const auto r = encode_pair(tok, "Answer: ", "yes", 256);
  EXPECT_EQ(r.context, tok.encode("Answer:"));
  EXPECT_EQ(r.continuation, tok.encode(" yes"));
  EXPECT_EQ(encode_pair(tok, "", "abc", 256).context, std::vector<int32_t>{256});
}

namespace {
// A log-likelihood function the test controls: the value of each continuation, looked up by text.
LoglikelihoodFn fixed_ll(std::map<std::string, double> values) {
  return [values](const std::vector<LLRequest>& reqs) {
    std::vector<LLResult> out;
    for (const auto& r : reqs) out.push_back({{values.at(r.continuation)}, {r.continuation == " a"}});
    return out;
  };
}
}  // namespace

TEST(EvalTasks, AccAndAccNormAsTheHarnessScoresThem) {
  const auto& spec = find_task("arc_easy");
  // Choice "a" has the higher sum; "éééé" (4 characters, 8 bytes) the higher sum per character.
  McItem item{{{"Q", " a"}, {"Q", " \u00e9\u00e9\u00e9\u00e9"}}, {"a", "\u00e9\u00e9\u00e9\u00e9"}, 1};
  // -2 / 1 < -6 / 4 (= -1.5); by bytes it would be -6 / 8 either way, by tokens unknown.
  auto res = score_task(spec, {item}, fixed_ll({{" a", -2.0}, {" \u00e9\u00e9\u00e9\u00e9", -6.0}}), {"final"});
  EXPECT_EQ(res.metrics[0].at("acc"), 0.0);
  EXPECT_EQ(res.metrics[0].at("acc_norm"), 1.0);
  // Equal sums: the first choice wins (np.argmax).
  McItem tie{{{"Q", " a"}, {"Q", " b"}}, {"a", "b"}, 1};
  res = score_task(spec, {tie}, fixed_ll({{" a", -1.0}, {" b", -1.0}}), {"final"});
  EXPECT_EQ(res.metrics[0].at("acc"), 0.0);
  // LAMBADA: acc = greedy match, perplexity = exp(-mean log-likelihood).
  const auto& lambada = find_task("lambada_openai");
  res = score_task(lambada, {McItem{{{"x", " a"}}, {}, 0}, McItem{{{"y", " b"}}, {}, 0}},
                   fixed_ll({{" a", -1.0}, {" b", -3.0}}), {"final"});
  EXPECT_EQ(res.metrics[0].at("acc"), 0.5);
  EXPECT_NEAR(res.metrics[0].at("perplexity"), std::exp(2.0), 1e-9);
  // The average uses each task's primary metric.
  TaskResult a{"a", 1, "acc", {"final"}, {{{"acc", 0.5}, {"acc_norm", 0.0}}}};
  TaskResult b{"b", 1, "acc_norm", {"final"}, {{{"acc", 0.0}, {"acc_norm", 0.25}}}};
  EXPECT_NEAR(average_primary({a, b})[0], 0.375, 1e-12);
  EXPECT_NE(tasks_markdown({a, b}).find("| **average** | | * | 37.50 |"), std::string::npos) << tasks_markdown({a, b});
}
