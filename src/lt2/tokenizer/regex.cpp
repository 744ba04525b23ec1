#include "lt2/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "lt2/tokenizer/utf8.h"
#include "lt2/util/error.h"

namespace lt2 {

struct Regex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;

  ~Impl() { pcre2_code_free(code); }
};

namespace {

// Match data is per thread and reused: allocating it for every call would dominate the cost of
// matching short texts.
struct MatchData {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  ~MatchData() { pcre2_match_data_free(data); }
};

pcre2_match_data* thread_match_data() {
  thread_local MatchData md;
  return md.data;
}

// HF's regexes run on Oniguruma, whose \s is exactly Unicode's White_Space property. PCRE2's \s
// also matches U+180E MONGOLIAN VOWEL SEPARATOR (White_Space until Unicode 6.3), so \s becomes
// an explicit White_Space class: [list] outside a character class, the list inside one, and \S
// becomes [^list] outside a class (\S inside a class, which these patterns do not use, is kept).
std::string with_oniguruma_whitespace(const std::string& pattern) {
  static const std::string kWhiteSpace =
      R"(\t-\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  // Length of the escape sequence at pattern[at] == '\\', with its {...} argument if any.
  auto escape_length = [&](size_t at) -> size_t {
    if (at + 1 >= pattern.size()) return 1;
    size_t len = 2;
    const bool takes_braces = std::string("xpPoNg").find(pattern[at + 1]) != std::string::npos;
    if (takes_braces && at + 2 < pattern.size() && pattern[at + 2] == '{') {
      const size_t close = pattern.find('}', at + 2);
      len = close == std::string::npos ? pattern.size() - at : close + 1 - at;
    }
    return len;
  };
  std::string out;
  bool in_class = false;
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      if (e == 'Q') {  // a literal run up to \E
        const size_t end = pattern.find("\\E", i + 2);
        const size_t stop = end == std::string::npos ? pattern.size() : end + 2;
        out.append(pattern, i, stop - i);
        i = stop;
      } else if (e == 's') {
        out += in_class ? kWhiteSpace : "[" + kWhiteSpace + "]";
        i += 2;
      } else if (e == 'S' && !in_class) {
        out += "[^" + kWhiteSpace + "]";
        i += 2;
      } else {
        const size_t len = escape_length(i);
        out.append(pattern, i, len);
        i += len;
      }
    } else if (!in_class && c == '[') {
      // Copy the class opening, including a '^' and a leading ']' (a literal there).
      in_class = true;
      out.push_back(c);
      ++i;
      if (i < pattern.size() && pattern[i] == '^') out.push_back(pattern[i++]);
      if (i < pattern.size() && pattern[i] == ']') out.push_back(pattern[i++]);
    } else if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t close = pattern.find(":]", i + 2);
      const size_t stop = close == std::string::npos ? pattern.size() : close + 2;
      out.append(pattern, i, stop - i);  // a POSIX class such as [:alpha:]
      i = stop;
    } else {
      if (in_class && c == ']') in_class = false;
      out.push_back(c);
      ++i;
    }
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where, bool literal)
    : pattern_(pattern), impl_(std::make_unique<Impl>()) {
  uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
  if (literal) options = PCRE2_LITERAL | PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const std::string compiled = literal ? pattern : with_oniguruma_whitespace(pattern);
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(),
                              options, &error_code, &error_offset, nullptr);
  if (impl_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    throw Error(cat(where, ": cannot compile the regular expression '", pattern, "' at offset ",
                    error_offset, ": ", reinterpret_cast<const char*>(message)));
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

void Regex::find_all(std::string_view text, std::vector<Span>& out) const {
  pcre2_match_data* md = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    const int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, text.size(), start, 0, md, nullptr)
                              : pcre2_match(impl_->code, subject, text.size(), start, 0, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    LT2_CHECK(rc >= 0, "regular expression '", pattern_, "' failed while matching (PCRE2 error ",
              rc, ")");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      out.push_back({begin, end});
      start = end;
    } else {
      // An empty match splits nothing; resume one character later (one byte where the text is
      // not valid UTF-8 there).
      if (begin >= text.size()) return;
      uint32_t cp;
      const size_t len = utf8::decode(text, begin, cp);
      start = begin + (len > 0 ? len : 1);
    }
  }
}

bool Regex::search(std::string_view text) const {
  pcre2_match_data* md = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, text.size(), 0, 0, md, nullptr)
                            : pcre2_match(impl_->code, subject, text.size(), 0, 0, md, nullptr);
  LT2_CHECK(rc >= 0 || rc == PCRE2_ERROR_NOMATCH, "regular expression '", pattern_,
            "' failed while matching (PCRE2 error ", rc, ")");
  return rc >= 0;
}

}  // namespace lt2
