// The prefix-state cache of `lt2 serve`: snapshots of a sequence's whole decode state (every
// (loop, layer) mixer state: recurrent matrices, conv tails, window rings, KV prefixes; see
// Engine::snapshot) keyed by the tokens it has consumed. A request whose prompt extends a cached
// prefix restores the longest one and prefills only the rest. Recurrent states cannot be cut back
// to a shorter prefix, so a snapshot serves exactly its own length: the scheduler takes them at
// fixed token intervals of each prompt, where a prompt parts from a cached sequence (a branch
// point, as in a radix tree), at its end, and at the end of each request.
//
// Entries live on the engine's device under `device_bytes` (LRU); evicted ones move to host memory
// under `host_bytes` (LRU again) and are copied back on a hit. Used by the scheduler thread only.
#pragma once
#include <cstdint>
#include <list>
#include <optional>
#include <vector>

#include "lt2/infer/engine.h"

namespace lt2::serve {

class PrefixCache {
 public:
  PrefixCache(int64_t device_bytes, int64_t host_bytes, torch::Device device);
  bool enabled() const { return device_bytes_ > 0; }

  struct Hit {
    const Engine::Snapshot* snapshot = nullptr;  // on the device; valid until the next call
    Tensor logits;                               // [V] of the last prefix token, when the entry has them
    int64_t length = 0;
  };
  // The longest entry whose tokens are a prefix of `tokens` and shorter than it, or exactly as long
  // when it holds the last token's logits (a repeated prompt needs no prefill at all). A host
  // entry found is moved back to the device first.
  std::optional<Hit> lookup(const std::vector<int64_t>& tokens, int64_t max_length);
  // The longest prefix `tokens` shares with the tokens of any entry (0 with none): where a prompt
  // parts from a cached sequence, the point worth a snapshot of its own (the next prompt that
  // shares it resumes there). Reads only: no hit, no recency.
  int64_t shared_length(const std::vector<int64_t>& tokens) const;
  // Whether an entry for exactly these tokens exists (then insert only refreshes it).
  bool contains(const std::vector<int64_t>& tokens, int64_t length) const;
  // Stores the snapshot of tokens[0, snap.length) (evicting least recently used entries).
  void insert(const std::vector<int64_t>& tokens, Engine::Snapshot snap, Tensor logits = {});

  struct Stats {
    int64_t entries = 0, device_bytes = 0, host_bytes = 0;
    int64_t hits = 0, misses = 0, hit_tokens = 0, inserts = 0, evictions = 0, spills = 0;
  };
  Stats stats() const;

 private:
  struct Entry {
    std::vector<int64_t> tokens;
    uint64_t hash = 0;
    Engine::Snapshot snap;
    Tensor logits;
    bool on_host = false;
    int64_t bytes = 0;
  };
  using List = std::list<Entry>;  // most recently used first
  List::iterator find(const std::vector<int64_t>& tokens, int64_t length, uint64_t hash);
  void make_room();
  static uint64_t hash_prefix(const std::vector<int64_t>& tokens, int64_t length);

  int64_t device_bytes_, host_bytes_;
  torch::Device device_;
  List entries_;
  int64_t used_device_ = 0, used_host_ = 0;
  Stats stats_;
};

}  // namespace lt2::serve
