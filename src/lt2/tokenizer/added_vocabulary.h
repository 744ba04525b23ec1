// Finding added tokens in text, as HF's AddedVocabulary does: leftmost-longest, non-overlapping
// matches of the tokens' contents, then the per-token options (single_word, lstrip, rstrip).
#pragma once
#include <array>
#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "lt2/tokenizer/tokenizer.h"

namespace lt2 {

// A piece of text: either an added token (token >= 0, its index in the matcher's list) or plain
// text to encode further (token == -1).
struct Segment {
  size_t begin, end;
  int token;
};

class AddedTokenMatcher {
 public:
  // `tokens` must outlive the matcher.
  explicit AddedTokenMatcher(const std::vector<const AddedToken*>& tokens);

  bool empty() const { return tokens_.empty(); }
  // Cuts `text` into segments covering it in order (empty text segments are left out).
  void split(std::string_view text, std::vector<Segment>& out) const;
  const AddedToken& token(int index) const { return *tokens_[index]; }

 private:
  // A byte trie of the token contents.
  int32_t child(int32_t node, uint8_t byte) const;
  std::vector<const AddedToken*> tokens_;
  std::unordered_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> node
  std::vector<int32_t> terminal_;                // node -> token index or -1
  std::array<bool, 256> first_byte_{};           // bytes some token starts with
};

}  // namespace lt2
