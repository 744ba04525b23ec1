// Token shards: one flat file of token ids, the training data format.
//
// Layout (little-endian):
//   offset 0   8 bytes  magic "LT2SHARD"
//   offset 8   u32      version = 1
//   offset 12  u32      bytes per token: 2 (uint16) or 4 (uint32)
//   offset 16  u64      number of tokens
//   offset 24  u64      vocabulary size (every token is below it)
//   offset 32  the tokens
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "lt2/util/fs.h"

namespace lt2 {

inline constexpr char kShardMagic[8] = {'L', 'T', '2', 'S', 'H', 'A', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 32;

// Bytes per token a shard of this vocabulary uses: 2 when every id fits in uint16, else 4.
uint32_t shard_token_bytes(int64_t vocab_size);

// Streams tokens into a shard. The file appears under its name only when close() succeeds (it is
// written to a temporary name in the same folder, then renamed); a writer destroyed without
// close() (e.g. by an exception) removes its temporary file and leaves no shard behind.
class ShardWriter {
 public:
  ShardWriter(const std::string& path, int64_t vocab_size);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Throws lt2::Error for an id outside [0, vocab_size).
  void write(const int32_t* ids, size_t n);
  void write(const std::vector<int32_t>& ids) { write(ids.data(), ids.size()); }
  // Writes the header, flushes to disk and renames onto the final path.
  void close();

  int64_t size() const { return count_; }
  uint32_t token_bytes() const { return token_bytes_; }
  const std::string& path() const { return path_; }

 private:
  void flush_buffer();
  std::string path_, tmp_path_;
  std::FILE* file_ = nullptr;
  int64_t vocab_size_;
  uint32_t token_bytes_;
  int64_t count_ = 0;
  std::vector<uint8_t> buffer_;
};

// Reads a shard through a memory map. The constructor validates the header against the file and
// throws lt2::Error naming the file and what was expected.
class ShardReader {
 public:
  explicit ShardReader(const std::string& path);

  int64_t size() const { return count_; }
  int64_t vocab_size() const { return vocab_size_; }
  uint32_t token_bytes() const { return token_bytes_; }
  const std::string& path() const { return file_.path(); }

  // Copies tokens [begin, begin + n) into out. Throws lt2::Error when the range is outside the
  // shard.
  void read(int64_t begin, int64_t n, int64_t* out) const;
  int64_t at(int64_t i) const;

 private:
  MappedFile file_;
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  uint32_t token_bytes_ = 0;
  const uint8_t* tokens_ = nullptr;
};

}  // namespace lt2
