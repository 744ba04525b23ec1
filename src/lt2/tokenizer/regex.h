// A compiled PCRE2 pattern (UTF + UCP, so \p{L}, \s and \w are Unicode-aware, JIT-compiled when
// the platform supports it). Matching accepts invalid UTF-8: ill-formed bytes never match a
// pattern character, so byte-level tokenizers can encode arbitrary bytes.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lt2 {

struct Span {
  size_t begin = 0;
  size_t end = 0;
};

class Regex {
 public:
  // Throws lt2::Error naming `where`, the pattern and PCRE2's message when it does not compile.
  // `literal`: the pattern is a plain string to find, not a regular expression.
  Regex(const std::string& pattern, const std::string& where, bool literal = false);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // All non-empty, non-overlapping matches in `text`, left to right, appended to `out`.
  void find_all(std::string_view text, std::vector<Span>& out) const;
  // Whether the pattern matches somewhere in `text`.
  bool search(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::string pattern_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lt2
