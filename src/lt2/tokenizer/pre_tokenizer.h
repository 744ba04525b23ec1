// Pre-tokenization: cuts a text segment into the words that BPE encodes independently, following
// HF tokenizers' `pre_tokenizer` config. Supported steps (what byte-level BPE models use):
// Sequence, Split (regex or literal string; behaviors Removed, Isolated, MergedWithPrevious,
// MergedWithNext, Contiguous; invert), ByteLevel (add_prefix_space, use_regex with GPT-2's
// regex), Digits (individual_digits) and Punctuation (behavior). Other types throw lt2::Error.
//
// Words come out as raw bytes: the ByteLevel step's character mapping is only materialised when a
// later step has to see it (e.g. Falcon runs Digits after ByteLevel), and undone at the end.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "lt2/tokenizer/regex.h"
#include "lt2/util/json.h"

namespace lt2 {

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// The regex GPT-2 (and HF's ByteLevel pre-tokenizer with use_regex) splits words with.
extern const char* const kGpt2SplitPattern;
// The regex of Llama 3 / cl100k: case-insensitive contractions, numbers in groups of 1-3 digits.
extern const char* const kLlama3SplitPattern;

class PreTokenizer {
 public:
  // An empty pipeline: the whole segment is one word.
  PreTokenizer();
  // From the `pre_tokenizer` field of a tokenizer.json (null allowed). Throws lt2::Error on
  // unsupported types or bad fields; `where` prefixes messages.
  static PreTokenizer from_json(const json& config, const std::string& where);
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // Calls `emit` with each word of `segment` in order (raw bytes, never empty; the view is only
  // valid during the call). Each run of bytes that are not valid UTF-8 is a word of its own.
  void split(std::string_view segment, const std::function<void(std::string_view)>& emit) const;
  // Appends the words of `segment` to `words`.
  void split(std::string_view segment, std::vector<std::string>& words) const;

  // Whether a ByteLevel step is present (required for byte-level BPE).
  bool has_byte_level() const { return has_byte_level_; }

 private:
  struct Step;
  void split_valid(std::string_view segment, const std::function<void(std::string_view)>& emit) const;
  std::vector<std::unique_ptr<Step>> steps_;
  bool has_byte_level_ = false;
  // Index of the ByteLevel step: only steps after it see byte-level-mapped text.
  int byte_level_step_ = -1;
};

}  // namespace lt2
