// lt2::Tokenizer: byte-level BPE that reads and writes Hugging Face `tokenizer.json` files and
// encodes exactly as HF `tokenizers` does (GPT-2, Llama 3, SmolLM2/Ouro, OLMo 2, Phi-2, Falcon,
// Qwen2 style files).
//
// Encoding follows HF's pipeline:
//   1. added tokens with normalized=false (usually the special tokens) are cut out of the raw text
//      (leftmost-longest match; lstrip/rstrip/single_word honored);
//   2. each remaining piece is normalized (none or NFC), then added tokens with normalized=true
//      are cut out;
//   3. each remaining piece is pre-tokenized into words (see pre_tokenizer.h);
//   4. each word goes through the BPE merges;
//   5. with add_special_tokens, the post-processor's tokens are added (TemplateProcessing,
//      RobertaProcessing, BertProcessing, ByteLevel (adds nothing), or a Sequence of these).
// The input may be any bytes, including invalid UTF-8: byte-level BPE covers every byte, and
// decode() gives them back (where they form valid UTF-8; other bytes become U+FFFD, as in HF).
//
// Regexes run on PCRE2 (UTF + UCP). HF runs them on Oniguruma, which may know a newer Unicode
// version: characters assigned after PCRE2's Unicode version (14.0 on Debian 12, e.g. CJK
// Extension H or Egyptian Hieroglyphs Extended-A) can be split differently. Everything older
// encodes exactly as HF does (checked against HF in tests/tokenizer).
//
// Not supported (load throws lt2::Error saying so): models other than BPE (WordPiece, Unigram,
// WordLevel), BPE without a ByteLevel pre-tokenizer, subword prefixes/suffixes, BPE dropout.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lt2/util/json.h"

namespace lt2 {

// Token ids are below this (16.8M; the largest published vocabularies hold about 256k). A file
// that claims a higher id is refused before the per-id tables are allocated.
inline constexpr int64_t kMaxTokenIds = int64_t{1} << 24;

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;      // skipped by decode(skip_special=true)
  bool lstrip = false;       // the match also takes the whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool single_word = false;  // only matches where not inside a word
  bool normalized = false;   // matched in the normalized text (else in the raw text)
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

class Tokenizer {
 public:
  // Reads an HF tokenizer.json, and for a file of that name the chat template and special tokens
  // of its folder (load_chat_config). Throws lt2::Error naming the file and the problem.
  static Tokenizer load(const std::string& path);
  // Reads GPT-2's original pair: encoder.json (token -> id) and vocab.bpe (merges, one "a b" per
  // line after a "#version" line). `<|endoftext|>` becomes a special token when present.
  static Tokenizer load_gpt2(const std::string& encoder_json, const std::string& vocab_bpe);
  // Builds from a parsed tokenizer.json document; `where` names it in error messages.
  static Tokenizer from_json(const json& doc, const std::string& where);
  // The byte-level BPE with no merges: ids 0..255 are the bytes 0..255 by byte value (token text
  // in GPT-2's byte-level alphabet, e.g. id 32 is "Ġ"), then `specials` in order from id 256
  // (e.g. "<|endoftext|>" = 256). Every byte of the input is one token.
  static Tokenizer byte_level(const std::vector<std::string>& specials);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (any bytes). Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Text of `ids`: ids without a token are skipped (as HF does); bytes that do not form valid
  // UTF-8 become U+FFFD. With skip_special, special added tokens are left out.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // The raw bytes of the ids (no U+FFFD replacement), for byte-exact round trips.
  std::string decode_bytes(const std::vector<int32_t>& ids, bool skip_special = false) const;

  // Number of ids: one more than the largest id of the vocabulary and the added tokens.
  int32_t vocab_size() const;
  std::optional<int32_t> token_to_id(const std::string& token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;

  // Writes an HF-readable tokenizer.json (atomically).
  void save(const std::string& path) const;
  // The tokenizer.json text save() writes.
  std::string to_json_text() const;

  // The conversation as the model's chat template renders it. The template is the checkpoint's
  // (see load_chat_config) or set_chat_template's; without one, ChatML:
  // "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then "<|im_start|>assistant\n" when
  // add_generation_prompt. Throws lt2::Error when the template raises or cannot render, or (ChatML)
  // when the vocabulary lacks <|im_start|> or <|im_end|> as added tokens.
  std::string apply_chat_template(const std::vector<ChatMessage>& messages,
                                  bool add_generation_prompt = false) const;
  // Reads the Hugging Face files of the folder `dir` that define the chat: chat_template.jinja, or
  // else tokenizer_config.json's "chat_template" (a string, or a list of {name, template} of which
  // "default" is taken), and the special tokens the template may use (bos_token, eos_token, ...).
  // load() calls it for the folder of a file named tokenizer.json. A template that does not parse
  // is kept as an error that apply_chat_template throws (completions still work).
  void load_chat_config(const std::string& dir);
  // Replaces the chat template with the Jinja `source`; `where` names it in errors. Throws
  // lt2::Error on a syntax error.
  void set_chat_template(std::string_view source, const std::string& where);
  // Where the chat template comes from, for logs: a file, or "ChatML (built in)".
  std::string chat_template_origin() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  static Tokenizer from_json_checked(const json& doc, const std::string& where);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lt2
