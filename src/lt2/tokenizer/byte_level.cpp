#include "lt2/tokenizer/byte_level.h"

#include <array>

#include "lt2/tokenizer/utf8.h"

namespace lt2::byte_level {

namespace {

struct Tables {
  std::array<int16_t, 512> char_to_byte{};  // every mapped code point is below U+0200
  std::array<std::string, 256> byte_to_utf8;

  Tables() {
    char_to_byte.fill(-1);
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = printable(b) ? static_cast<uint32_t>(b) : next_extra++;
      char_to_byte[cp] = static_cast<int16_t>(b);
      utf8::append(byte_to_utf8[b], cp);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

std::optional<uint8_t> char_to_byte(uint32_t cp) {
  if (cp >= 512) return std::nullopt;
  const int16_t b = tables().char_to_byte[cp];
  if (b < 0) return std::nullopt;
  return static_cast<uint8_t>(b);
}

std::string encode(std::string_view bytes) {
  const Tables& t = tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) out += t.byte_to_utf8[c];
  return out;
}

std::optional<std::string> decode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    uint32_t cp;
    const size_t len = utf8::decode(text, pos, cp);
    if (len == 0) return std::nullopt;
    const auto b = char_to_byte(cp);
    if (!b) return std::nullopt;
    out.push_back(static_cast<char>(*b));
    pos += len;
  }
  return out;
}

}  // namespace lt2::byte_level
