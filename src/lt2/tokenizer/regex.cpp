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

// HF's regexes run on Oniguruma, whose \s is Unicode's White_Space property. PCRE2's \s also
// matches U+180E MONGOLIAN VOWEL SEPARATOR (no longer White_Space since Unicode 6.3), so \s, \S
// and classes containing them are rewritten to treat U+180E as Oniguruma does. (Other escapes
// and constructs pass through unchanged.)
std::string with_oniguruma_whitespace(const std::string& pattern) {
  static const char* const kNotMvs = "(?!\\x{180E})";
  static const char* const kMvs = "\\x{180E}";
  std::string out;
  size_t i = 0;
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
        out += cat("(?:", kNotMvs, "\\s)");
        i += 2;
      } else if (e == 'S') {
        out += cat("(?:\\S|", kMvs, ")");
        i += 2;
      } else {
        const size_t len = escape_length(i);
        out.append(pattern, i, len);
        i += len;
      }
      continue;
    }
    if (c != '[') {
      out.push_back(c);
      ++i;
      continue;
    }
    // A character class: find its end, noting whether it is negated and holds \s or \S.
    const size_t begin = i++;
    const bool negated = i < pattern.size() && pattern[i] == '^';
    if (negated) ++i;
    if (i < pattern.size() && pattern[i] == ']') ++i;  // a leading ']' is a literal
    bool has_s = false, has_S = false;
    while (i < pattern.size() && pattern[i] != ']') {
      if (pattern[i] == '\\') {
        if (i + 1 < pattern.size()) {
          has_s = has_s || pattern[i + 1] == 's';
          has_S = has_S || pattern[i + 1] == 'S';
        }
        i += escape_length(i);
      } else if (pattern[i] == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
        const size_t close = pattern.find(":]", i + 2);
        i = close == std::string::npos ? pattern.size() : close + 2;
      } else {
        ++i;
      }
    }
    if (i < pattern.size()) ++i;  // the closing ']'
    const std::string cls = pattern.substr(begin, i - begin);
    // Where PCRE2 would match U+180E through \s but Oniguruma would not, exclude it; where
    // PCRE2 would exclude it through \s (in a negated class) or \S, let it match.
    const bool pcre_matches_mvs_extra = (has_s && !negated) || (has_S && negated);
    const bool pcre_misses_mvs = (has_s && negated) || (has_S && !negated);
    if (pcre_matches_mvs_extra && !pcre_misses_mvs)
      out += cat("(?:", kNotMvs, cls, ")");
    else if (pcre_misses_mvs && !pcre_matches_mvs_extra)
      out += cat("(?:", cls, "|", kMvs, ")");
    else
      out += cls;
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
