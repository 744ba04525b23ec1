// Conformance with Hugging Face `tokenizers`: the same ids and decoded strings for the same
// texts, with tokenizers trained by HF on English text and with published tokenizer files.
#include <gtest/gtest.h>

#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/fs.h"
#include "oracle.h"

namespace lt2 {
namespace {

using test::OracleResult;

// Compares lt2 with HF's results on every text; reports the first few differences in full.
void expect_same_as_oracle(const Tokenizer& tok, const std::vector<std::string>& texts,
                           const OracleResult& hf, const std::string& name) {
  ASSERT_EQ(hf.ids.size(), texts.size());
  int failures = 0;
  for (size_t i = 0; i < texts.size() && failures < 5; ++i) {
    const std::vector<int32_t> ids = tok.encode(texts[i]);
    const std::vector<int32_t> ids_special = tok.encode(texts[i], /*add_special_tokens=*/true);
    const bool ok = ids == hf.ids[i] && ids_special == hf.ids_special[i] &&
                    tok.decode(hf.ids[i]) == hf.decoded[i] &&
                    tok.decode(hf.ids[i], /*skip_special=*/true) == hf.decoded_skip[i];
    if (!ok) {
      ++failures;
      ADD_FAILURE() << name << ": text " << i << " " << json(texts[i]).dump()
                    << "\n  lt2 ids " << json(ids).dump() << "\n  HF  ids " << json(hf.ids[i]).dump()
                    << "\n  lt2 ids+special " << json(ids_special).dump() << "\n  HF  ids+special "
                    << json(hf.ids_special[i]).dump() << "\n  lt2 decode " << json(tok.decode(hf.ids[i])).dump()
                    << "\n  HF  decode " << json(hf.decoded[i]).dump() << "\n  lt2 decode(skip) "
                    << json(tok.decode(hf.ids[i], true)).dump() << "\n  HF  decode(skip) "
                    << json(hf.decoded_skip[i]).dump();
    }
  }
}

// A corpus and tokenizers trained on it by HF, shared by the tests of this suite.
class HfTrained : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!test::oracle_unavailable().empty()) return;
    dir_ = new test::TempDir();
    corpus_source_ = test::write_english_corpus(dir_->file("corpus.txt"), 1 << 20);
    test::run_oracle({"train", "gpt2", dir_->file("corpus.txt"), "3000", dir_->file("gpt2.json")});
    test::run_oracle({"train", "llama3", dir_->file("corpus.txt"), "3000", dir_->file("llama3.json")});
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    const std::string reason = test::oracle_unavailable();
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
  static test::TempDir* dir_;
  static std::string corpus_source_;
};
test::TempDir* HfTrained::dir_ = nullptr;
std::string HfTrained::corpus_source_;

TEST_F(HfTrained, Gpt2StyleTokenizerMatchesHf) {
  const std::string path = dir_->file("gpt2.json");
  const Tokenizer tok = Tokenizer::load(path);
  const auto texts = test::varied_texts({"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  expect_same_as_oracle(tok, texts, test::oracle_encode(path, texts), "gpt2-style (" + corpus_source_ + ")");
}

TEST_F(HfTrained, Llama3StyleTokenizerWithAddedTokensMatchesHf) {
  // NFC, Split regex + ByteLevel without regex, a template post-processor, and added tokens that
  // are normalized, stripping and single-word.
  const std::string path = dir_->file("llama3.json");
  const Tokenizer tok = Tokenizer::load(path);
  const auto texts =
      test::varied_texts({"<|endoftext|>", "<|im_start|>", "<|fim|>", "<tab>", "    ", "cat"});
  expect_same_as_oracle(tok, texts, test::oracle_encode(path, texts), "llama3-style");
}

TEST_F(HfTrained, EncodesTheCorpusLikeHf) {
  // Whole paragraphs of the training text, where most merges fire.
  const std::string corpus = read_file(dir_->file("corpus.txt"));
  std::vector<std::string> texts;
  for (size_t pos = 0; pos + 4000 < corpus.size() && texts.size() < 20; pos += corpus.size() / 20)
    texts.push_back(corpus.substr(pos, 4000));
  for (const char* name : {"gpt2.json", "llama3.json"}) {
    const Tokenizer tok = Tokenizer::load(dir_->file(name));
    expect_same_as_oracle(tok, texts, test::oracle_encode(dir_->file(name), texts), name);
  }
}

TEST_F(HfTrained, SavedCopyEncodesTheSameAndHfReadsIt) {
  const Tokenizer tok = Tokenizer::load(dir_->file("llama3.json"));
  tok.save(dir_->file("llama3-resaved.json"));
  const Tokenizer again = Tokenizer::load(dir_->file("llama3-resaved.json"));
  const auto texts = test::varied_texts({"<|endoftext|>", "<tab>"});
  expect_same_as_oracle(again, texts, test::oracle_encode(dir_->file("llama3-resaved.json"), texts),
                        "re-saved");
  for (const std::string& t : texts) EXPECT_EQ(tok.encode(t), again.encode(t));
}

// Pre-tokenizer, normalizer and model options that the trained files do not use, applied to the
// HF-trained GPT-2-style vocabulary (any byte-level split is valid for it) and compared with HF.
TEST_F(HfTrained, PipelineVariantsMatchHf) {
  const json base = load_json_file(dir_->file("gpt2.json"));
  const json byte_level_prefix = {
      {"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  const json byte_level_plain = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  auto split = [](const json& pattern, const char* behavior, bool invert) {
    return json{{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
  };
  auto sequence = [](const std::vector<json>& steps) {
    return json{{"type", "Sequence"}, {"pretokenizers", steps}};
  };
  const std::vector<std::pair<std::string, json>> pre_tokenizers = {
      {"string-merged-with-previous",
       sequence({split({{"String", " "}}, "MergedWithPrevious", false), byte_level_prefix})},
      {"digits-merged-with-next", sequence({split({{"Regex", "\\p{N}+"}}, "MergedWithNext", false), byte_level_plain})},
      {"removed-then-punctuation",
       sequence({split({{"Regex", "\\s+"}}, "Removed", false), {{"type", "Punctuation"}, {"behavior", "Contiguous"}},
                 byte_level_prefix})},
      {"inverted-contiguous", sequence({split({{"Regex", "[a-z]+"}}, "Contiguous", true), byte_level_plain})},
      {"steps-after-byte-level",
       sequence({{{"type", "Digits"}, {"individual_digits", false}}, byte_level_prefix,
                 split({{"Regex", "Ġ"}}, "MergedWithNext", false), {{"type", "Digits"}, {"individual_digits", true}}})},
  };
  const auto texts = test::varied_texts({"<|endoftext|>", "<|im_start|>"});
  for (const auto& [name, pre] : pre_tokenizers) {
    json doc = base;
    doc["pre_tokenizer"] = pre;
    const std::string path = dir_->file(name + ".json");
    write_file_atomic(path, doc.dump());
    expect_same_as_oracle(Tokenizer::load(path), texts, test::oracle_encode(path, texts), name);
  }
  // A normalizer Sequence, ignore_merges, and a template with a special token on both sides.
  json doc = base;
  doc["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  doc["model"]["ignore_merges"] = true;
  doc["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       {{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}},
        {{"type", "TemplateProcessing"},
         {"single", {{{"SpecialToken", {{"id", "<|im_start|>"}, {"type_id", 0}}}},
                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                     {{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}}}},
         {"pair", {{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
         {"special_tokens",
          {{"<|im_start|>", {{"id", "<|im_start|>"}, {"ids", {1}}, {"tokens", {"<|im_start|>"}}}},
           {"<|endoftext|>", {{"id", "<|endoftext|>"}, {"ids", {0}}, {"tokens", {"<|endoftext|>"}}}}}}}}}};
  const std::string path = dir_->file("variant-model.json");
  write_file_atomic(path, doc.dump());
  expect_same_as_oracle(Tokenizer::load(path), texts, test::oracle_encode(path, texts), "nfc+ignore_merges+template");
}

// Published tokenizers from ../shared/data/tokenizers (absent on a user's machine: skip).
class Published : public ::testing::TestWithParam<const char*> {};

TEST_P(Published, MatchesHf) {
  const std::string dir = test::published_tokenizers_dir();
  if (dir.empty()) GTEST_SKIP() << "no ../shared/data/tokenizers next to the checkout";
  const std::string reason = test::oracle_unavailable();
  if (!reason.empty()) GTEST_SKIP() << reason;
  const std::string path = dir + "/" + GetParam() + "/tokenizer.json";
  if (!path_exists(path)) GTEST_SKIP() << path << " is absent";
  const Tokenizer tok = Tokenizer::load(path);
  std::vector<std::string> specials;
  for (const AddedToken& a : tok.added_tokens())
    if (specials.size() < 6) specials.push_back(a.content);
  const auto texts = test::varied_texts(specials);
  expect_same_as_oracle(tok, texts, test::oracle_encode(path, texts), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Published,
                         ::testing::Values("smollm-360m-instruct", "smollm2-135m-instruct", "phi-2",
                                           "olmo2-dolma2", "falcon-7b"));

TEST(PublishedGpt2, EncoderPairMatchesHf) {
  const std::string dir = test::published_tokenizers_dir();
  if (dir.empty()) GTEST_SKIP() << "no ../shared/data/tokenizers next to the checkout";
  const std::string reason = test::oracle_unavailable();
  if (!reason.empty()) GTEST_SKIP() << reason;
  const std::string vocab = dir + "/gpt2/vocab.json", merges = dir + "/gpt2/merges.txt";
  if (!path_exists(vocab) || !path_exists(merges)) GTEST_SKIP() << "GPT-2 files absent";
  const Tokenizer tok = Tokenizer::load_gpt2(vocab, merges);
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 50256);
  const auto texts = test::varied_texts({"<|endoftext|>"});
  expect_same_as_oracle(tok, texts, test::oracle_encode(vocab, texts, merges), "gpt2");
}

}  // namespace
}  // namespace lt2
