// Curriculum state machine on scripted accuracy sequences; exact match and masked CE on
// hand-made logits.
#include <gtest/gtest.h>

#include "lt2/tasks/curriculum.h"
#include "lt2/util/error.h"

using namespace lt2::tasks;
using Event = Curriculum::Event;

TEST(Curriculum, StageSizes) {
  const int64_t expected[] = {8, 16, 32, 64, 128, 256};
  for (int64_t k = 1; k <= 6; ++k) EXPECT_EQ(stage_n(k), expected[k - 1]);
  EXPECT_THROW(stage_n(0), lt2::Error);
}

TEST(Curriculum, AdvancesAtThresholdAndStopsAtTheBudget) {
  Curriculum c({6, 1000, 0.9});
  EXPECT_EQ(c.stage(), 1);
  EXPECT_EQ(c.n(), 8);
  EXPECT_EQ(c.record_eval(100, 0.5), Event::Continue);
  EXPECT_EQ(c.record_eval(200, 0.89), Event::Continue);
  EXPECT_EQ(c.record_eval(300, 0.90), Event::Advanced);  // >= threshold
  EXPECT_EQ(c.stage(), 2);
  EXPECT_EQ(c.n(), 16);
  EXPECT_EQ(c.stage_start_step(), 300);
  EXPECT_EQ(c.stage_end_step(), 1300);
  EXPECT_EQ(c.record_eval(1000, 0.95), Event::Advanced);  // stage 2 solved in 700 steps
  EXPECT_EQ(c.n(), 32);
  EXPECT_EQ(c.record_eval(1500, 0.1), Event::Continue);
  EXPECT_EQ(c.record_eval(1999, 0.8), Event::Continue);  // 999 steps spent: still in budget
  EXPECT_FALSE(c.finished());
  EXPECT_EQ(c.record_eval(2000, 0.85), Event::Finished);  // budget of 1000 reached
  EXPECT_TRUE(c.finished());
  EXPECT_EQ(c.score(), 16);
  EXPECT_THROW(c.record_eval(2100, 1.0), lt2::Error);

  ASSERT_EQ(c.results().size(), 3u);
  EXPECT_TRUE(c.results()[0].solved);
  EXPECT_EQ(c.results()[0].steps, 300);
  EXPECT_EQ(c.results()[1].steps, 700);
  EXPECT_FALSE(c.results()[2].solved);
  EXPECT_EQ(c.results()[2].n, 32);
  EXPECT_EQ(c.results()[2].steps, 1000);
  EXPECT_DOUBLE_EQ(c.results()[2].final_accuracy, 0.85);
  EXPECT_EQ(c.evals().size(), 7u);
}

TEST(Curriculum, SolvingTheLastStageFinishesWithTheLargestN) {
  Curriculum c({6, 100, 0.9});
  for (int64_t k = 1; k <= 5; ++k) EXPECT_EQ(c.record_eval(10 * k, 1.0), Event::Advanced);
  EXPECT_EQ(c.n(), 256);
  EXPECT_EQ(c.record_eval(60, 0.99), Event::Finished);
  EXPECT_EQ(c.score(), 256);
}

TEST(Curriculum, FailingTheFirstStageScoresZeroAndSolvingBeatsTheBudget) {
  Curriculum fail({6, 100, 0.9});
  EXPECT_EQ(fail.record_eval(100, 0.3), Event::Finished);
  EXPECT_EQ(fail.score(), 0);
  Curriculum at_budget({6, 100, 0.9});
  EXPECT_EQ(at_budget.record_eval(100, 0.9), Event::Advanced);  // solved at the budget step
  EXPECT_THROW(at_budget.record_eval(50, 0.9), lt2::Error);      // steps must not decrease
}

TEST(Curriculum, JsonRoundTripResumes) {
  Curriculum a({6, 1000, 0.9});
  a.record_eval(100, 0.95);
  a.record_eval(400, 0.4);
  Curriculum b = Curriculum::from_json(nlohmann::json::parse(a.to_json().dump()));
  EXPECT_EQ(b.to_json(), a.to_json());
  EXPECT_EQ(b.stage(), 2);
  EXPECT_EQ(b.stage_start_step(), 100);
  // Both continue identically.
  EXPECT_EQ(a.record_eval(1100, 0.5), Event::Finished);
  EXPECT_EQ(b.record_eval(1100, 0.5), Event::Finished);
  EXPECT_EQ(b.to_json(), a.to_json());
  EXPECT_EQ(b.score(), 8);
  EXPECT_THROW(Curriculum::from_json(nlohmann::json{{"stage", 1}}), lt2::Error);
}

TEST(Metrics, ExactMatchCountsAnExampleOnlyIfAllScoredPositionsAreRight) {
  torch::set_num_threads(1);
  // B = 4, L = 3, V = 5. Predictions (argmax) per example:
  const std::vector<std::vector<int64_t>> pred = {{1, 2, 3}, {1, 2, 3}, {0, 0, 0}, {4, 4, 4}};
  auto logits = torch::zeros({4, 3, 5});
  for (int b = 0; b < 4; ++b)
    for (int i = 0; i < 3; ++i) logits[b][i][pred[b][i]] = 1.0;
  const auto targets = torch::tensor({1, 2, 3, 1, 0, 3, 1, 0, 0, 4, 4, 0}, torch::kInt64).view({4, 3});
  const auto mask = torch::tensor({1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1}, torch::kBool).view({4, 3});
  // Example 0: all right. 1: the wrong position is unscored -> right. 2: right at the scored
  // positions 1, 2. 3: position 2 wrong -> wrong.
  EXPECT_DOUBLE_EQ(exact_match_accuracy(logits, targets, mask), 0.75);
  EXPECT_DOUBLE_EQ(exact_match_accuracy(logits, targets, torch::zeros({4, 3}, torch::kBool)), 1.0);
  EXPECT_THROW(exact_match_accuracy(logits[0], targets, mask), lt2::Error);
}

TEST(Metrics, MaskedCrossEntropyAveragesOverScoredPositionsOnly) {
  torch::set_num_threads(1);
  const auto logits = torch::randn({2, 3, 7});
  const auto targets = torch::randint(7, {2, 3}, torch::kInt64);
  const auto mask = torch::tensor({1, 0, 1, 0, 0, 1}, torch::kBool).view({2, 3});
  const auto logp = torch::log_softmax(logits, -1);
  const double expected = -(logp[0][0][targets[0][0].item<int64_t>()] +
                            logp[0][2][targets[0][2].item<int64_t>()] +
                            logp[1][2][targets[1][2].item<int64_t>()])
                               .item<double>() /
                          3.0;
  EXPECT_NEAR(masked_cross_entropy(logits, targets, mask).item<double>(), expected, 1e-5);
  EXPECT_THROW(masked_cross_entropy(logits, targets, torch::zeros({2, 3}, torch::kBool)), lt2::Error);
}
