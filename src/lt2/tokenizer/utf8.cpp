#include "lt2/tokenizer/utf8.h"

namespace lt2::utf8 {

namespace {

bool is_continuation(uint8_t b) { return (b & 0xC0) == 0x80; }

// For a lead byte, the number of bytes of its sequence and the allowed range of the second
// byte (which excludes overlong forms, surrogates and code points above U+10FFFF). Returns 0 for a
// byte that cannot start a sequence.
size_t lead_info(uint8_t lead, uint8_t& second_lo, uint8_t& second_hi) {
  second_lo = 0x80;
  second_hi = 0xBF;
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) {
    if (lead == 0xE0) second_lo = 0xA0;
    if (lead == 0xED) second_hi = 0x9F;
    return 3;
  }
  if (lead >= 0xF0 && lead <= 0xF4) {
    if (lead == 0xF0) second_lo = 0x90;
    if (lead == 0xF4) second_hi = 0x8F;
    return 4;
  }
  return 0;
}

}  // namespace

size_t decode(std::string_view s, size_t pos, uint32_t& cp) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + pos;
  const size_t avail = s.size() - pos;
  uint8_t lo, hi;
  const size_t len = lead_info(p[0], lo, hi);
  if (len == 0 || len > avail) return 0;
  if (len == 1) {
    cp = p[0];
    return 1;
  }
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < len; ++i)
    if (!is_continuation(p[i])) return 0;
  static const uint8_t lead_mask[5] = {0, 0, 0x1F, 0x0F, 0x07};
  cp = p[0] & lead_mask[len];
  for (size_t i = 1; i < len; ++i) cp = (cp << 6) | (p[i] & 0x3F);
  return len;
}

size_t invalid_prefix_length(std::string_view s, size_t pos) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + pos;
  const size_t avail = s.size() - pos;
  uint8_t lo, hi;
  const size_t len = lead_info(p[0], lo, hi);
  if (len <= 1) return 1;
  // A valid lead followed by a truncated run of valid continuations is one maximal subpart.
  size_t n = 1;
  if (n < avail && p[n] >= lo && p[n] <= hi) {
    ++n;
    while (n < len && n < avail && is_continuation(p[n])) ++n;
  }
  return n;
}

void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string to_valid_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    uint32_t cp;
    const size_t len = decode(bytes, pos, cp);
    if (len > 0) {
      out.append(bytes.data() + pos, len);
      pos += len;
    } else {
      append(out, 0xFFFD);
      pos += invalid_prefix_length(bytes, pos);
    }
  }
  return out;
}

size_t valid_prefix_length(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    if (static_cast<unsigned char>(s[pos]) < 0x80) {
      ++pos;
      continue;
    }
    uint32_t cp;
    const size_t len = decode(s, pos, cp);
    if (len == 0) return pos;
    pos += len;
  }
  return pos;
}

bool is_whitespace(uint32_t cp) {
  if (cp >= 0x09 && cp <= 0x0D) return true;
  switch (cp) {
    case 0x20: case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F:
    case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

}  // namespace lt2::utf8
