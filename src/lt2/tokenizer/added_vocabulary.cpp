#include "lt2/tokenizer/added_vocabulary.h"

#include <optional>
#include <string>

#include "lt2/tokenizer/regex.h"
#include "lt2/tokenizer/utf8.h"

namespace lt2 {

namespace {

// HF tests word characters with Rust's Unicode \w: Alphabetic, marks, decimal digits,
// connector punctuation and joiners (ZWJ, ZWNJ).
bool is_word_char(uint32_t cp) {
  static const Regex word(R"(\A[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]\z)",
                          "added-token word test");
  std::string s;
  utf8::append(s, cp);
  return word.search(s);
}

// The character that ends `text` (nullopt if empty or not valid UTF-8 there).
std::optional<uint32_t> last_char(std::string_view text) {
  size_t start = text.size();
  while (start > 0 && text.size() - start < 4) {
    --start;
    if ((static_cast<unsigned char>(text[start]) & 0xC0) != 0x80) break;
  }
  uint32_t cp;
  if (start < text.size() && utf8::decode(text, start, cp) == text.size() - start) return cp;
  return std::nullopt;
}

std::optional<uint32_t> first_char(std::string_view text) {
  uint32_t cp;
  if (!text.empty() && utf8::decode(text, 0, cp) > 0) return cp;
  return std::nullopt;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<const AddedToken*>& tokens)
    : tokens_(tokens) {
  terminal_.push_back(-1);  // the root
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const std::string& s = tokens_[i]->content;
    if (s.empty()) continue;
    first_byte_[static_cast<unsigned char>(s[0])] = true;
    int32_t node = 0;
    for (unsigned char b : s) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | b;
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, static_cast<int32_t>(terminal_.size())).first;
        terminal_.push_back(-1);
      }
      node = it->second;
    }
    // Of duplicate contents, the first token wins.
    if (terminal_[node] < 0) terminal_[node] = static_cast<int32_t>(i);
  }
}

int32_t AddedTokenMatcher::child(int32_t node, uint8_t byte) const {
  const auto it = edges_.find((static_cast<uint64_t>(node) << 8) | byte);
  return it == edges_.end() ? -1 : it->second;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  size_t done = 0;  // everything before this offset has been emitted
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    // Longest token starting at pos.
    int best = -1;
    size_t best_end = 0;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      node = child(node, static_cast<unsigned char>(text[i]));
      if (node < 0) break;
      if (terminal_[node] >= 0) {
        best = terminal_[node];
        best_end = i + 1;
      }
    }
    if (best < 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = best_end;
    pos = best_end;  // matches never overlap, even when this one is discarded below
    const AddedToken& token = *tokens_[best];
    if (token.single_word) {
      const auto before = last_char(text.substr(0, start));
      const auto after = first_char(text.substr(stop));
      if ((before && is_word_char(*before)) || (after && is_word_char(*after))) continue;
    }
    if (token.lstrip) {
      // Take the whitespace before the token, but not what an earlier match already took.
      while (start > done) {
        const auto c = last_char(text.substr(done, start - done));
        if (!c || !utf8::is_whitespace(*c)) break;
        std::string tmp;
        utf8::append(tmp, *c);
        start -= tmp.size();
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        uint32_t cp;
        const size_t len = utf8::decode(text, stop, cp);
        if (len == 0 || !utf8::is_whitespace(cp)) break;
        stop += len;
      }
      pos = stop;
    }
    if (start > done) out.push_back({done, start, -1});
    out.push_back({start, stop, best});
    done = stop;
  }
  if (done < text.size()) out.push_back({done, text.size(), -1});
}

}  // namespace lt2
