#include "lt2/eval/text.h"

#include "lt2/tokenizer/utf8.h"

namespace lt2::eval {

namespace {

// Python's str.isspace() for one code point: Unicode White_Space plus the separators U+001C..U+001F.
bool py_space(uint32_t cp) { return utf8::is_whitespace(cp) || (cp >= 0x1c && cp <= 0x1f); }

// Byte length of the whitespace character starting at s[i], or 0 when s[i] starts none.
size_t space_at(std::string_view s, size_t i) {
  uint32_t cp = 0;
  const size_t n = utf8::decode(s, i, cp);
  return n > 0 && py_space(cp) ? n : 0;
}

// Byte length of the whitespace character ending just before s[j], or 0.
size_t space_before(std::string_view s, size_t j) {
  for (size_t len = 1; len <= 4 && len <= j; ++len) {
    const auto c = static_cast<unsigned char>(s[j - len]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: the character starts further left
    return space_at(s, j - len) == len ? len : 0;
  }
  return 0;
}

// Byte length of the character at s[i] (1 for an invalid byte).
size_t char_len(std::string_view s, size_t i) {
  uint32_t cp = 0;
  const size_t n = utf8::decode(s, i, cp);
  return n > 0 ? n : 1;
}

// re.sub(r"O\s*([^C]*?)\s*C", r"O\1C", s) for one bracket pair O, C (O == C for quotes): each
// bracketed span, taken left to right without overlap, loses the whitespace inside its ends.
std::string tighten_brackets(std::string_view s, char open, char close) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != open) {
      out += s[i++];
      continue;
    }
    const size_t j = s.find(close, i + 1);
    if (j == std::string_view::npos) break;  // no span opens here or later
    out += open;
    out += strip(s.substr(i + 1, j - i - 1));
    out += close;
    i = j + 1;
  }
  out += s.substr(std::min(i, s.size()));
  return out;
}

}  // namespace

int64_t count_chars(std::string_view s) {
  int64_t n = 0;
  for (size_t i = 0; i < s.size(); i += char_len(s, i)) ++n;
  return n;
}

int64_t count_words(std::string_view s) {
  int64_t runs = 0;
  bool in_space = false;
  for (size_t i = 0; i < s.size();) {
    const size_t w = space_at(s, i);
    if (w > 0 && !in_space) ++runs;
    in_space = w > 0;
    i += w > 0 ? w : char_len(s, i);
  }
  return runs + 1;
}

std::string rstrip(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    const size_t w = space_before(s, e);
    if (w == 0) break;
    e -= w;
  }
  return std::string(s.substr(0, e));
}

std::string lstrip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    const size_t w = space_at(s, b);
    if (w == 0) break;
    b += w;
  }
  return std::string(s.substr(b));
}

std::string strip(std::string_view s) { return rstrip(lstrip(s)); }

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  for (size_t j; (j = s.find(from, i)) != std::string_view::npos; i = j + from.size()) {
    out.append(s.substr(i, j - i));
    out.append(to);
  }
  out.append(s.substr(i));
  return out;
}

std::string collapse_whitespace(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t w = space_at(s, i);
    if (w == 0) {
      const size_t n = char_len(s, i);
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    while (w > 0) {
      i += w;
      w = space_at(s, i);
    }
    out += ' ';
  }
  return out;
}

std::vector<std::string> split_wikitext_articles(std::string_view raw) {
  std::vector<std::string> pages;
  std::string page;
  bool empty = true;  // no line in `page` yet
  auto flush = [&] {
    if (!strip(page).empty()) pages.push_back(page);
    page.clear();
    empty = true;
  };
  size_t begin = 0;
  while (true) {  // Python's raw.split("\n"): a trailing newline leaves a last, empty line
    const size_t end = raw.find('\n', begin);
    const std::string_view line = raw.substr(begin, end == std::string_view::npos ? raw.size() - begin : end - begin);
    const std::string heading = strip(replace_all(replace_all(line, "= = =", "==="), "= =", "=="));
    if (heading.rfind("= ", 0) == 0 && heading.size() >= 2 && heading.compare(heading.size() - 2, 2, " =") == 0)
      flush();
    if (!empty) page += '\n';
    page.append(line);
    empty = false;
    if (end == std::string_view::npos) break;
    begin = end + 1;
  }
  flush();
  return pages;
}

std::string wikitext_detokenize(std::string_view page) {
  std::string s = replace_all(page, "s '", "s'");
  // re.sub(r"/' [0-9]/", r"/'[0-9]/", s): the harness's pattern is literal slashes around a digit,
  // replaced by the literal text "/'[0-9]/".
  {
    std::string out;
    size_t i = 0;
    while (i < s.size()) {
      if (i + 5 <= s.size() && s.compare(i, 3, "/' ") == 0 && s[i + 3] >= '0' && s[i + 3] <= '9' && s[i + 4] == '/') {
        out += "/'[0-9]/";
        i += 5;
      } else {
        out += s[i++];
      }
    }
    s = std::move(out);
  }
  for (const auto& [from, to] : std::vector<std::pair<const char*, const char*>>{
           {" @-@ ", "-"}, {" @,@ ", ","}, {" @.@ ", "."}, {" : ", ": "}, {" ; ", "; "}, {" . ", ". "},
           {" ! ", "! "}, {" ? ", "? "}, {" , ", ", "}})
    s = replace_all(s, from, to);
  s = tighten_brackets(s, '(', ')');
  s = tighten_brackets(s, '[', ']');
  s = tighten_brackets(s, '{', '}');
  s = tighten_brackets(s, '"', '"');
  s = tighten_brackets(s, '\'', '\'');
  for (const auto& [from, to] : std::vector<std::pair<const char*, const char*>>{
           {"= = = =", "===="}, {"= = =", "==="}, {"= =", "=="}, {" \u00b0 ", "\u00b0"}, {" \n", "\n"},
           {"\n ", "\n"}, {" N ", " 1 "}, {" 's", "'s"}})
    s = replace_all(s, from, to);
  return s;
}

std::string hellaswag_preprocess(std::string_view text) {
  const std::string s = replace_all(strip(text), " [title]", ". ");
  // re.sub(r"\[.*?\]", "", s): '.' does not match a newline.
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '[') {
      const size_t close = s.find(']', i + 1), newline = s.find('\n', i + 1);
      if (close != std::string::npos && (newline == std::string::npos || newline > close)) {
        i = close + 1;
        continue;
      }
    }
    out += s[i++];
  }
  return replace_all(out, "  ", " ");
}

}  // namespace lt2::eval
