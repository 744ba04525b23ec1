// Normalizers of HF tokenizers' `normalizer` config that byte-level BPE models use: none (null),
// NFC, and a Sequence of these. Anything else throws lt2::Error when the tokenizer loads.
#pragma once
#include <string>
#include <string_view>

#include "lt2/util/json.h"

namespace lt2 {

// Unicode canonical composition (NFC) of UTF-8 text. Bytes that are not valid UTF-8 pass through
// unchanged and block composition across them.
std::string nfc(std::string_view text);

class Normalizer {
 public:
  Normalizer() = default;  // identity
  static Normalizer from_json(const json& config, const std::string& where);

  bool is_identity() const { return !nfc_; }
  std::string apply(std::string_view text) const;

 private:
  bool nfc_ = false;  // NFC is idempotent, so a Sequence with several NFCs is one NFC
};

}  // namespace lt2
