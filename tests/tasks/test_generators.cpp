// Generators: answers derivable from the prompt (independent solvers), determinism, disjoint
// train/eval streams, documented lengths and vocabularies.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "lt2/tasks/generators.h"
#include "lt2/util/error.h"

using namespace lt2::tasks;

namespace {

// Solves a recall task from its tokens alone: reads the bindings (and swaps), then answers
// each query segment key. Returns the expected targets (PAD on unscored positions).
std::vector<int64_t> solve_recall(const std::vector<int64_t>& tok, bool with_swaps) {
  std::vector<int64_t> out(tok.size(), kPad);
  EXPECT_EQ(tok[0], kBos);
  std::map<int64_t, int64_t> value_of;
  size_t i = 1;
  for (; tok[i] != kSep; i += 2) value_of[tok[i]] = tok[i + 1];
  ++i;
  if (with_swaps) {
    for (; tok[i] != kSep; i += 2) std::swap(value_of.at(tok[i]), value_of.at(tok[i + 1]));
    ++i;
  }
  for (; i < tok.size(); i += 2) out[i] = value_of.at(tok[i]);
  return out;
}

// Solves S5 by applying each permutation to an explicit arrangement of 5 items.
std::vector<int64_t> solve_s5(const std::vector<int64_t>& tok) {
  std::vector<std::array<int, 5>> perms;  // lexicographic order, built here independently
  std::array<int, 5> p = {0, 1, 2, 3, 4};
  do perms.push_back(p);
  while (std::next_permutation(p.begin(), p.end()));
  std::vector<int64_t> out(tok.size(), kPad);
  std::array<int, 5> state = {0, 1, 2, 3, 4};  // state[x] = where x has been sent so far
  for (size_t i = 1; i < tok.size(); ++i) {
    const auto& g = perms.at(tok[i] - kFirstTaskToken);
    for (auto& s : state) s = g[s];
    out[i] = kFirstTaskToken + (std::find(perms.begin(), perms.end(), state) - perms.begin());
  }
  return out;
}

std::vector<int64_t> solve(const TaskParams& p, const std::vector<int64_t>& tok) {
  return p.kind == TaskKind::S5 ? solve_s5(tok) : solve_recall(tok, p.kind == TaskKind::SwapRecall);
}

const TaskKind kAll[] = {TaskKind::SwapRecall, TaskKind::Mqar, TaskKind::S5};

}  // namespace

TEST(Generators, IndependentSolverAgreesWithTargets) {
  for (TaskKind kind : kAll) {
    for (int64_t n : {2, 8, 16, 64}) {
      TaskParams p{kind, n};
      for (uint64_t seed = 0; seed < 20; ++seed) {
        for (Stream st : {Stream::Train, Stream::Eval}) {
          const Sequence s = generate(p, seed, st, static_cast<int64_t>(seed) * 7);
          EXPECT_EQ(s.targets, solve(p, s.tokens)) << task_name(kind) << " n=" << n;
          for (size_t i = 0; i < s.tokens.size(); ++i) {
            EXPECT_EQ(s.mask[i] != 0, s.targets[i] != kPad);
            EXPECT_GE(s.tokens[i], 0);
            EXPECT_LT(s.tokens[i], vocab_size(p));
            EXPECT_LT(s.targets[i], vocab_size(p));
          }
        }
      }
    }
  }
}

TEST(Generators, LengthsAndQueryCountsMatchTheFormulas) {
  for (int64_t n : {2, 8, 16, 32, 64, 128, 256}) {
    const int64_t q = std::min<int64_t>(n, 32);
    const std::map<TaskKind, std::pair<int64_t, int64_t>> expected = {
        {TaskKind::SwapRecall, {3 + 4 * n + 2 * q, q}},
        {TaskKind::Mqar, {2 + 2 * n + 2 * q, q}},
        {TaskKind::S5, {1 + n, n}}};
    for (const auto& [kind, len_q] : expected) {
      TaskParams p{kind, n};
      EXPECT_EQ(seq_len(p), len_q.first);
      const Sequence s = generate(p, 3, Stream::Train, n);
      ASSERT_EQ(static_cast<int64_t>(s.tokens.size()), len_q.first) << task_name(kind);
      ASSERT_EQ(s.targets.size(), s.tokens.size());
      ASSERT_EQ(s.mask.size(), s.tokens.size());
      EXPECT_EQ(std::count(s.mask.begin(), s.mask.end(), 1), len_q.second) << task_name(kind);
    }
  }
  EXPECT_EQ(vocab_size({TaskKind::SwapRecall, 8}), 3 + 2 * 256);
  EXPECT_EQ(vocab_size({TaskKind::S5, 8}), 123);
}

TEST(Generators, SwapRecallStructure) {
  // n distinct keys, n distinct values, n swaps of two distinct bound keys, distinct query keys.
  TaskParams p{TaskKind::SwapRecall, 16};
  for (int64_t idx = 0; idx < 50; ++idx) {
    const auto tok = generate(p, 11, Stream::Train, idx).tokens;
    std::set<int64_t> keys, values;
    for (int64_t i = 0; i < 16; ++i) {
      keys.insert(tok[1 + 2 * i]);
      values.insert(tok[2 + 2 * i]);
    }
    EXPECT_EQ(keys.size(), 16u);
    EXPECT_EQ(values.size(), 16u);
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t a = tok[34 + 2 * j], b = tok[35 + 2 * j];
      EXPECT_NE(a, b);
      EXPECT_TRUE(keys.count(a) && keys.count(b));
    }
    std::set<int64_t> queried;
    for (size_t i = 3 + 4 * 16; i < tok.size(); i += 2) queried.insert(tok[i]);
    EXPECT_EQ(queried.size(), 16u);
  }
}

TEST(Generators, SameSeedSameExamplesDifferentSeedDifferentExamples) {
  for (TaskKind kind : kAll) {
    TaskParams p{kind, 16};
    const Example a = make_batch(p, 42, Stream::Train, 100, 8);
    const Example b = make_batch(p, 42, Stream::Train, 100, 8);
    const Example c = make_batch(p, 43, Stream::Train, 100, 8);
    EXPECT_TRUE(torch::equal(a.tokens, b.tokens));
    EXPECT_TRUE(torch::equal(a.targets, b.targets));
    EXPECT_TRUE(torch::equal(a.mask, b.mask));
    EXPECT_FALSE(torch::equal(a.tokens, c.tokens));
    EXPECT_EQ(a.tokens.size(0), 8);
    EXPECT_EQ(a.tokens.size(1), seq_len(p));
    EXPECT_EQ(a.tokens.scalar_type(), torch::kInt64);
    EXPECT_EQ(a.targets.scalar_type(), torch::kInt64);
    EXPECT_EQ(a.mask.scalar_type(), torch::kBool);
    // Row b of a batch is example first_index + b.
    const Sequence s = generate(p, 42, Stream::Train, 103);
    EXPECT_TRUE(torch::equal(a.tokens[3], torch::tensor(s.tokens, torch::kInt64)));
  }
}

TEST(Generators, TrainAndEvalStreamsShareNoExample) {
  // Small n so that collisions would be likely if the streams were not partitioned.
  for (TaskKind kind : kAll) {
    TaskParams p{kind, 2, 4};
    std::set<std::vector<int64_t>> train, eval;
    for (int64_t i = 0; i < 3000; ++i) {
      train.insert(generate(p, 5, Stream::Train, i).tokens);
      eval.insert(generate(p, 5, Stream::Eval, i).tokens);
    }
    EXPECT_GT(train.size(), 10u) << task_name(kind);
    EXPECT_GT(eval.size(), 10u) << task_name(kind);
    for (const auto& t : eval) EXPECT_EQ(train.count(t), 0u) << task_name(kind);
    for (const auto& t : train) EXPECT_EQ(content_hash(t) % 2, 0u);
    for (const auto& t : eval) EXPECT_EQ(content_hash(t) % 2, 1u);
  }
}

TEST(Generators, S5IndexIsTheLexicographicRank) {
  const auto& perms = s5_permutations();
  ASSERT_EQ(perms.size(), 120u);
  for (int64_t i = 0; i < 120; ++i) EXPECT_EQ(s5_index(perms[i]), i);
  EXPECT_EQ(s5_index({0, 1, 2, 3, 4}), 0);
  EXPECT_EQ(s5_index({4, 3, 2, 1, 0}), 119);
}

TEST(Generators, BadArgumentsThrow) {
  EXPECT_THROW(seq_len({TaskKind::Mqar, 300}), lt2::Error);  // n > pool
  EXPECT_THROW(seq_len({TaskKind::SwapRecall, 1}), lt2::Error);
  EXPECT_THROW(generate({TaskKind::S5, 0}, 0, Stream::Train, 0), lt2::Error);
  EXPECT_THROW(make_batch({TaskKind::S5, 8}, 0, Stream::Train, 0, 0), lt2::Error);
  EXPECT_THROW(parse_task("nope"), lt2::Error);
  EXPECT_EQ(parse_task("swap-recall"), TaskKind::SwapRecall);
  EXPECT_EQ(parse_task("mqar"), TaskKind::Mqar);
  EXPECT_EQ(parse_task("s5"), TaskKind::S5);
}
