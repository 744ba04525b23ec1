// Corpus reading and `data prepare`: documents from text/JSONL/folders, the deterministic
// train/val split, separators, the summary, and errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "common/expect_error.h"
#include "lt2/data/corpus.h"
#include "lt2/data/prepare.h"
#include "lt2/data/shard.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2 {
namespace {

namespace fs = std::filesystem;
using lt2::testing::expect_error_containing;

class Prepare : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("lt2-prepare-" + std::to_string(::getpid()))).string();
    make_dirs(dir_ + "/corpus/sub");
    // 3 paragraphs (blank lines of several kinds between them), then 4 JSONL documents and 1
    // from a JSON array; notes.md is not a corpus file and is skipped.
    write_file_atomic(dir_ + "/corpus/a.txt",
                      "First paragraph,\nstill first.\n\n\n  \nSecond \xe2\x80\x94 para.\r\n\r\nThird.\n");
    write_file_atomic(dir_ + "/corpus/sub/b.jsonl",
                      "{\"text\": \"doc four\", \"id\": 1}\n\n{\"text\": \"doc five <|endoftext|> inside\"}\n"
                      "{\"text\": \"doc six\\nline two\"}\n{\"text\": \"doc seven\"}\n");
    write_file_atomic(dir_ + "/corpus/sub/c.json", "[{\"text\": \"doc eight\"}]");
    write_file_atomic(dir_ + "/corpus/notes.md", "not read");
    Tokenizer::byte_level({"<|endoftext|>", "<|pad|>"}).save(dir_ + "/tokenizer.json");
  }
  void TearDown() override { lt2::remove_tree(dir_); }
  std::vector<std::string> documents(const std::vector<std::string>& inputs, TextSplit split = TextSplit::Paragraph) {
    std::vector<std::string> docs;
    Corpus(inputs, split).for_each([&](std::string_view d, int64_t) { docs.emplace_back(d); });
    return docs;
  }
  std::string dir_;
};

TEST_F(Prepare, CorpusFindsDocumentsInOrder) {
  const auto docs = documents({dir_ + "/corpus"});
  const std::vector<std::string> expected = {
      "First paragraph,\nstill first.", "Second \xe2\x80\x94 para.", "Third.", "doc four",
      "doc five <|endoftext|> inside", "doc six\nline two", "doc seven", "doc eight"};
  EXPECT_EQ(docs, expected);
  EXPECT_EQ(documents({dir_ + "/corpus/a.txt"}, TextSplit::File).size(), 1u);
  EXPECT_EQ(documents({dir_ + "/corpus/a.txt"}, TextSplit::Line).size(), 5u);
  // A file given by name is read whatever its extension.
  EXPECT_EQ(documents({dir_ + "/corpus/notes.md"}), std::vector<std::string>{"not read"});
}

TEST_F(Prepare, WritesShardsWithSeparatorsAndAHeldOutSplit) {
  PrepareOptions o;
  o.inputs = {dir_ + "/corpus"};
  o.tokenizer_path = dir_ + "/tokenizer.json";
  o.out_dir = dir_ + "/out";
  o.val_fraction = 0.25;  // documents 3 and 7 (counting from 0) are held out
  o.progress = false;
  const PrepareSummary s = prepare_data(o);
  const auto docs = documents({dir_ + "/corpus"});
  EXPECT_EQ(s.train.documents, 6);
  EXPECT_EQ(s.val.documents, 2);

  const Tokenizer tok = Tokenizer::load(dir_ + "/out/tokenizer.json");
  auto text_of = [&](const std::string& shard) {
    const ShardReader r(shard);
    EXPECT_EQ(r.vocab_size(), 258);
    EXPECT_EQ(r.token_bytes(), 2u);
    std::vector<int64_t> ids64(r.size());
    r.read(0, r.size(), ids64.data());
    return tok.decode_bytes(std::vector<int32_t>(ids64.begin(), ids64.end()));
  };
  std::string train_expected, val_expected;
  for (size_t i = 0; i < docs.size(); ++i)
    ((i == 3 || i == 7) ? val_expected : train_expected) += docs[i] + "<|endoftext|>";
  EXPECT_EQ(text_of(dir_ + "/out/train.bin"), train_expected);
  EXPECT_EQ(text_of(dir_ + "/out/val.bin"), val_expected);
  // The separator is the special token, also where a document's text contains its spelling.
  const ShardReader val(dir_ + "/out/val.bin");
  EXPECT_EQ(val.at(val.size() - 1), 256);

  EXPECT_EQ(read_file(dir_ + "/out/tokenizer.json"), read_file(dir_ + "/tokenizer.json"));
  const json summary = load_json_file(dir_ + "/out/summary.json");
  EXPECT_EQ(summary["train"]["documents"], 6);
  EXPECT_EQ(summary["val"]["documents"], 2);
  EXPECT_EQ(summary["train"]["tokens"], ShardReader(dir_ + "/out/train.bin").size());
  EXPECT_EQ(summary["total"]["bytes"], s.train.bytes + s.val.bytes);
  EXPECT_GT(summary["train"]["bytes_per_token"].get<double>(), 0.5);

  // Running again gives the same files.
  const std::string train_before = read_file(dir_ + "/out/train.bin");
  o.threads = 1;
  prepare_data(o);
  EXPECT_EQ(read_file(dir_ + "/out/train.bin"), train_before);
}

TEST_F(Prepare, NoSeparatorAndNoValidation) {
  PrepareOptions o;
  o.inputs = {dir_ + "/corpus/sub/b.jsonl"};
  o.tokenizer_path = dir_ + "/tokenizer.json";
  o.out_dir = dir_ + "/plain";
  o.val_fraction = 0;
  o.separator = "";
  o.progress = false;
  const PrepareSummary s = prepare_data(o);
  EXPECT_EQ(s.val.documents, 0);
  EXPECT_EQ(s.train.tokens, s.train.bytes - 12);  // the special token in doc five is one token
  EXPECT_EQ(ShardReader(dir_ + "/plain/val.bin").size(), 0);
}

TEST_F(Prepare, ClearErrors) {
  PrepareOptions o;
  o.inputs = {dir_ + "/corpus"};
  o.tokenizer_path = dir_ + "/tokenizer.json";
  o.out_dir = dir_ + "/err";
  o.progress = false;
  o.separator = "<|nope|>";
  expect_error_containing([&] { prepare_data(o); }, "separator '<|nope|>' is not a token");
  o.separator = "<|endoftext|>";
  o.val_fraction = 1.0;
  expect_error_containing([&] { prepare_data(o); }, "--val-fraction must be in [0, 1)");
  o.val_fraction = 0.1;
  o.inputs = {dir_ + "/missing"};
  expect_error_containing([&] { prepare_data(o); }, "input '" + dir_ + "/missing' does not exist");
  write_file_atomic(dir_ + "/broken.jsonl", "{\"text\": \"ok\"}\n{\"txt\": \"no\"}\n");
  o.inputs = {dir_ + "/broken.jsonl"};
  expect_error_containing([&] { prepare_data(o); }, "broken.jsonl:2: expected a JSON object with a string field \"text\"");
  write_file_atomic(dir_ + "/broken2.jsonl", "{\"text\": \"ok\"\n");
  o.inputs = {dir_ + "/broken2.jsonl"};
  expect_error_containing([&] { prepare_data(o); }, "broken2.jsonl:1");
  make_dirs(dir_ + "/emptydir");
  o.inputs = {dir_ + "/emptydir"};
  expect_error_containing([&] { prepare_data(o); }, "has no *.txt, *.jsonl or *.json files");
  o.inputs = {dir_ + "/corpus"};
  o.tokenizer_path = dir_ + "/nope.json";
  expect_error_containing([&] { prepare_data(o); }, "does not exist");
  EXPECT_THROW(parse_text_split("sentence"), Error);
}

}  // namespace
}  // namespace lt2
