// UTF-8 helpers shared by the tokenizer: decoding one code point with error reporting, encoding,
// and the lossy conversion HF's decoders apply (each invalid sequence becomes one U+FFFD).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lt2::utf8 {

// Length in bytes of the well-formed UTF-8 sequence starting at `s[pos]`, or 0 when the bytes
// there are not a well-formed sequence (bad lead byte, bad or missing continuation, overlong form,
// surrogate, or a code point past U+10FFFF). `cp` receives the code point when the result is > 0.
size_t decode(std::string_view s, size_t pos, uint32_t& cp);

// Length of the longest prefix of an ill-formed sequence at `s[pos]` that the Unicode standard's
// "maximal subpart" rule replaces with a single U+FFFD (always >= 1). Only meaningful where
// decode() returned 0. This is the rule Rust's String::from_utf8_lossy follows.
size_t invalid_prefix_length(std::string_view s, size_t pos);

void append(std::string& out, uint32_t cp);

// `bytes` with every ill-formed subsequence replaced by U+FFFD, as String::from_utf8_lossy does.
std::string to_valid_lossy(std::string_view bytes);

// Length of the longest prefix of `s` that is well-formed UTF-8.
size_t valid_prefix_length(std::string_view s);

// Unicode White_Space property (what Rust's char::is_whitespace tests).
bool is_whitespace(uint32_t cp);

}  // namespace lt2::utf8
