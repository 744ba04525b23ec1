// Generated tokens to client text, incrementally: raw token bytes become valid UTF-8 (a character
// split across tokens waits for its last byte; invalid bytes become U+FFFD), and stop strings are
// matched in the text, across token boundaries: text that may still turn out to begin a stop
// string is held back, and the stop string itself is never emitted.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lt2::serve {

// Appends to `out` the valid UTF-8 of raw[from...], invalid bytes as U+FFFD. Without `final`, an
// incomplete sequence at the end is left for later. Returns the offset of the first byte not taken.
size_t utf8_sanitize(const std::string& raw, size_t from, bool final, std::string& out);

// Whether `s` is valid UTF-8.
bool valid_utf8(const std::string& s);

class TextStream {
 public:
  explicit TextStream(std::vector<std::string> stops);
  struct Update {
    std::string text;      // new text for the client
    bool stopped = false;  // a stop string was completed (it and everything after are dropped)
  };
  // Adds the bytes of the next token.
  Update push(const std::string& token_bytes);
  // The end of generation (not by a stop string): the held-back text, an incomplete character as U+FFFD.
  std::string flush();
  // Every text emitted so far.
  const std::string& emitted() const { return emitted_; }

 private:
  Update advance(bool final);
  std::vector<std::string> stops_;
  std::string raw_;       // every byte so far
  size_t raw_done_ = 0;   // bytes of raw_ converted into text_
  std::string text_;      // valid UTF-8 so far
  std::string emitted_;   // the prefix of text_ given to the client
  bool stopped_ = false;
};

}  // namespace lt2::serve
