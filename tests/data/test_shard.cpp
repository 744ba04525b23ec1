// Token shards: round trips in both widths, and clear errors for damaged files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "common/expect_error.h"
#include "lt2/data/shard.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2 {
namespace {

namespace fs = std::filesystem;
using lt2::testing::expect_error_containing;

class Shard : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("lt2-shard-" + std::to_string(::getpid()))).string();
    make_dirs(dir_);
  }
  void TearDown() override { lt2::remove_tree(dir_); }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(Shard, RoundTripsBothWidths) {
  std::mt19937 rng(1);
  for (int64_t vocab : {int64_t{256}, int64_t{65536}, int64_t{65537}, int64_t{200000}}) {
    std::vector<int32_t> ids(100000);
    for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
    ids[0] = static_cast<int32_t>(vocab - 1);
    const std::string path = file("s" + std::to_string(vocab) + ".bin");
    {
      ShardWriter w(path, vocab);
      EXPECT_EQ(w.token_bytes(), vocab <= 65536 ? 2u : 4u);
      w.write(ids.data(), 1000);
      w.write(std::vector<int32_t>(ids.begin() + 1000, ids.end()));
      EXPECT_FALSE(path_exists(path));  // not visible before close
      w.close();
    }
    EXPECT_EQ(fs::file_size(path), 32 + ids.size() * (vocab <= 65536 ? 2 : 4));
    const ShardReader r(path);
    EXPECT_EQ(r.size(), static_cast<int64_t>(ids.size()));
    EXPECT_EQ(r.vocab_size(), vocab);
    std::vector<int64_t> back(ids.size());
    r.read(0, r.size(), back.data());
    for (size_t i = 0; i < ids.size(); ++i) ASSERT_EQ(back[i], ids[i]) << i;
    int64_t few[3];
    r.read(500, 3, few);
    EXPECT_EQ(few[2], ids[502]);
    EXPECT_EQ(r.at(99999), ids[99999]);
    expect_error_containing([&] { r.read(99999, 2, few); }, "cannot read tokens [99999, 100001) of 100000");
    expect_error_containing([&] { r.read(-1, 1, few); }, "cannot read");
  }
}

TEST_F(Shard, HeaderLayoutIsLittleEndian) {
  {
    ShardWriter w(file("h.bin"), 1000);
    w.write({1, 2, 999});
    w.close();
  }
  const std::string bytes = read_file(file("h.bin"));
  ASSERT_EQ(bytes.size(), 32u + 6u);
  EXPECT_EQ(bytes.substr(0, 8), "LT2SHARD");
  auto u32 = [&](size_t at) { uint32_t v; std::memcpy(&v, bytes.data() + at, 4); return v; };
  auto u64 = [&](size_t at) { uint64_t v; std::memcpy(&v, bytes.data() + at, 8); return v; };
  EXPECT_EQ(u32(8), 1u);
  EXPECT_EQ(u32(12), 2u);
  EXPECT_EQ(u64(16), 3u);
  EXPECT_EQ(u64(24), 1000u);
  EXPECT_EQ(static_cast<unsigned char>(bytes[36]), 999 & 0xFF);
  EXPECT_EQ(static_cast<unsigned char>(bytes[37]), 999 >> 8);
}

TEST_F(Shard, WriterRejectsBadIdsAndLeavesNothingBehind) {
  {
    ShardWriter w(file("bad.bin"), 100);
    expect_error_containing([&] { w.write({5, 100}); }, "token id 100 is outside the vocabulary [0, 100)");
    expect_error_containing([&] { w.write({-1}); }, "token id -1");
  }  // destroyed without close()
  EXPECT_TRUE(fs::is_empty(dir_)) << "a temporary file was left behind";
  expect_error_containing([&] { ShardWriter(file("x.bin"), 0); }, "vocabulary size");
  expect_error_containing([&] { ShardWriter("/nonexistent-folder/x.bin", 10); }, "cannot create");
}

TEST_F(Shard, ReaderNamesTheProblem) {
  {
    ShardWriter w(file("good.bin"), 70000);
    w.write(std::vector<int32_t>(10, 69999));
    w.close();
  }
  const std::string good = read_file(file("good.bin"));
  auto damaged = [&](const std::string& name, std::string bytes) {
    write_file_atomic(file(name), bytes);
    return file(name);
  };
  expect_error_containing([&] { ShardReader r(file("missing.bin")); }, "cannot open");
  expect_error_containing([&] { ShardReader r(damaged("short.bin", good.substr(0, 20))); },
                          "shorter than the 32-byte header");
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  expect_error_containing([&] { ShardReader r(damaged("magic.bin", bad_magic)); }, "magic 'LT2SHARD'");
  std::string bad_version = good;
  bad_version[8] = 7;
  expect_error_containing([&] { ShardReader r(damaged("version.bin", bad_version)); }, "format version 7, expected 1");
  std::string bad_width = good;
  bad_width[12] = 3;
  expect_error_containing([&] { ShardReader r(damaged("width.bin", bad_width)); }, "3 bytes per token, expected 2 or 4");
  expect_error_containing([&] { ShardReader r(damaged("truncated.bin", good.substr(0, good.size() - 1))); },
                          "should be 32 + 10 x 4 bytes");
  expect_error_containing([&] { ShardReader r(damaged("long.bin", good + "x")); }, "but the file is 73 bytes");
  std::string narrow = good;
  narrow[12] = 2;  // uint16 tokens with a 70000-token vocabulary
  expect_error_containing([&] { ShardReader r(damaged("narrow.bin", narrow)); }, "stores uint16 tokens");
  std::string zero_vocab = good;
  std::memset(&zero_vocab[24], 0, 8);
  expect_error_containing([&] { ShardReader r(damaged("vocab.bin", zero_vocab)); }, "vocabulary size 0");
  // Hostile headers: a count of 2^60 tokens, or 2^63 (count x width overflows), in a small file.
  for (const uint64_t count : {uint64_t{1} << 60, uint64_t{1} << 63}) {
    std::string huge = good;
    std::memcpy(&huge[16], &count, 8);
    expect_error_containing([&] { ShardReader r(damaged("huge.bin", huge)); }, "but the file is 72 bytes");
  }
  // The body: a token at or above the header's vocabulary is refused where it is read.
  std::string bad_token = good;
  const uint32_t outside = 70000;
  std::memcpy(&bad_token[32 + 4 * 3], &outside, 4);
  const ShardReader r(damaged("token.bin", bad_token));
  int64_t few[4];
  r.read(0, 3, few);
  EXPECT_EQ(few[2], 69999);
  expect_error_containing([&] { r.read(2, 2, few); }, "token 3 is 70000, outside the vocabulary [0, 70000)");
}

TEST_F(Shard, EmptyShard) {
  {
    ShardWriter w(file("empty.bin"), 10);
    w.close();
  }
  const ShardReader r(file("empty.bin"));
  EXPECT_EQ(r.size(), 0);
  r.read(0, 0, nullptr);
}

}  // namespace
}  // namespace lt2
