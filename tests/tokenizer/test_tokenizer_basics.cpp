// Byte round trips, invalid UTF-8, the byte-level tokenizer, NFC, chat template, save/load, and
// the errors a user can cause.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <thread>
#include <random>

#include "common/expect_error.h"
#include "lt2/tokenizer/byte_level.h"
#include "lt2/tokenizer/normalizer.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/tokenizer/trainer.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"
#include "oracle.h"

namespace lt2 {
namespace {

using lt2::testing::expect_error_containing;

std::string random_bytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

// Random byte strings biased towards UTF-8 structure: lead bytes, continuations, ASCII.
std::vector<std::string> byte_samples() {
  std::mt19937 rng(7);
  std::vector<std::string> out = {std::string("\xff"), std::string("\xc3"), std::string("\xe2\x82"),
                                  std::string("a\xf0\x9f\x98"), std::string("\xed\xa0\x80"),
                                  std::string("\xc0\xaf"), std::string("\x00\x00", 2)};
  static const unsigned char pool[] = {'a', ' ', '\n', 0x80, 0xBF, 0xC2, 0xC3, 0xE0, 0xE2, 0xED,
                                       0xF0, 0xF4, 0xF5, 0xFF, 0x9F, 0xA0, 0x00};
  for (int i = 0; i < 200; ++i) {
    std::string s;
    const size_t n = rng() % 20;
    for (size_t k = 0; k < n; ++k) s.push_back(static_cast<char>(pool[rng() % sizeof(pool)]));
    out.push_back(s);
    out.push_back(random_bytes(rng, rng() % 64));
  }
  return out;
}

TEST(ByteLevelTokenizer, BytesAreIdsAndSpecialsFollow) {
  const Tokenizer tok = Tokenizer::byte_level({"<|endoftext|>", "<|pad|>"});
  EXPECT_EQ(tok.vocab_size(), 258);
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 256);
  EXPECT_EQ(tok.token_to_id("<|pad|>"), 257);
  const std::string text = "Hi \xff<|endoftext|>";
  const std::vector<int32_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), 5u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(ids[i], static_cast<unsigned char>(text[i]));
  EXPECT_EQ(ids[4], 256);
  EXPECT_EQ(tok.id_to_token(32), "Ġ");  // GPT-2's character for the space byte
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), "Hi \xef\xbf\xbd");
}

TEST(ByteLevelTokenizer, RoundTripsArbitraryBytes) {
  const Tokenizer tok = Tokenizer::byte_level({"<|endoftext|>"});
  for (const std::string& s : byte_samples()) {
    const auto ids = tok.encode(s);
    EXPECT_EQ(ids.size(), s.size());
    EXPECT_EQ(tok.decode_bytes(ids), s);
  }
}

TEST(ByteLevelTokenizer, InvalidUtf8DecodesLikeHf) {
  const std::string reason = test::oracle_unavailable();
  if (!reason.empty()) GTEST_SKIP() << reason;
  test::TempDir dir;
  const Tokenizer tok = Tokenizer::byte_level({"<|endoftext|>"});
  tok.save(dir.file("bytes.json"));
  std::vector<std::vector<int32_t>> id_lists;
  for (const std::string& s : byte_samples()) id_lists.push_back(tok.encode(s));
  write_file_atomic(dir.file("ids.json"), json(id_lists).dump());
  test::run_oracle({"decode", dir.file("bytes.json"), dir.file("ids.json"), dir.file("out.json")});
  const auto hf = load_json_file(dir.file("out.json")).get<std::vector<std::string>>();
  ASSERT_EQ(hf.size(), id_lists.size());
  for (size_t i = 0; i < hf.size(); ++i)
    EXPECT_EQ(tok.decode(id_lists[i]), hf[i]) << "ids " << json(id_lists[i]).dump();
}

// Published vocabularies trained on valid UTF-8 may lack some byte tokens (0xC0, 0xF5..0xFF, rare
// controls); HF drops such bytes, and so does lt2. Every other byte must come back.
TEST(Tokenizer, PublishedTokenizersRoundTripArbitraryBytes) {
  std::vector<std::string> paths;
  const std::string dir = test::published_tokenizers_dir();
  for (const char* name : {"smollm2-135m-instruct", "olmo2-dolma2", "falcon-7b", "phi-2"})
    if (!dir.empty() && path_exists(dir + "/" + name + "/tokenizer.json"))
      paths.push_back(dir + "/" + name + "/tokenizer.json");
  if (paths.empty()) GTEST_SKIP() << "no published tokenizers next to the checkout";
  const auto samples = byte_samples();
  for (const std::string& path : paths) {
    const Tokenizer tok = Tokenizer::load(path);
    std::array<bool, 256> covered{};
    for (int b = 0; b < 256; ++b)
      covered[b] = tok.token_to_id(byte_level::encode(std::string(1, static_cast<char>(b)))).has_value();
    for (const std::string& s : samples) {
      std::string expected;
      for (char c : s)
        if (covered[static_cast<unsigned char>(c)]) expected.push_back(c);
      EXPECT_EQ(tok.decode_bytes(tok.encode(s)), expected) << path;
    }
  }
}

TEST(Tokenizer, EncodesConcurrently) {
  // Threads share the word cache; results must not depend on who filled it.
  const auto texts = test::varied_texts({"<|endoftext|>"});
  BpeTrainerOptions options;
  options.vocab_size = 600;
  const Tokenizer tok = train_bpe(texts, options);
  std::vector<std::vector<int32_t>> expected;
  for (const std::string& t : texts) expected.push_back(tok.encode(t));
  std::vector<std::thread> pool;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t)
    pool.emplace_back([&] {
      for (int round = 0; round < 5; ++round)
        for (size_t i = 0; i < texts.size(); ++i)
          if (tok.encode(texts[i]) != expected[i]) ++mismatches;
    });
  for (auto& th : pool) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(Nfc, MatchesHfNormalizer) {
  const std::string reason = test::oracle_unavailable();
  if (!reason.empty()) GTEST_SKIP() << reason;
  // Bases, combining marks of several classes, Hangul jamo and syllables, singletons and
  // composition exclusions, in random order.
  static const char* const pool[] = {
      "a", "e", "A", "o", "u", "\u0300", "\u0301", "\u0308", "\u0304", "\u0323", "\u0327", "\u031b",
      "\u0345", "\u05b0", "\u0591", "\u1100", "\u1161", "\u11a8", "\uac00", "\u212b", "\u2126",
      "\u0958", "\u0915", "\u093c", "\u0f73", "\u1e9b", "\u00c5", "\u01d5", " ", "\u3099", "\u304b"};
  std::mt19937 rng(3);
  std::vector<std::string> texts;
  for (int i = 0; i < 500; ++i) {
    std::string s;
    for (size_t n = rng() % 8; n > 0; --n) s += pool[rng() % (sizeof(pool) / sizeof(*pool))];
    texts.push_back(s);
  }
  test::TempDir dir;
  write_file_atomic(dir.file("texts.json"), json(texts).dump());
  test::run_oracle({"nfc", dir.file("texts.json"), dir.file("out.json")});
  const auto hf = load_json_file(dir.file("out.json")).get<std::vector<std::string>>();
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(nfc(texts[i]), hf[i]) << json(texts[i]).dump();
  // Bytes that are not UTF-8 pass through.
  EXPECT_EQ(nfc("e\xff\xcc\x81"), "e\xff\xcc\x81");
}

TEST(Tokenizer, ChatMlTemplate) {
  const Tokenizer tok = Tokenizer::byte_level({"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  const std::string s = tok.apply_chat_template({{"system", "Be brief."}, {"user", "Hi"}}, true);
  EXPECT_EQ(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  const auto ids = tok.encode(s);
  EXPECT_EQ(ids.front(), *tok.token_to_id("<|im_start|>"));
  expect_error_containing([] { Tokenizer::byte_level({"<|endoftext|>"}).apply_chat_template({{"user", "x"}}); },
                          "<|im_start|>");
}

TEST(Tokenizer, SaveAndLoadKeepEverything) {
  test::TempDir dir;
  const Tokenizer tok = Tokenizer::byte_level({"<|endoftext|>"});
  tok.save(dir.file("t.json"));
  const Tokenizer again = Tokenizer::load(dir.file("t.json"));
  EXPECT_EQ(again.vocab_size(), tok.vocab_size());
  EXPECT_EQ(again.to_json_text(), tok.to_json_text());
  for (int32_t id = 0; id < tok.vocab_size(); ++id) EXPECT_EQ(again.id_to_token(id), tok.id_to_token(id));
  EXPECT_FALSE(tok.id_to_token(-1));
  EXPECT_FALSE(tok.id_to_token(tok.vocab_size()));
}

// A valid minimal tokenizer.json, to break one field at a time.
json minimal_doc() {
  return json::parse(R"({
    "added_tokens": [{"id": 3, "content": "<s>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
  })");
}

TEST(TokenizerErrors, MinimalDocumentLoads) {
  const Tokenizer tok = Tokenizer::from_json(minimal_doc(), "minimal");
  EXPECT_EQ(tok.encode("ab<s>"), (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(tok.vocab_size(), 4);
}

TEST(TokenizerErrors, ClearMessages) {
  expect_error_containing([] { Tokenizer::load("/nonexistent/tokenizer.json"); }, "does not exist");
  test::TempDir dir;
  write_file_atomic(dir.file("bad.json"), "{\"model\": ");
  expect_error_containing([&] { Tokenizer::load(dir.file("bad.json")); }, dir.file("bad.json"));

  auto with = [](const std::function<void(json&)>& change) {
    json d = minimal_doc();
    change(d);
    return d;
  };
  auto fails = [](const json& d, const std::string& needle) {
    expect_error_containing([&] { Tokenizer::from_json(d, "t.json"); }, needle);
  };
  fails(json::array(), "expected a JSON object");
  fails(with([](json& d) { d.erase("model"); }), "no 'model' object");
  fails(with([](json& d) { d["model"]["type"] = "WordPiece"; }), "unsupported model type 'WordPiece'");
  fails(with([](json& d) { d["model"]["type"] = "Unigram"; }), "unsupported model type 'Unigram'");
  fails(with([](json& d) { d["model"]["merges"] = {"a c"}; }), "not in the vocabulary");
  fails(with([](json& d) { d["model"]["merges"] = {"b a"}; }), "result 'ba' of merge 0");
  fails(with([](json& d) { d["model"]["merges"] = {"abc"}; }), "not two tokens");
  fails(with([](json& d) { d["model"]["merges"] = {json::array({"a"})}; }), "must be");
  fails(with([](json& d) { d["model"]["vocab"]["c"] = 0; }), "id 0 is used by both");
  fails(with([](json& d) { d["model"]["vocab"]["c"] = -4; }), "'c' has id -4 (expected an integer in [0, 16777216))");
  // Hostile ids: a table of 2^30 ids would be allocated for one token; an id of 2^40 would wrap.
  fails(with([](json& d) { d["model"]["vocab"]["c"] = int64_t{1} << 30; }), "'c' has id 1073741824 (expected");
  fails(with([](json& d) { d["added_tokens"][0]["id"] = int64_t{1} << 40; }), "added_tokens[0]: expected {\"id\": integer in [0, 16777216)");
  fails(with([](json& d) { d["added_tokens"][0]["id"] = 2.5; }), "added_tokens[0]: expected {\"id\": integer");
  fails(with([](json& d) { d["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", 3}}, {"sep", {"x", 9}}}; }),
        "post_processor adds id 9, which is not a token of the vocabulary (4 ids)");
  fails(with([](json& d) { d["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", 3.5}}, {"sep", {"x", 2}}}; }),
        "'cls' id must be an integer, found number 3.5");
  fails(with([](json& d) { d["model"]["dropout"] = 0.1; }), "dropout");
  fails(with([](json& d) { d["model"]["continuing_subword_prefix"] = "##"; }), "continuing_subword_prefix");
  fails(with([](json& d) { d["normalizer"] = {{"type", "Lowercase"}}; }), "unsupported normalizer type 'Lowercase'");
  fails(with([](json& d) { d["pre_tokenizer"] = {{"type", "Whitespace"}}; }), "unsupported pre-tokenizer type 'Whitespace'");
  fails(with([](json& d) { d["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "("}}}, {"behavior", "Isolated"}}; }),
        "cannot compile");
  fails(with([](json& d) { d["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}}; }),
        "unknown split behavior 'Sideways'");
  fails(with([](json& d) { d["pre_tokenizer"] = nullptr; }), "not a byte-level BPE");
  fails(with([](json& d) { d["decoder"] = {{"type", "WordPiece"}}; }), "unsupported decoder");
  fails(with([](json& d) { d["post_processor"] = {{"type", "Fancy"}}; }), "unsupported post-processor type 'Fancy'");
  fails(with([](json& d) { d["added_tokens"] = {{{"content", "x"}}}; }), "added_tokens[0]");
  fails(with([](json& d) { d["added_tokens"][0]["special"] = "yes"; }), "'special' must be true or false, found string");
  fails(with([](json& d) {
          d["post_processor"] = {{"type", "TemplateProcessing"},
                                 {"single", {{{"SpecialToken", {{"id", "<s>"}}}}}},
                                 {"special_tokens", {{"<s>", {{"ids", "three"}}}}}};
        }),
        "special_tokens '<s>' ids must be an array, found string \"three\"");
  expect_error_containing([] { Tokenizer::load_gpt2("/nonexistent/encoder.json", "/nonexistent/vocab.bpe"); },
                          "does not exist");
}

TEST(TokenizerErrors, PostProcessorsAddTheirTokens) {
  json d = minimal_doc();
  d["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", 3}}, {"sep", {"ab", 2}}};
  const Tokenizer tok = Tokenizer::from_json(d, "roberta");
  EXPECT_EQ(tok.encode("a", true), (std::vector<int32_t>{3, 0, 2}));
  EXPECT_EQ(tok.encode("a", false), (std::vector<int32_t>{0}));
}

}  // namespace
}  // namespace lt2
