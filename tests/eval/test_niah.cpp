// The needle-in-a-haystack generator (needle where the depth says, lengths hit within one sentence,
// seeded) and a small run through the inference engine.
#include "eval_testing.h"
#include "lt2/eval/niah.h"

using namespace lt2;
using namespace lt2::eval;

namespace {
const std::string kEssay =
    "Paul wrote essays. They were long! Some were short? Most were about startups. Founders read them. "
    "Investors too. Then he wrote more. The end came late. Nobody minded. Readers asked for more essays.";
}

TEST(EvalNiah, NeedleSitsAtTheDepth) {
  auto tok = eval_testing::byte_tokenizer();
  for (const std::string task : {"s-niah-1", "s-niah-2", "s-niah-3"}) {
    SCOPED_TRACE(task);
    NiahGenerator gen(task, tok, kEssay);
    const std::string needle_start = "One of the special magic ";
    auto start = gen.build(40, 0, "odd-key", "1234567");
    EXPECT_EQ(start.needle_unit, 0);
    EXPECT_EQ(start.prompt.compare(start.needle_offset, needle_start.size(), needle_start), 0);
    EXPECT_EQ(start.prompt[start.needle_offset - 1], '\n');  // right after the instructions
    auto end = gen.build(40, 100, "odd-key", "1234567");
    EXPECT_EQ(end.needle_unit, 40);
    const std::string after = "One of the special magic " + std::string(task == "s-niah-3" ? "uuids" : "numbers") +
                              " for odd-key is: 1234567.\nWhat is the special magic";
    EXPECT_EQ(end.prompt.compare(end.needle_offset, after.size(), after), 0);
    auto mid = gen.build(41, 50, "odd-key", "1234567");
    EXPECT_LE(std::abs(mid.needle_unit - 41 / 2), 1);
    // The needle splits the haystack: as much text before as after, within one sentence.
    const size_t q = mid.prompt.find("\nWhat is the special");
    const double before = mid.needle_offset, total = q;
    EXPECT_NEAR(before / total, 0.5, 0.1);
  }
}

TEST(EvalNiah, LengthsHitTheirTargetWithinOneSentence) {
  auto tok = eval_testing::byte_tokenizer();
  for (const std::string task : {"s-niah-1", "s-niah-2"}) {
    NiahGenerator gen(task, tok, kEssay);
    for (int64_t length : {500, 1000, 2500}) {
      const auto s = gen.sample(length, 50, 0, 1, /*reserve=*/16);
      EXPECT_LE(s.tokens + 16, length);
      EXPECT_GT(gen.build(s.units + 1, 50, s.key, s.value).tokens + 16, length) << task << " " << length;
      EXPECT_EQ(s.tokens, (int64_t)tok.encode(s.prompt).size());
    }
  }
  NiahGenerator gen("s-niah-1", tok);
  eval_testing::expect_error([&] { gen.sample(50, 0, 0, 1, 16); }, {"length 50", "too short"});
}

TEST(EvalNiah, SeededSamples) {
  auto tok = eval_testing::byte_tokenizer();
  NiahGenerator gen("s-niah-3", tok, kEssay);
  const auto a = gen.sample(600, 25, 3, 7, 16), b = gen.sample(600, 25, 3, 7, 16), c = gen.sample(600, 25, 3, 8, 16);
  EXPECT_EQ(a.prompt, b.prompt);
  EXPECT_NE(a.value, c.value);
  EXPECT_NE(a.value, gen.sample(600, 25, 4, 7, 16).value);  // another sample of the same cell
  EXPECT_EQ(a.value.size(), 36u);
  EXPECT_EQ(a.value[14], '4');  // UUID version 4
  EXPECT_EQ(NiahGenerator("s-niah-1", tok).sample(600, 25, 3, 7, 16).value.size(), 7u);
  eval_testing::expect_error([&] { NiahGenerator("s-niah-2", tok, "  "); }, {"--haystack"});
  eval_testing::expect_error([&] { NiahGenerator("s-niah-9", tok); }, {"unknown NIAH task", "s-niah-9"});
}

TEST(EvalNiah, RunsThroughTheEngine) {
  auto tok = eval_testing::byte_tokenizer();
  auto model = eval_testing::tiny_model(ModelForm::LT2, 512);
  NiahGenerator gen("s-niah-1", tok);
  NiahOptions o;
  o.lengths = {420, 480};
  o.depths = {0, 100};
  o.samples = 2;
  o.max_new_tokens = 4;
  o.batch = 3;
  o.loops.all_exits = true;
  const auto res = run_niah(model, tok, gen, o, /*quiet=*/true);
  ASSERT_EQ(res.exits.size(), 3u);  // one run per loop
  EXPECT_EQ(res.samples.size(), 3u * 2 * 2 * 2);
  for (const auto& s : res.samples) EXPECT_LE(s["prompt_tokens"].get<int64_t>() + 4, s["length"].get<int64_t>());
  EXPECT_NE(res.markdown().find("| 420 |"), std::string::npos);
  EXPECT_EQ(res.to_json()["exits"][2]["scores"].size(), 2u);
}
