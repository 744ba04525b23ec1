// Byte-level BPE training, writing tokenizers that lt2 and Hugging Face `tokenizers` both read.
//
// Texts are cut into words by a split regex (Llama 3's by default), special tokens are removed
// from them, and the words are counted (in parallel, in batches). Training starts from the 256
// bytes and repeatedly merges the most frequent adjacent pair (ties: the pair of smaller ids)
// until the vocabulary reaches the target size or no pair occurs min_frequency times. Pair
// counts are updated incrementally, only in the words that contain the merged pair, and a lazy
// max-heap finds the next pair.
//
// Ids of the result: the special tokens first (0, 1, ...), then the 256 bytes by byte value, then
// the merges in the order they were learned. The tokenizer.json has a Split(regex, Isolated) +
// ByteLevel(use_regex: false) pre-tokenizer and a ByteLevel decoder.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "lt2/tokenizer/tokenizer.h"

namespace lt2 {

struct BpeTrainerOptions {
  int32_t vocab_size = 32000;  // including the 256 bytes and the special tokens
  int64_t min_frequency = 2;   // a pair seen fewer times is never merged
  std::vector<std::string> special_tokens = {"<|endoftext|>"};
  std::string split_pattern;   // empty: Llama 3's regex (kLlama3SplitPattern)
  int threads = 0;             // word counting threads; 0: all cores
  // Called with a line of progress now and then (nullptr: silent).
  std::function<void(const std::string&)> progress;
};

class BpeTrainer {
 public:
  explicit BpeTrainer(BpeTrainerOptions options);
  ~BpeTrainer();
  BpeTrainer(const BpeTrainer&) = delete;
  BpeTrainer& operator=(const BpeTrainer&) = delete;

  // Adds a text (one document, any size) to the word counts.
  void add_text(std::string_view text);
  // Learns the merges from everything added so far.
  Tokenizer train();

  int64_t bytes_added() const { return bytes_added_; }

 private:
  struct Impl;
  void count_pending();
  BpeTrainerOptions options_;
  std::unique_ptr<Impl> impl_;
  int64_t bytes_added_ = 0;
};

// Trains on `texts` (one document each).
Tokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainerOptions& options);

}  // namespace lt2
