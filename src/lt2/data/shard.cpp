#include "lt2/data/shard.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "lt2/util/error.h"

namespace lt2 {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "shards are little-endian; this code copies tokens in host order");

namespace {

void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

constexpr size_t kWriteBufferBytes = 1 << 20;

}  // namespace

uint32_t shard_token_bytes(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

ShardWriter::ShardWriter(const std::string& path, int64_t vocab_size)
    : path_(path),
      tmp_path_(temporary_path(path)),
      vocab_size_(vocab_size),
      token_bytes_(shard_token_bytes(vocab_size)) {
  LT2_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32), "shard '", path,
            "': vocabulary size must be in [1, 2^32], got ", vocab_size);
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  LT2_CHECK(file_, "cannot create '", tmp_path_, "': ", std::strerror(errno));
  // A zeroed header keeps the file unreadable as a shard until close() fills it in.
  const uint8_t placeholder[kShardHeaderBytes] = {};
  if (std::fwrite(placeholder, 1, sizeof(placeholder), file_) != sizeof(placeholder)) {
    std::fclose(file_);
    ::unlink(tmp_path_.c_str());
    throw Error(cat("write to '", tmp_path_, "' failed: ", std::strerror(errno)));
  }
  buffer_.reserve(kWriteBufferBytes);
}

ShardWriter::~ShardWriter() {
  if (file_) {
    std::fclose(file_);
    ::unlink(tmp_path_.c_str());
  }
}

void ShardWriter::write(const int32_t* ids, size_t n) {
  LT2_CHECK(file_, "shard '", path_, "': write after close");
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    LT2_CHECK(id >= 0 && id < vocab_size_, "shard '", path_, "': token id ", id,
              " is outside the vocabulary [0, ", vocab_size_, ")");
    if (token_bytes_ == 2) {
      const uint16_t v = static_cast<uint16_t>(id);
      const auto* p = reinterpret_cast<const uint8_t*>(&v);
      buffer_.insert(buffer_.end(), p, p + 2);
    } else {
      const uint32_t v = static_cast<uint32_t>(id);
      const auto* p = reinterpret_cast<const uint8_t*>(&v);
      buffer_.insert(buffer_.end(), p, p + 4);
    }
    if (buffer_.size() >= kWriteBufferBytes) flush_buffer();
  }
  count_ += static_cast<int64_t>(n);
}

void ShardWriter::flush_buffer() {
  if (buffer_.empty()) return;
  LT2_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), file_) == buffer_.size(), "write to '",
            tmp_path_, "' failed (disk full?): ", std::strerror(errno));
  buffer_.clear();
}

void ShardWriter::close() {
  LT2_CHECK(file_, "shard '", path_, "': closed twice");
  flush_buffer();
  uint8_t header[kShardHeaderBytes];
  std::memcpy(header, kShardMagic, 8);
  put_u32(header + 8, kShardVersion);
  put_u32(header + 12, token_bytes_);
  put_u64(header + 16, static_cast<uint64_t>(count_));
  put_u64(header + 24, static_cast<uint64_t>(vocab_size_));
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 &&
                  std::fwrite(header, 1, sizeof(header), file_) == sizeof(header) &&
                  std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const int err = errno;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!ok || !closed) {
    ::unlink(tmp_path_.c_str());
    throw Error(cat("write to '", tmp_path_, "' failed (disk full?): ", std::strerror(err)));
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int rename_err = errno;
    ::unlink(tmp_path_.c_str());
    throw Error(cat("cannot rename '", tmp_path_, "' to '", path_, "': ", std::strerror(rename_err)));
  }
}

ShardReader::ShardReader(const std::string& path) : file_(path) {
  const uint64_t size = file_.size();
  const uint8_t* p = file_.data();
  LT2_CHECK(size >= kShardHeaderBytes, "shard '", path, "' is ", size,
            " bytes, shorter than the ", kShardHeaderBytes, "-byte header (not a shard, or truncated)");
  LT2_CHECK(std::memcmp(p, kShardMagic, 8) == 0, "shard '", path,
            "' does not start with the magic 'LT2SHARD' (not an lt2 token shard, or unfinished)");
  const uint32_t version = get_u32(p + 8);
  LT2_CHECK(version == kShardVersion, "shard '", path, "' has format version ", version,
            ", expected ", kShardVersion);
  token_bytes_ = get_u32(p + 12);
  LT2_CHECK(token_bytes_ == 2 || token_bytes_ == 4, "shard '", path, "' says ", token_bytes_,
            " bytes per token, expected 2 or 4");
  const uint64_t count = get_u64(p + 16);
  const uint64_t vocab = get_u64(p + 24);
  LT2_CHECK(vocab > 0 && vocab <= (uint64_t{1} << 32), "shard '", path, "' has vocabulary size ",
            vocab, ", expected 1 to 2^32");
  LT2_CHECK(token_bytes_ == 4 || vocab <= 65536, "shard '", path, "' stores uint16 tokens but has "
            "vocabulary size ", vocab, " (> 65536)");
  LT2_CHECK(count <= (size - kShardHeaderBytes) / token_bytes_ &&
                size == kShardHeaderBytes + count * token_bytes_,
            "shard '", path, "' should be ", kShardHeaderBytes, " + ", count, " x ", token_bytes_,
            " bytes for its ", count, " tokens, but the file is ", size, " bytes (truncated or corrupt)");
  count_ = static_cast<int64_t>(count);
  vocab_size_ = static_cast<int64_t>(vocab);
  tokens_ = p + kShardHeaderBytes;
}

void ShardReader::read(int64_t begin, int64_t n, int64_t* out) const {
  LT2_CHECK(begin >= 0 && n >= 0 && begin <= count_ && n <= count_ - begin, "shard '", path(),
            "': cannot read tokens [", begin, ", ", begin + n, ") of ", count_);
  const uint8_t* src = tokens_ + begin * token_bytes_;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t v = 0;
    std::memcpy(&v, src + i * token_bytes_, token_bytes_);  // little-endian: the low bytes
    out[i] = v;
  }
  // The body is checked where it is read: a corrupt token would index past the embedding.
  for (int64_t i = 0; i < n; ++i)
    LT2_CHECK(out[i] < vocab_size_, "shard '", path(), "': token ", begin + i, " is ", out[i],
              ", outside the vocabulary [0, ", vocab_size_, ") of its header (corrupt shard)");
}

int64_t ShardReader::at(int64_t i) const {
  int64_t v;
  read(i, 1, &v);
  return v;
}

}  // namespace lt2
