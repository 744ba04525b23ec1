#include "lt2/serve/text_stream.h"

#include <algorithm>

namespace lt2::serve {

namespace {
const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// Length of the UTF-8 sequence at raw[i] when it is valid and complete (1..4); 0 when invalid;
// -1 when it is a valid start that the end of the buffer cuts off.
int sequence_at(const std::string& raw, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(raw[k]); };
  const unsigned char c = b(i);
  int n;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;        // no overlongs
    if (c == 0xED) hi = 0x9F;        // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;        // <= U+10FFFF
  } else {
    return 0;
  }
  for (int k = 1; k < n; ++k) {
    if (i + k >= raw.size()) return -1;
    const unsigned char x = b(i + k);
    if (k == 1 ? (x < lo || x > hi) : (x < 0x80 || x > 0xBF)) return 0;
  }
  return n;
}
}  // namespace

size_t utf8_sanitize(const std::string& raw, size_t from, bool final, std::string& out) {
  size_t i = from;
  while (i < raw.size()) {
    const int n = sequence_at(raw, i);
    if (n > 0) {
      out.append(raw, i, n);
      i += n;
    } else if (n < 0 && !final) {
      break;  // wait for the rest of the character
    } else {
      out += kReplacement;
      ++i;
    }
  }
  return i;
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const int n = sequence_at(s, i);
    if (n <= 0) return false;
    i += n;
  }
  return true;
}

TextStream::TextStream(std::vector<std::string> stops) : stops_(std::move(stops)) {}

TextStream::Update TextStream::push(const std::string& token_bytes) {
  if (stopped_) return {};
  raw_ += token_bytes;
  return advance(false);
}

std::string TextStream::flush() {
  if (stopped_) return {};
  return advance(true).text;
}

TextStream::Update TextStream::advance(bool final) {
  raw_done_ = utf8_sanitize(raw_, raw_done_, final, text_);
  Update u;
  const size_t from = emitted_.size();
  // A stop string starts at or after `from`: text that could begin one was held back.
  size_t stop_at = std::string::npos;
  for (const auto& s : stops_) stop_at = std::min(stop_at, text_.find(s, from));
  size_t end = text_.size();
  if (stop_at != std::string::npos) {
    end = stop_at;
    u.stopped = stopped_ = true;
  } else if (!final) {
    // Hold back the longest tail of the text that is a proper prefix of a stop string.
    size_t hold = 0;
    for (const auto& s : stops_)
      for (size_t k = std::min(s.size() - 1, text_.size() - from); k > hold; --k)
        if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    end = text_.size() - hold;
  }
  u.text = text_.substr(from, end - from);
  emitted_ += u.text;
  return u;
}

}  // namespace lt2::serve
