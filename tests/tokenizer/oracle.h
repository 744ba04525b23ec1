// Shared helpers of the tokenizer tests: temporary folders, the Hugging Face `tokenizers` oracle
// (tests/scripts/hf_tokenizer_oracle.py run with python3), a training corpus, and test texts.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "lt2/util/json.h"

namespace lt2::test {

// A fresh folder under the system temp folder, removed with its contents at destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Empty when python3 with `tokenizers` is available, else the reason it is not (tests skip).
std::string oracle_unavailable();

// Runs the oracle script with `args`; throws with its output when it fails.
void run_oracle(const std::vector<std::string>& args);

struct OracleResult {
  std::vector<std::vector<int32_t>> ids, ids_special;
  std::vector<std::string> decoded, decoded_skip;
};
// HF's results for `texts` (valid UTF-8 only) with a tokenizer.json, or with GPT-2's vocab.json +
// merges.txt when `merges` is given.
OracleResult oracle_encode(const std::string& tokenizer, const std::vector<std::string>& texts,
                           const std::optional<std::string>& merges = std::nullopt);

// Writes about `bytes` of English text to `path`: Jane Austen's novels from the Debian package
// r-cran-janeaustenr when R has it, else a text generated here. Returns a description of the source.
std::string write_english_corpus(const std::string& path, size_t bytes);

// Texts that exercise every pre-tokenizer path: English, other scripts, code, emoji, numbers,
// whitespace runs, \r\n, control characters, `specials` inside text, plus seeded random
// strings over a pool of tricky characters.
std::vector<std::string> varied_texts(const std::vector<std::string>& specials);

// The folder of published tokenizer files (../shared/data/tokenizers next to the checkout), or
// empty when absent.
std::string published_tokenizers_dir();

}  // namespace lt2::test
