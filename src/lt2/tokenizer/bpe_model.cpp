#include "lt2/tokenizer/bpe_model.h"

#include <functional>
#include <queue>

#include "lt2/tokenizer/byte_level.h"
#include "lt2/util/error.h"

namespace lt2 {

BpeModel::BpeModel(std::vector<std::string> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options)
    : id_to_token_(std::move(vocab)),
      options_(std::move(options)),
      cache_(std::make_unique<std::array<CacheShard, kCacheShards>>()) {
  for (CacheShard& shard : *cache_) shard.slots.resize(kCacheSlotsPerShard);
  token_to_id_.reserve(id_to_token_.size());
  for (size_t id = 0; id < id_to_token_.size(); ++id) {
    const std::string& token = id_to_token_[id];
    if (token.empty()) continue;
    token_to_id_.emplace(token, static_cast<int32_t>(id));
    if (auto bytes = byte_level::decode(token)) bytes_to_id_.emplace(*bytes, static_cast<int32_t>(id));
  }
  byte_id_.fill(-1);
  fallback_id_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    const auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    if (it != bytes_to_id_.end()) byte_id_[b] = it->second;
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    if (auto id = token_to_id(name)) fallback_id_[b] = *id;
  }
  if (options_.unk_token) {
    unk_id_ = token_to_id(*options_.unk_token);
    LT2_CHECK(unk_id_, "BPE model: unk_token '", *options_.unk_token, "' is not in the vocabulary");
  }

  merges_.reserve(merges.size());
  merge_of_pair_.reserve(merges.size() * 2);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const auto a = token_to_id(left), b = token_to_id(right), c = token_to_id(left + right);
    LT2_CHECK(a && b, "BPE model: merge ", rank, " ('", left, "' '", right,
              "') uses a token that is not in the vocabulary");
    LT2_CHECK(c, "BPE model: the result '", left + right, "' of merge ", rank,
              " is not in the vocabulary");
    merges_.emplace_back(*a, *b);
    // Like HF, a repeated merge takes the rank of its last occurrence.
    merge_of_pair_[pair_key(*a, *b)] = Merge{static_cast<uint32_t>(rank), *c};
  }
}

std::optional<int32_t> BpeModel::token_to_id(const std::string& token) const {
  const auto it = token_to_id_.find(token);
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

// Merges adjacent symbols in order of merge rank (leftmost first among equal ranks) until no
// adjacent pair has a merge, as HF's BPE does. Symbols form a linked list over their starting
// positions; a heap holds candidate merges, checked when popped because earlier merges may have
// consumed one of their symbols.
void BpeModel::merge_symbols(std::vector<int32_t>& symbols) const {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return;
  struct Candidate {
    uint32_t rank;
    int pos;  // position of the left symbol
    int32_t result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<int> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push_pair = [&](int left) {
    const int right = next[left];
    if (right < 0) return;
    const auto it = merge_of_pair_.find(pair_key(symbols[left], symbols[right]));
    if (it != merge_of_pair_.end()) heap.push({it->second.rank, left, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) push_pair(i);

  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    if (!alive[top.pos] || next[top.pos] < 0) continue;
    const int right = next[top.pos];
    // Stale when the pair at this position changed; HF tests the merge's result, so do we.
    const auto it = merge_of_pair_.find(pair_key(symbols[top.pos], symbols[right]));
    if (it == merge_of_pair_.end() || it->second.result != top.result) continue;
    symbols[top.pos] = top.result;
    alive[right] = false;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    if (prev[top.pos] >= 0) push_pair(prev[top.pos]);
    push_pair(top.pos);
  }
  int w = 0;
  for (int i = 0; i >= 0; i = next[i]) symbols[w++] = symbols[i];
  symbols.resize(w);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  const uint64_t hash = std::hash<std::string_view>{}(word);
  CacheShard& shard = (*cache_)[hash % kCacheShards];
  CacheSlot& slot = shard.slots[(hash / kCacheShards) % kCacheSlotsPerShard];
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (slot.hash == hash && slot.word == word) {
      out.insert(out.end(), slot.ids.begin(), slot.ids.end());
      return;
    }
  }

  const size_t first = out.size();
  if (options_.ignore_merges) {
    const auto it = bytes_to_id_.find(std::string(word));
    if (it != bytes_to_id_.end()) out.push_back(it->second);
  }
  if (out.size() == first) {
    thread_local std::vector<int32_t> symbols;
    symbols.clear();
    for (unsigned char b : word) {
      if (byte_id_[b] >= 0) {
        symbols.push_back(byte_id_[b]);
      } else if (options_.byte_fallback && fallback_id_[b] >= 0) {
        symbols.push_back(fallback_id_[b]);
      } else if (unk_id_) {
        symbols.push_back(*unk_id_);
      }
      // Without a token, an unk or a fallback the byte is dropped, as HF drops it.
    }
    merge_symbols(symbols);
    out.insert(out.end(), symbols.begin(), symbols.end());
  }
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mutex);
    slot.hash = hash;
    slot.word.assign(word);
    slot.ids.assign(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  }
}

}  // namespace lt2
