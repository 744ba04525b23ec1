// The BPE model of a byte-level tokenizer: vocabulary, ranked merges, and the merge loop that
// turns one pre-tokenized word (raw bytes) into ids. Words are cached: natural text repeats a
// small set of words, so most lookups skip the merge loop.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lt2 {

struct BpeOptions {
  std::optional<std::string> unk_token;  // token for bytes missing from the vocabulary
  bool byte_fallback = false;            // a missing byte becomes the token "<0xHH>" if present
  bool ignore_merges = false;            // a word that is itself a token skips the merge loop
};

class BpeModel {
 public:
  // `vocab[i]` is the token of id i in HF's text form (byte-level characters; may be empty for an
  // id with no token). `merges` are pairs of tokens in priority order. Throws lt2::Error when a
  // merge names a token that is missing, or its result is missing.
  BpeModel(std::vector<std::string> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);

  // Appends the ids of one word (raw bytes) to `out`. Thread-safe.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  int32_t size() const { return static_cast<int32_t>(id_to_token_.size()); }
  std::optional<int32_t> token_to_id(const std::string& token) const;
  // The token of an id in text form; empty for an unused id.
  const std::string& id_to_token(int32_t id) const { return id_to_token_[id]; }
  const BpeOptions& options() const { return options_; }
  // The merges as id pairs in priority order (rank 0 first).
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merges_; }

 private:
  struct Merge {
    uint32_t rank;
    int32_t result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void merge_symbols(std::vector<int32_t>& symbols) const;

  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  // Tokens as raw bytes (only those made of byte-level characters), for ignore_merges.
  std::unordered_map<std::string, int32_t> bytes_to_id_;
  std::array<int32_t, 256> byte_id_{};  // -1: the byte has no token
  std::unordered_map<uint64_t, Merge> merge_of_pair_;
  std::vector<std::pair<int32_t, int32_t>> merges_;
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
  std::array<int32_t, 256> fallback_id_{};  // "<0xHH>" tokens for byte_fallback, -1 if absent

  // Word cache: a direct-mapped table (a word's hash picks its slot; a new word evicts the old
  // one), split into shards with their own lock so that threads rarely contend.
  struct CacheSlot {
    uint64_t hash = 0;
    std::string word;
    std::vector<int32_t> ids;
  };
  struct CacheShard {
    std::mutex mutex;
    std::vector<CacheSlot> slots;
  };
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheSlotsPerShard = 1 << 13;  // a power of two
  static constexpr size_t kCacheMaxWordBytes = 64;         // longer words are not cached
  std::unique_ptr<std::array<CacheShard, kCacheShards>> cache_;
};

}  // namespace lt2
