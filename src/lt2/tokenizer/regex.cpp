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

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where, bool literal)
    : pattern_(pattern), impl_(std::make_unique<Impl>()) {
  uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
  if (literal) options = PCRE2_LITERAL | PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
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
