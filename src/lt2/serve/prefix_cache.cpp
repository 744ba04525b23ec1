#include "lt2/serve/prefix_cache.h"

#include <algorithm>

namespace lt2::serve {

PrefixCache::PrefixCache(int64_t device_bytes, int64_t host_bytes, torch::Device device)
    : device_bytes_(std::max<int64_t>(device_bytes, 0)), host_bytes_(std::max<int64_t>(host_bytes, 0)), device_(device) {}

uint64_t PrefixCache::hash_prefix(const std::vector<int64_t>& tokens, int64_t length) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the token ids
  for (int64_t i = 0; i < length; ++i) {
    h ^= static_cast<uint64_t>(tokens[i]);
    h *= 1099511628211ull;
  }
  return h;
}

PrefixCache::List::iterator PrefixCache::find(const std::vector<int64_t>& tokens, int64_t length, uint64_t hash) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (it->hash == hash && static_cast<int64_t>(it->tokens.size()) == length &&
        std::equal(it->tokens.begin(), it->tokens.end(), tokens.begin()))
      return it;
  return entries_.end();
}

bool PrefixCache::contains(const std::vector<int64_t>& tokens, int64_t length) const {
  const uint64_t h = hash_prefix(tokens, length);
  for (const auto& e : entries_)
    if (e.hash == h && static_cast<int64_t>(e.tokens.size()) == length &&
        std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin()))
      return true;
  return false;
}

int64_t PrefixCache::shared_length(const std::vector<int64_t>& tokens) const {
  int64_t best = 0;
  for (const auto& e : entries_) {
    const auto n = std::min(e.tokens.size(), tokens.size());
    if (static_cast<int64_t>(n) <= best) continue;
    best = std::max<int64_t>(best, std::mismatch(e.tokens.begin(), e.tokens.begin() + n, tokens.begin()).first -
                                       e.tokens.begin());
  }
  return best;
}

std::optional<PrefixCache::Hit> PrefixCache::lookup(const std::vector<int64_t>& tokens, int64_t max_length) {
  if (!enabled()) return std::nullopt;
  const int64_t T = std::min<int64_t>(tokens.size(), max_length);
  auto best = entries_.end();
  int64_t best_len = 0;
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const int64_t L = it->tokens.size();
    if (L <= best_len || L > T || (L == T && !it->logits.defined())) continue;
    if (std::equal(it->tokens.begin(), it->tokens.end(), tokens.begin())) {
      best = it;
      best_len = L;
    }
  }
  if (best == entries_.end()) {
    ++stats_.misses;
    return std::nullopt;
  }
  entries_.splice(entries_.begin(), entries_, best);  // most recently used
  Entry& e = entries_.front();
  if (e.on_host) {  // back to the device
    e.snap = e.snap.to(device_);
    if (e.logits.defined()) e.logits = e.logits.to(device_);
    e.on_host = false;
    used_host_ -= e.bytes;
    used_device_ += e.bytes;
    make_room();
  }
  ++stats_.hits;
  stats_.hit_tokens += best_len;
  return Hit{&e.snap, e.logits, best_len};
}

void PrefixCache::insert(const std::vector<int64_t>& tokens, Engine::Snapshot snap, Tensor logits) {
  if (!enabled()) return;
  const int64_t L = snap.length;
  const uint64_t h = hash_prefix(tokens, L);
  auto it = find(tokens, L, h);
  if (it != entries_.end()) {
    entries_.splice(entries_.begin(), entries_, it);
    if (logits.defined() && !it->logits.defined() && !it->on_host) it->logits = logits;
    return;
  }
  Entry e;
  e.tokens.assign(tokens.begin(), tokens.begin() + L);
  e.hash = h;
  e.bytes = snap.bytes() + (logits.defined() ? logits.nbytes() : 0);
  if (e.bytes > device_bytes_) return;  // larger than the whole budget
  e.snap = std::move(snap);
  e.logits = logits;
  used_device_ += e.bytes;
  entries_.push_front(std::move(e));
  ++stats_.inserts;
  make_room();
}

void PrefixCache::make_room() {
  // Device entries beyond the budget, least recently used first: to the host, else dropped.
  for (auto it = entries_.end(); used_device_ > device_bytes_ && it != entries_.begin();) {
    --it;
    if (it->on_host || it == entries_.begin()) continue;
    used_device_ -= it->bytes;
    if (host_bytes_ > 0 && it->bytes <= host_bytes_ && !device_.is_cpu()) {
      it->snap = it->snap.to(torch::kCPU);
      if (it->logits.defined()) it->logits = it->logits.to(torch::kCPU);
      it->on_host = true;
      used_host_ += it->bytes;
      ++stats_.spills;
    } else {
      it = entries_.erase(it);
      ++stats_.evictions;
    }
  }
  for (auto it = entries_.end(); used_host_ > host_bytes_ && it != entries_.begin();) {
    --it;
    if (!it->on_host) continue;
    used_host_ -= it->bytes;
    it = entries_.erase(it);
    ++stats_.evictions;
  }
}

PrefixCache::Stats PrefixCache::stats() const {
  Stats s = stats_;
  s.entries = entries_.size();
  s.device_bytes = used_device_;
  s.host_bytes = used_host_;
  return s;
}

}  // namespace lt2::serve
