// The harness's text rules: word counts, WikiText articles and detokenisation, HellaSwag's preprocess.
#include "eval_testing.h"
#include "lt2/eval/text.h"

using namespace lt2;
using namespace lt2::eval;

TEST(EvalText, CountsWordsAndCharactersAsPython) {
  EXPECT_EQ(count_words("a b  c"), 3);
  EXPECT_EQ(count_words(" a b\n"), 4);  // re.split: empty strings at both ends count
  EXPECT_EQ(count_words(""), 1);
  EXPECT_EQ(count_words("a\u00a0b"), 2);  // Unicode whitespace splits too
  EXPECT_EQ(count_chars("h\u00e9llo"), 5);
  EXPECT_EQ(strip(" \t x y \n"), "x y");
  EXPECT_EQ(rstrip("x  "), "x");
  EXPECT_EQ(lstrip("  x "), "x ");
}

TEST(EvalText, WikitextDetokenizerMatchesTheHarness) {
  const std::string raw = " = Valkyria = \n \n The game 's cost was 1 @,@ 000 ( approx . ) and \" quoted \" , he said . \n";
  EXPECT_EQ(wikitext_detokenize(raw), " = Valkyria =\n\nThe game's cost was 1,000 (approx.) and \"quoted\", he said.\n");
  EXPECT_EQ(count_words(raw), 25);
  EXPECT_EQ(wikitext_detokenize("a = = b = = c 5 @-@ 6 @.@ 7 x ° y N z"), "a == b == c 5-6.7 x°y 1 z");
  EXPECT_EQ(wikitext_detokenize("/' 5/ and ( unclosed"), "/'[0-9]/ and ( unclosed");
}

TEST(EvalText, WikitextArticlesStartAtLevelOneHeadings) {
  const std::string raw = " = A = \n text a \n = = Sub = = \n more \n = B = \n text b \n";
  const auto pages = split_wikitext_articles(raw);
  ASSERT_EQ(pages.size(), 2u);
  EXPECT_EQ(pages[0], " = A = \n text a \n = = Sub = = \n more ");
  EXPECT_EQ(pages[1], " = B = \n text b \n");
}

TEST(EvalText, HellaswagPreprocess) {
  EXPECT_EQ(hellaswag_preprocess("  Foo [title] Bar [step] baz  qux [header]"), "Foo. Bar baz qux ");
  EXPECT_EQ(hellaswag_preprocess("a [b\nc] d"), "a [b\nc] d");  // '.' does not cross a newline
}

TEST(EvalText, RealWikitextSplitsIntoArticles) {
  const std::string path = eval_testing::shared_data() + "/wikitext-2/test.txt";
  if (!path_exists(path)) GTEST_SKIP() << "no " << path;
  const auto pages = split_wikitext_articles(read_file(path));
  ASSERT_GT(pages.size(), 10u);
  EXPECT_EQ(pages[0].rfind(" = Robert ", 0), 0u);  // " = Robert <unk> = " in the tokenized release
  for (const auto& p : pages) EXPECT_EQ(strip(p).rfind("= ", 0), 0u) << p.substr(0, 80);
}
