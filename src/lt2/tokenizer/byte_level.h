// GPT-2's byte-level alphabet: every byte value is shown as one printable Unicode character, so a
// vocabulary of byte strings can be stored as text. Printable Latin-1 bytes ('!'..'~', '¡'..'¬',
// '®'..'ÿ') stand for themselves; the other 68 bytes (controls, space, 0x7F..0xA0, 0xAD) map in
// byte order to U+0100, U+0101, ... (so ' ' is 'Ġ' U+0120 and '\n' is 'Ċ' U+010A).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace lt2::byte_level {

// The byte a character stands for, or nullopt for a character outside the alphabet.
std::optional<uint8_t> char_to_byte(uint32_t cp);

// Raw bytes -> their byte-level text (UTF-8 of the mapped characters).
std::string encode(std::string_view bytes);
// Byte-level text -> raw bytes; nullopt when some character is outside the alphabet or the text
// is not valid UTF-8.
std::optional<std::string> decode(std::string_view text);

}  // namespace lt2::byte_level
