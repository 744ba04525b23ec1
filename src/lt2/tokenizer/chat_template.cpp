#include "lt2/tokenizer/chat_template.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lt2/tokenizer/utf8.h"
#include "lt2/util/error.h"

namespace lt2 {

namespace {

// Bounds that keep a hostile or broken template from hanging or exhausting memory.
// kMaxSteps ends a render within about 1.5 s in the sanitizer build on a loaded machine (the fuzz
// target renders twice within its 10 s timeout); real templates take a few hundred steps per
// message. kMaxOutput is 30 times the prompt of a 128k-token context.
constexpr int64_t kMaxSteps = int64_t{1} << 19;    // work units: nodes evaluated, items iterated, 256 bytes built or copied
constexpr size_t kMaxOutput = size_t{1} << 24;     // bytes of any string the template builds
constexpr int64_t kMaxItems = int64_t{1} << 18;    // items of a list the template builds
constexpr int kMaxNesting = 200;                   // parser recursion (nested expressions/blocks)
constexpr int kMaxCallDepth = 64;                  // macro calls within macro calls
// Statements and expressions being evaluated, within each other: the two bounds above multiply
// (a macro body nested 80 deep calling itself 64 times overflowed the stack). A level takes about
// 6 KB of stack under AddressSanitizer, so 500 fit a thread's 8 MB with room for the walks below.
constexpr int kMaxRenderDepth = 500;
constexpr int kMaxValueDepth = 200;                // lists and dicts within each other (Value::holds)

// ---------------------------------------------------------------------------------------------
// Values: Python's types as jinja2 sees them. Lists and dicts are shared (a namespace() assigned
// to two names is one object); dicts keep insertion order, keys are strings.
//
// Values stay acyclic and shallow, so that the recursive walks over them (repr, tojson, ==,
// ordering, the destructor) cannot overflow the stack: a list or dict is built at most
// kMaxValueDepth levels deep, and a namespace() never holds a namespace() (the only mutable
// value, it is the only way to a cycle or to a chain that deepens after it was built). A list
// holding a namespace() records the namespace's depth when built; its attributes, checked the same
// way, may deepen it later by at most kMaxValueDepth, so every walk stays within 2 * kMaxValueDepth + 1.

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};
using Function = std::function<Value(Args&)>;

// An error without a position; the evaluator adds the position of the construct that raised it.
struct Fail {
  std::string msg;
};

// The work budget of the render running on this thread (see Renderer::run); helpers that loop over
// items or bytes charge it, so that every render ends within kMaxSteps units.
thread_local int64_t* t_steps_left = nullptr;

void charge(int64_t units) {
  if (t_steps_left && (*t_steps_left -= units) < 0) throw Fail{cat("the template takes more than ", kMaxSteps, " steps")};
}

// A value's string, whose copies are charged like the strings a template builds (a unit per 256
// bytes): values are copied freely (list items, loop variables, [s] * n), and copies of one long
// string must not outgrow memory before the budget ends the render.
struct ChargedString : std::string {
  using std::string::string;
  using std::string::operator=;
  ChargedString() = default;
  ChargedString(const ChargedString& o) : std::string((charge(static_cast<int64_t>(o.size() / 256)), o)) {}
  ChargedString(ChargedString&&) noexcept = default;
  ChargedString& operator=(const ChargedString& o) {
    charge(static_cast<int64_t>(o.size() / 256));
    std::string::operator=(o);
    return *this;
  }
  ChargedString& operator=(ChargedString&&) noexcept = default;
};

struct Value {
  enum Kind { kUndefined, kNone, kBool, kInt, kFloat, kStr, kList, kDict, kFunc };
  Kind kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  ChargedString s;  // the string; for an undefined value, what was missing
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Function> fn;
  bool is_namespace = false;  // a namespace(): its attributes may be assigned
  bool is_tuple = false;      // a list that prints as a Python tuple
  int depth = 0;              // levels of lists and dicts, this one included, when it was built
  bool has_namespace = false; // is or holds a namespace()

  static Value undefined(std::string what) { Value v; v.s = std::move(what); return v; }
  static Value none() { Value v; v.kind = kNone; return v; }
  static Value boolean(bool x) { Value v; v.kind = kBool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = kInt; v.i = x; return v; }
  static Value number(double x) { Value v; v.kind = kFloat; v.f = x; return v; }
  static Value str(std::string x) { Value v; v.kind = kStr; v.s = std::move(x); return v; }
  static Value of_list(List x) {
    Value v;
    v.kind = kList;
    v.depth = 1;
    for (const Value& e : x) v.holds(e);
    v.list = std::make_shared<List>(std::move(x));
    return v;
  }
  static Value of_dict(Dict x) {
    Value v;
    v.kind = kDict;
    v.depth = 1;
    for (const auto& e : x) v.holds(e.second);
    v.dict = std::make_shared<Dict>(std::move(x));
    return v;
  }
  static Value function(Function x) { Value v; v.kind = kFunc; v.fn = std::make_shared<Function>(std::move(x)); return v; }

  bool defined() const { return kind != kUndefined; }
  bool numeric() const { return kind == kInt || kind == kFloat || kind == kBool; }
  double as_double() const { return kind == kFloat ? f : static_cast<double>(kind == kBool ? b : i); }
  int64_t as_int() const { return kind == kBool ? b : i; }

 private:
  // Accounts for `e`, an item of this list or dict being built.
  void holds(const Value& e) {
    depth = std::max(depth, e.depth + 1);
    if (depth > kMaxValueDepth) throw Fail{cat("the template builds a value nested deeper than ", kMaxValueDepth, " levels")};
    has_namespace = has_namespace || e.has_namespace;
  }
};

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined: return "undefined";
    case Value::kNone: return "none";
    case Value::kBool: return "bool";
    case Value::kInt: return "int";
    case Value::kFloat: return "float";
    case Value::kStr: return "str";
    case Value::kList: return "list";
    case Value::kDict: return v.is_namespace ? "namespace" : "dict";
    case Value::kFunc: return "function";
  }
  return "?";
}

// See Value: why a namespace() holds no namespace().
constexpr const char* kNamespaceInNamespace =
    "a namespace() cannot hold a namespace(), directly or in a list or dict (it could come to hold itself)";

[[noreturn]] void fail_undefined(const Value& v) { throw Fail{cat("'", v.s, "' is undefined")}; }

// Byte offsets where the code points of `s` start, then s.size(); an invalid byte is one code
// point of its own (Python strings index by code point).
std::vector<size_t> char_bounds(std::string_view s) {
  charge(static_cast<int64_t>(s.size() / 16));
  std::vector<size_t> out;
  for (size_t p = 0; p < s.size();) {
    out.push_back(p);
    uint32_t cp = 0;
    p += std::max<size_t>(utf8::decode(s, p, cp), 1);
  }
  out.push_back(s.size());
  return out;
}

int64_t char_count(std::string_view s) {
  charge(static_cast<int64_t>(s.size() / 256));
  int64_t n = 0;
  for (size_t p = 0; p < s.size(); ++n) {
    uint32_t cp = 0;
    p += std::max<size_t>(utf8::decode(s, p, cp), 1);
  }
  return n;
}

// Code points of a string, each as its UTF-8 bytes.
std::vector<std::string> chars(const std::string& s) {
  const std::vector<size_t> b = char_bounds(s);
  std::vector<std::string> out;
  for (size_t k = 0; k + 1 < b.size(); ++k) out.push_back(s.substr(b[k], b[k + 1] - b[k]));
  return out;
}

bool is_space(std::string_view ch) {
  uint32_t cp = 0;
  if (utf8::decode(ch, 0, cp) != ch.size()) return false;
  return utf8::is_whitespace(cp) || (cp >= 0x1c && cp <= 0x1f);  // Python's str.isspace()
}

// Python's repr() of a float: the shortest round-tripping digits, exponent form outside [1e-4, 1e16).
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*e", p - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string m = buf;
  const size_t e = m.find('e');
  const int exp = std::stoi(m.substr(e + 1));
  std::string digits;
  for (char c : m.substr(0, e))
    if (c >= '0' && c <= '9') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const std::string sign = std::signbit(x) ? "-" : "";
  if (exp < -4 || exp >= 16) {
    std::string out = sign + digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return out + eb;
  }
  if (exp < 0) return sign + "0." + std::string(-exp - 1, '0') + digits;
  if (static_cast<int>(digits.size()) <= exp + 1) return sign + digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  return sign + digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
}

std::string str_repr(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\' || c == static_cast<unsigned char>(q)) out += {'\\', static_cast<char>(c)};
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", c); out += b; }
    else out += static_cast<char>(c);
  }
  return out + q;
}

// Checks the size `n` of a string about to be built and charges the work of building its last
// `new_bytes` bytes (all of it by default).
void check_size(size_t n, size_t new_bytes) {
  if (n > kMaxOutput) throw Fail{cat("the template builds a string longer than ", kMaxOutput, " bytes")};
  charge(static_cast<int64_t>(new_bytes / 256));
}
void check_size(size_t n) { check_size(n, n); }

// Appends `piece` to `out`, a string that a walk over a value builds (repr, tojson): a walk over
// a list that holds one long string many times must stay within the output bound too.
void append(std::string& out, std::string_view piece) {
  check_size(out.size() + piece.size(), piece.size());
  out += piece;
}

std::string repr(const Value& v);

// Python's str() of a value, which {{ }} prints.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined: return "";
    case Value::kNone: return "None";
    case Value::kBool: return v.b ? "True" : "False";
    case Value::kInt: return std::to_string(v.i);
    case Value::kFloat: return float_repr(v.f);
    case Value::kStr: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::kStr: return str_repr(v.s);
    case Value::kList: {
      charge(static_cast<int64_t>(v.list->size()));
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) append(out, (k ? ", " : "") + repr((*v.list)[k]));
      if (v.is_tuple) return out + (v.list->size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Value::kDict: {
      charge(static_cast<int64_t>(v.dict->size()));
      std::string out = v.is_namespace ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        append(out, (k ? ", " : "") + str_repr((*v.dict)[k].first) + ": " + repr((*v.dict)[k].second));
      return out + (v.is_namespace ? "}>" : "}");
    }
    case Value::kFunc: return "<function>";
    default: return to_str(v);
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined: case Value::kNone: return false;
    case Value::kBool: return v.b;
    case Value::kInt: return v.i != 0;
    case Value::kFloat: return v.f != 0;
    case Value::kStr: return !v.s.empty();
    case Value::kList: return !v.list->empty();
    case Value::kDict: return v.is_namespace || !v.dict->empty();
    case Value::kFunc: return true;
  }
  return false;
}

bool equal(const Value& a, const Value& b) {
  if (a.numeric() && b.numeric())
    return a.kind == Value::kFloat || b.kind == Value::kFloat ? a.as_double() == b.as_double() : a.as_int() == b.as_int();
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::kUndefined: case Value::kNone: return true;
    case Value::kStr: return a.s == b.s;
    case Value::kList:
      if (a.list->size() != b.list->size()) return false;
      charge(static_cast<int64_t>(a.list->size()));
      return std::equal(a.list->begin(), a.list->end(), b.list->begin(), equal);
    case Value::kDict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& entry : *a.dict) {
        charge(static_cast<int64_t>(b.dict->size()));  // the search for its key
        auto it = std::find_if(b.dict->begin(), b.dict->end(), [&](const auto& e) { return e.first == entry.first; });
        if (it == b.dict->end() || !equal(entry.second, it->second)) return false;
      }
      return true;
    default: return a.fn == b.fn;
  }
}

// -1, 0, 1 as Python orders numbers, strings and lists; other pairs cannot be ordered.
int compare(const Value& a, const Value& b) {
  if (a.numeric() && b.numeric()) {
    if (a.kind != Value::kFloat && b.kind != Value::kFloat) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    return a.as_double() < b.as_double() ? -1 : a.as_double() > b.as_double();
  }
  if (a.kind == Value::kStr && b.kind == Value::kStr) return a.s < b.s ? -1 : a.s > b.s;
  if (a.kind == Value::kList && b.kind == Value::kList) {
    charge(static_cast<int64_t>(std::min(a.list->size(), b.list->size())));
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k)
      if (int c = compare((*a.list)[k], (*b.list)[k])) return c;
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
  }
  if (!a.defined()) fail_undefined(a);
  if (!b.defined()) fail_undefined(b);
  throw Fail{cat("cannot order ", type_name(a), " and ", type_name(b))};
}

// `j` as a value; `level` counts the arrays and objects it is in, itself included.
Value from_json(const json& j, int level = 1) {
  if ((j.is_array() || j.is_object()) && level > kMaxValueDepth)
    throw Error(cat("chat template context: a value nests deeper than ", kMaxValueDepth, " levels"));
  switch (j.type()) {
    case json::value_t::null: return Value::none();
    case json::value_t::boolean: return Value::boolean(j.get<bool>());
    case json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case json::value_t::number_unsigned: return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case json::value_t::number_float: return Value::number(j.get<double>());
    case json::value_t::string: return Value::str(j.get<std::string>());
    case json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x, level + 1));
      return Value::of_list(std::move(l));
    }
    case json::value_t::object: {
      Dict d;
      for (const auto& [k, x] : j.items()) d.emplace_back(k, from_json(x, level + 1));
      return Value::of_dict(std::move(d));
    }
    default: throw Error("chat template context: binary JSON values are not supported");
  }
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c == '\b') out += "\\b";
    else if (c == '\f') out += "\\f";
    else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); out += b; }
    else out += static_cast<char>(c);
  }
  return out + "\"";
}

// Python's json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys): transformers'
// tojson filter. indent < 0: one line with ", " and ": ".
void to_json(const Value& v, int indent, bool sort_keys, int level, std::string& out) {
  const std::string nl = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent) * (level + 1), ' ');
  const std::string close = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent) * level, ' ');
  const char* sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::kNone: out += "null"; return;
    case Value::kBool: out += v.b ? "true" : "false"; return;
    case Value::kInt: out += std::to_string(v.i); return;
    case Value::kFloat:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : float_repr(v.f);
      return;
    case Value::kStr: append(out, json_string(v.s)); return;
    case Value::kList:
      if (v.list->empty()) { out += "[]"; return; }
      charge(static_cast<int64_t>(v.list->size()));
      out += "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        append(out, (k ? sep : "") + nl);
        to_json((*v.list)[k], indent, sort_keys, level + 1, out);
      }
      append(out, close + "]");
      return;
    case Value::kDict: {
      if (v.dict->empty()) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& e : *v.dict) items.push_back(&e);
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      charge(static_cast<int64_t>(items.size()));
      out += "{";
      for (size_t k = 0; k < items.size(); ++k) {
        append(out, (k ? sep : "") + nl + json_string(items[k]->first) + ": ");
        to_json(items[k]->second, indent, sort_keys, level + 1, out);
      }
      append(out, close + "}");
      return;
    }
    default: throw Fail{cat("tojson: a ", type_name(v), " value is not JSON serializable")};
  }
}

// ---------------------------------------------------------------------------------------------
// Lexer: the source becomes text pieces and the tokens inside {{ }} and {% %} tags, with the
// whitespace rules of jinja2 (trim_blocks, lstrip_blocks, '-' and '+' modifiers) applied.

enum class Tok { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, Str, Int, Float, Op, Eof };

struct Token {
  Tok type;
  std::string text;  // text, name, string value or operator
  size_t pos;        // byte offset in the source
  int64_t i = 0;
  double f = 0;
};

std::string line_col(const std::string& src, size_t pos) {
  pos = std::min(pos, src.size());
  const size_t line = 1 + std::count(src.begin(), src.begin() + pos, '\n');
  const size_t start = src.rfind('\n', pos == 0 ? 0 : pos - 1);
  const size_t col = pos == 0 || start == std::string::npos ? pos + 1 : pos - start;
  return cat(line, ":", col);
}

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& where) : src_(src), where_(where) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t start = pos;
      char kind = 0;
      while ((start = src_.find('{', start)) != std::string::npos) {
        if (start + 1 < src_.size() && (src_[start + 1] == '{' || src_[start + 1] == '%' || src_[start + 1] == '#')) {
          kind = src_[start + 1];
          break;
        }
        ++start;
      }
      if (start == std::string::npos) {
        push_text(src_.substr(pos), pos);
        break;
      }
      std::string text = src_.substr(pos, start - pos);
      const char mod = start + 2 < src_.size() ? src_[start + 2] : 0;
      const bool block_like = kind == '%' || kind == '#';
      if (mod == '-') {
        text.erase(text.find_last_not_of(" \t\n\r\v\f") + 1);
      } else if (block_like && mod != '+') {
        // lstrip_blocks: spaces and tabs between a line start and a block tag go.
        const size_t l = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l > 0 || line_starting) && text.find_first_not_of(" \t", l) == std::string::npos) text.erase(l);
      }
      push_text(text, pos);
      size_t inner = start + 2 + (mod == '-' || mod == '+' ? 1 : 0);
      size_t end = 0;  // just past the closing delimiter
      bool strip_after = false;
      if (kind == '#') {
        const size_t close = src_.find("#}", inner);
        if (close == std::string::npos) fail(start, "unterminated comment '{#' (no '#}')");
        strip_after = close > inner && src_[close - 1] == '-';
        end = close + 2;
      } else {
        out_.push_back({kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", start});
        end = lex_tag(inner, kind == '{' ? '}' : '%', start, strip_after);
      }
      pos = end;
      if (strip_after) {
        while (pos < src_.size() && std::string_view(" \t\n\r\v\f").find(src_[pos]) != std::string_view::npos) ++pos;
      } else if (block_like && pos < src_.size() && src_[pos] == '\n') {
        ++pos;  // trim_blocks: the newline after a block tag goes
      }
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    out_.push_back({Tok::Eof, "", src_.size()});
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& msg) const {
    throw Error(cat(where_, ":", line_col(src_, pos), ": ", msg));
  }

  void push_text(const std::string& text, size_t pos) {
    if (!text.empty()) out_.push_back({Tok::Text, text, pos});
  }

  // Tokens of a tag's inside from `p` up to its closing "}}" or "%}" (outside brackets);
  // returns the offset past it.
  size_t lex_tag(size_t p, char close, size_t open, bool& strip_after) {
    int depth = 0;
    const std::string end_tok = std::string(1, close) + "}";
    while (true) {
      while (p < src_.size() && std::isspace(static_cast<unsigned char>(src_[p]))) ++p;
      if (p >= src_.size()) fail(open, cat("unterminated tag '", src_.substr(open, 2), "' (no '", end_tok, "')"));
      if (depth == 0 && src_.compare(p, 3, "-" + end_tok) == 0) {
        strip_after = true;
        out_.push_back({close == '}' ? Tok::VarEnd : Tok::BlockEnd, "", p});
        return p + 3;
      }
      if (depth == 0 && src_.compare(p, 2, end_tok) == 0) {
        out_.push_back({close == '}' ? Tok::VarEnd : Tok::BlockEnd, "", p});
        return p + 2;
      }
      const char c = src_[p];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t q = p;
        while (q < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[q])) || src_[q] == '_')) ++q;
        out_.push_back({Tok::Name, src_.substr(p, q - p), p});
        p = q;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        p = lex_number(p);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p);
      } else {
        static const char* const two[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* t : two)
          if (src_.compare(p, 2, t) == 0) op = t;
        if (op.size() == 1 && std::string_view("+-*/%~<>()[]{}.,:|=").find(c) == std::string_view::npos)
          fail(p, cat("unexpected character '", c, "' in a tag"));
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        out_.push_back({Tok::Op, op, p});
        p += op.size();
      }
    }
  }

  size_t lex_number(size_t p) {
    size_t q = p;
    auto digits = [&] { while (q < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[q])) || src_[q] == '_')) ++q; };
    digits();
    bool is_float = false;
    if (q + 1 < src_.size() && src_[q] == '.' && std::isdigit(static_cast<unsigned char>(src_[q + 1]))) {
      is_float = true;
      ++q;
      digits();
    }
    if (q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
      size_t r = q + 1;
      if (r < src_.size() && (src_[r] == '+' || src_[r] == '-')) ++r;
      if (r < src_.size() && std::isdigit(static_cast<unsigned char>(src_[r]))) {
        is_float = true;
        q = r;
        digits();
      }
    }
    std::string text = src_.substr(p, q - p);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Token t{is_float ? Tok::Float : Tok::Int, text, p};
    errno = 0;
    if (is_float) t.f = std::strtod(text.c_str(), nullptr);
    else t.i = std::strtoll(text.c_str(), nullptr, 10);
    if (errno == ERANGE) fail(p, cat("number '", text, "' is out of range"));
    out_.push_back(t);
    return q;
  }

  size_t lex_string(size_t p) {
    const char q = src_[p];
    std::string s;
    size_t k = p + 1;
    for (; k < src_.size() && src_[k] != q; ++k) {
      if (src_[k] != '\\' || k + 1 >= src_.size()) {
        s += src_[k];
        continue;
      }
      const char e = src_[++k];
      switch (e) {
        case 'n': s += '\n'; break;
        case 't': s += '\t'; break;
        case 'r': s += '\r'; break;
        case '0': s += '\0'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'v': s += '\v'; break;
        case 'a': s += '\a'; break;
        case '\\': case '\'': case '"': s += e; break;
        case '\n': break;  // a line continuation
        case 'x': case 'u': case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (k + n >= src_.size() || src_.substr(k + 1, n).find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
            fail(k - 1, cat("bad escape '\\", e, "' in a string literal"));
          utf8::append(s, static_cast<uint32_t>(std::stoul(src_.substr(k + 1, n), nullptr, 16)));
          k += n;
          break;
        }
        default: s += '\\'; s += e;  // Python keeps unknown escapes as they are
      }
    }
    if (k >= src_.size()) fail(p, "unterminated string literal");
    out_.push_back({Tok::Str, s, p});
    return k + 1;
  }

  const std::string& src_;
  const std::string& where_;
  std::vector<Token> out_;
};

// ---------------------------------------------------------------------------------------------
// Syntax tree.

enum class N {
  // statements
  Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Group,
  // expressions
  Lit, Name, ListLit, DictLit, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not, And, Or, Cond,
  Binary, Compare,
};

struct Node;
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct Node {
  N kind;
  size_t pos = 0;
  std::string name;                // name, attribute, filter, test or operator; Set: the namespace;
                                   // ListLit: "tuple" for a tuple
  std::string attr;                // Set: the attribute of a namespace assignment
  std::vector<std::string> names;  // For/Set targets, Macro parameters, keyword argument names, Compare ops
  std::vector<NodeP> kids;         // operands; for calls, positional then keyword arguments
  Body body, orelse;
  Value lit;
  bool negated = false;  // Test: `is not`
};

NodeP node(N kind, size_t pos) {
  auto n = std::make_unique<Node>();
  n->kind = kind;
  n->pos = pos;
  return n;
}

// ---------------------------------------------------------------------------------------------
// Parser.

class Parser {
 public:
  Parser(std::vector<Token> toks, const std::string& src, const std::string& where)
      : t_(std::move(toks)), src_(src), where_(where) {}

  Body run() {
    std::string found;
    Body b = subparse({}, found, 0);
    return b;
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& msg) const {
    throw Error(cat(where_, ":", line_col(src_, pos), ": ", msg));
  }
  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).type == Tok::Op && peek(k).text == op; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).type == Tok::Name && peek(k).text == n; }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case Tok::Eof: return "the end of the template";
      case Tok::VarEnd: return "'}}'";
      case Tok::BlockEnd: return "'%}'";
      case Tok::Text: return "text";
      case Tok::Str: return "a string";
      case Tok::Int: case Tok::Float: return cat("number ", t.text);
      default: return cat("'", t.text, "'");
    }
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(peek().pos, cat("expected '", op, "', found ", describe(peek())));
    next();
  }
  std::string expect_name(const char* what) {
    if (peek().type != Tok::Name) fail(peek().pos, cat("expected ", what, ", found ", describe(peek())));
    return next().text;
  }
  void expect_block_end(const std::string& stmt) {
    if (peek().type != Tok::BlockEnd)
      fail(peek().pos, cat("expected '%}' to end '", stmt, "', found ", describe(peek())));
    next();
  }
  struct Nest {
    Nest(Parser& p, size_t pos) : p(p) {
      if (++p.depth_ > kMaxNesting) p.fail(pos, cat("the template nests deeper than ", kMaxNesting, " levels"));
    }
    ~Nest() { --p.depth_; }
    Parser& p;
  };
  // A loop that folds operators or postfixes to the left (a ~ b ~ c, x.y[0]|f) deepens the tree by
  // one level each, which evaluating it recurses through: counted as nesting until the fold ends.
  struct Fold {
    explicit Fold(Parser& p) : p(p) {}
    ~Fold() { p.depth_ -= levels; }
    Fold(const Fold&) = delete;
    Fold& operator=(const Fold&) = delete;
    void deeper(size_t pos) {
      ++levels;
      if (++p.depth_ > kMaxNesting) p.fail(pos, cat("the template nests deeper than ", kMaxNesting, " levels"));
    }
    Parser& p;
    int levels = 0;
  };

  // Statements and text until a block tag whose keyword is one of `ends` (consumed, returned in
  // `found`); with no `ends`, until the end of the source.
  Body subparse(const std::vector<std::string>& ends, std::string& found, size_t open) {
    Nest nest(*this, open);
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::Eof) {
        if (ends.empty()) return body;
        fail(open, cat("this block is never closed (expected '{% ", ends.back(), " %}' before the end)"));
      }
      if (t.type == Tok::Text) {
        auto n = node(N::Text, t.pos);
        n->lit = Value::str(next().text);
        body.push_back(std::move(n));
      } else if (t.type == Tok::VarBegin) {
        next();
        auto n = node(N::Output, t.pos);
        n->kids.push_back(expr());
        if (peek().type != Tok::VarEnd) fail(peek().pos, cat("expected '}}', found ", describe(peek())));
        next();
        body.push_back(std::move(n));
      } else if (t.type == Tok::BlockBegin) {
        next();
        const size_t pos = peek().pos;
        const std::string kw = expect_name("a statement keyword");
        if (std::find(ends.begin(), ends.end(), kw) != ends.end()) {
          found = kw;
          return body;
        }
        body.push_back(statement(kw, pos));
      } else {
        fail(t.pos, cat("unexpected ", describe(t)));
      }
    }
  }

  NodeP statement(const std::string& kw, size_t pos) {
    std::string found;
    if (kw == "if") return if_rest(pos);
    if (kw == "for") {
      auto n = node(N::For, pos);
      n->names.push_back(expect_name("a loop variable"));
      while (is_op(",")) {
        next();
        n->names.push_back(expect_name("a loop variable"));
      }
      if (!is_name("in")) fail(peek().pos, cat("expected 'in' in 'for', found ", describe(peek())));
      next();
      n->kids.push_back(expr(/*with_condition=*/false));
      if (is_name("if")) {
        next();
        n->kids.push_back(expr());
      }
      if (is_name("recursive")) fail(peek().pos, "recursive for loops are not supported");
      expect_block_end("for");
      ++loops_;
      n->body = subparse({"else", "endfor"}, found, pos);
      --loops_;
      if (found == "else") {
        expect_block_end("else");
        n->orelse = subparse({"endfor"}, found, pos);
      }
      expect_block_end("endfor");
      return n;
    }
    if (kw == "set") {
      const std::string first = expect_name("a variable name after 'set'");
      auto n = node(N::Set, pos);
      if (is_op(".")) {
        next();
        n->name = first;
        n->attr = expect_name("an attribute name");
      } else {
        n->names.push_back(first);
        while (is_op(",")) {
          next();
          n->names.push_back(expect_name("a variable name"));
        }
      }
      if (is_op("=")) {
        next();
        n->kids.push_back(tuple_expr());
        expect_block_end("set");
        return n;
      }
      if (!n->attr.empty() || n->names.size() != 1) fail(peek().pos, "a block 'set' assigns one plain name");
      expect_block_end("set");
      n->kind = N::SetBlock;
      n->body = subparse({"endset"}, found, pos);
      expect_block_end("endset");
      return n;
    }
    if (kw == "macro") {
      auto n = node(N::Macro, pos);
      n->name = expect_name("a macro name");
      expect_op("(");
      while (!is_op(")")) {
        n->names.push_back(expect_name("a macro parameter"));
        if (is_op("=")) {
          next();
          n->kids.push_back(expr());
        } else {
          n->kids.push_back(nullptr);
        }
        if (!is_op(")")) expect_op(",");
      }
      next();
      expect_block_end("macro");
      const int loops = std::exchange(loops_, 0);
      n->body = subparse({"endmacro"}, found, pos);
      loops_ = loops;
      expect_block_end("endmacro");
      return n;
    }
    if (kw == "break" || kw == "continue") {
      if (loops_ == 0) fail(pos, cat("'", kw, "' outside a for loop"));
      expect_block_end(kw);
      return node(kw == "break" ? N::Break : N::Continue, pos);
    }
    if (kw == "generation") {  // transformers' assistant-mask marker: renders its body
      expect_block_end(kw);
      auto n = node(N::Group, pos);
      n->body = subparse({"endgeneration"}, found, pos);
      expect_block_end("endgeneration");
      return n;
    }
    static const char* const known_ends[] = {"endif", "endfor", "endset", "endmacro", "else", "elif", "endgeneration"};
    for (const char* e : known_ends)
      if (kw == e) fail(pos, cat("'{% ", kw, " %}' without a block it could end"));
    fail(pos, cat("unknown or unsupported statement '", kw, "'"));
  }

  NodeP if_rest(size_t pos) {
    auto n = node(N::If, pos);
    n->kids.push_back(expr());
    expect_block_end("if");
    std::string found;
    n->body = subparse({"elif", "else", "endif"}, found, pos);
    if (found == "elif") {
      n->orelse.push_back(if_rest(pos));
      return n;
    }
    if (found == "else") {
      expect_block_end("else");
      n->orelse = subparse({"endif"}, found, pos);
    }
    expect_block_end("endif");
    return n;
  }

  // An expression, or several separated by commas (a tuple).
  NodeP tuple_expr() {
    const size_t pos = peek().pos;
    NodeP first = expr();
    if (!is_op(",")) return first;
    auto n = node(N::ListLit, pos);
    n->name = "tuple";
    n->kids.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (is_op(")") || peek().type == Tok::BlockEnd) break;  // a trailing comma: (1,)
      n->kids.push_back(expr());
    }
    return n;
  }

  NodeP expr(bool with_condition = true) {
    Nest nest(*this, peek().pos);
    NodeP a = or_expr();
    Fold fold(*this);
    while (with_condition && is_name("if")) {
      fold.deeper(peek().pos);
      auto n = node(N::Cond, next().pos);
      n->kids.push_back(or_expr());  // condition
      n->kids.push_back(std::move(a));
      if (is_name("else")) {
        next();
        n->kids.push_back(expr());
      }
      a = std::move(n);
    }
    return a;
  }

  NodeP binary(N kind, NodeP a, NodeP b, size_t pos, std::string op = "") {
    auto n = node(kind, pos);
    n->name = std::move(op);
    n->kids.push_back(std::move(a));
    n->kids.push_back(std::move(b));
    return n;
  }

  // operand (keyword operand)*, folded to the left.
  NodeP left_fold(const char* keyword, N kind, NodeP (Parser::*operand)()) {
    NodeP a = (this->*operand)();
    Fold fold(*this);
    while (is_name(keyword)) {
      const size_t pos = next().pos;
      fold.deeper(pos);
      a = binary(kind, std::move(a), (this->*operand)(), pos);
    }
    return a;
  }
  NodeP or_expr() { return left_fold("or", N::Or, &Parser::and_expr); }
  NodeP and_expr() { return left_fold("and", N::And, &Parser::not_expr); }
  NodeP not_expr() {
    if (is_name("not")) {
      Nest nest(*this, peek().pos);
      auto n = node(N::Not, next().pos);
      n->kids.push_back(not_expr());
      return n;
    }
    return compare();
  }
  NodeP compare() {
    const size_t pos = peek().pos;
    NodeP a = math1();
    NodeP n;
    while (true) {
      std::string op;
      if (peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                     peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!n) {
        n = node(N::Compare, pos);
        n->kids.push_back(std::move(a));
      }
      n->names.push_back(op);
      n->kids.push_back(math1());
    }
    return n ? std::move(n) : std::move(a);
  }
  NodeP math1() {
    NodeP a = concat();
    Fold fold(*this);
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      fold.deeper(t.pos);
      a = binary(N::Binary, std::move(a), concat(), t.pos, t.text);
    }
    return a;
  }
  NodeP concat() {
    NodeP a = math2();
    Fold fold(*this);
    while (is_op("~")) {
      const Token& t = next();
      fold.deeper(t.pos);
      a = binary(N::Binary, std::move(a), math2(), t.pos, "~");
    }
    return a;
  }
  NodeP math2() {
    NodeP a = power();
    Fold fold(*this);
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      fold.deeper(t.pos);
      a = binary(N::Binary, std::move(a), power(), t.pos, t.text);
    }
    return a;
  }
  NodeP power() {
    NodeP a = unary(true);
    Fold fold(*this);
    while (is_op("**")) {
      const Token& t = next();
      fold.deeper(t.pos);
      a = binary(N::Binary, std::move(a), unary(true), t.pos, "**");
    }
    return a;
  }
  NodeP unary(bool with_filter) {
    Nest nest(*this, peek().pos);
    NodeP a;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      a = node(t.text == "-" ? N::Neg : N::Pos, t.pos);
      a->kids.push_back(unary(false));
    } else {
      a = primary();
    }
    a = postfix(std::move(a));
    return with_filter ? filters(std::move(a)) : std::move(a);
  }

  NodeP primary() {
    const Token& t = peek();
    if (t.type == Tok::Name) {
      next();
      auto n = node(N::Lit, t.pos);
      if (t.text == "true" || t.text == "True") n->lit = Value::boolean(true);
      else if (t.text == "false" || t.text == "False") n->lit = Value::boolean(false);
      else if (t.text == "none" || t.text == "None") n->lit = Value::none();
      else { n->kind = N::Name; n->name = t.text; }
      return n;
    }
    if (t.type == Tok::Str) {
      std::string s;
      while (peek().type == Tok::Str) s += next().text;  // adjacent literals concatenate
      auto n = node(N::Lit, t.pos);
      n->lit = Value::str(std::move(s));
      return n;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      next();
      auto n = node(N::Lit, t.pos);
      n->lit = t.type == Tok::Int ? Value::integer(t.i) : Value::number(t.f);
      return n;
    }
    if (is_op("(")) {
      next();
      if (is_op(")")) {
        next();
        auto n = node(N::ListLit, t.pos);
        n->name = "tuple";
        return n;
      }
      NodeP inner = tuple_expr();
      expect_op(")");
      return inner;
    }
    if (is_op("[")) {
      next();
      auto n = node(N::ListLit, t.pos);
      while (!is_op("]")) {
        n->kids.push_back(expr());
        if (!is_op("]")) expect_op(",");
      }
      next();
      return n;
    }
    if (is_op("{")) {
      next();
      auto n = node(N::DictLit, t.pos);
      while (!is_op("}")) {
        n->kids.push_back(expr());
        expect_op(":");
        n->kids.push_back(expr());
        if (!is_op("}")) expect_op(",");
      }
      next();
      return n;
    }
    fail(t.pos, cat("expected an expression, found ", describe(t)));
  }

  // `callee(...)`, one nesting level deeper.
  NodeP call(NodeP callee, Fold& fold) {
    fold.deeper(peek().pos);
    auto n = node(N::Call, callee->pos);
    n->kids.push_back(std::move(callee));
    call_args(*n);
    return n;
  }

  void call_args(Node& n) {
    expect_op("(");
    std::vector<NodeP> kw;
    while (!is_op(")")) {
      if (peek().type == Tok::Name && is_op("=", 1)) {
        n.names.push_back(next().text);
        next();
        kw.push_back(expr());
      } else {
        if (!kw.empty()) fail(peek().pos, "a positional argument after a keyword argument");
        n.kids.push_back(expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    next();
    for (auto& k : kw) n.kids.push_back(std::move(k));
  }

  NodeP postfix(NodeP a) {
    Fold fold(*this);
    while (true) {
      if (is_op(".")) {
        const size_t pos = next().pos;
        fold.deeper(pos);
        if (peek().type == Tok::Int) {
          auto n = node(N::Item, pos);
          auto key = node(N::Lit, peek().pos);
          key->lit = Value::integer(next().i);
          n->kids.push_back(std::move(a));
          n->kids.push_back(std::move(key));
          a = std::move(n);
        } else {
          auto n = node(N::Attr, pos);
          n->name = expect_name("an attribute name after '.'");
          n->kids.push_back(std::move(a));
          a = std::move(n);
        }
      } else if (is_op("[")) {
        const size_t pos = next().pos;
        fold.deeper(pos);
        NodeP parts[3];
        int colons = 0;
        while (!is_op("]")) {
          if (is_op(":")) {
            if (++colons > 2) fail(peek().pos, "a slice takes at most start:stop:step");
            next();
          } else {
            if (parts[colons]) fail(peek().pos, cat("expected ']' or ':', found ", describe(peek())));
            parts[colons] = expr();
          }
        }
        next();
        if (colons == 0 && !parts[0]) fail(pos, "empty subscript '[]'");
        auto n = node(colons == 0 ? N::Item : N::Slice, pos);
        n->kids.push_back(std::move(a));
        for (int k = 0; k < (colons == 0 ? 1 : 3); ++k) n->kids.push_back(std::move(parts[k]));
        a = std::move(n);
      } else if (is_op("(")) {
        a = call(std::move(a), fold);
      } else {
        return a;
      }
    }
  }

  NodeP filters(NodeP a) {
    Fold fold(*this);
    while (true) {
      if (is_op("|")) {
        fold.deeper(next().pos);
        auto n = node(N::Filter, peek().pos);
        n->name = expect_name("a filter name after '|'");
        n->kids.push_back(std::move(a));
        if (is_op("(")) call_args(*n);
        a = std::move(n);
      } else if (is_name("is")) {
        fold.deeper(next().pos);
        auto n = node(N::Test, peek().pos);
        if (is_name("not")) {
          next();
          n->negated = true;
        }
        n->name = peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                             peek().text == ">" || peek().text == "<=" || peek().text == ">=")
                      ? next().text
                      : expect_name("a test name after 'is'");
        n->kids.push_back(std::move(a));
        if (is_op("(")) {
          call_args(*n);
        } else {
          // One argument without parentheses: `x is divisibleby 3`, `x is sameas false`.
          const Token& t = peek();
          static const char* const stop[] = {"else", "or", "and", "is", "in", "not", "if"};
          const bool stops = t.type == Tok::Name && std::any_of(std::begin(stop), std::end(stop),
                                                                [&](const char* s) { return t.text == s; });
          if ((t.type == Tok::Name && !stops) || t.type == Tok::Str || t.type == Tok::Int || t.type == Tok::Float ||
              (t.type == Tok::Op && (t.text == "[" || t.text == "{" || t.text == "-")))
            n->kids.push_back(unary(false));
        }
        a = std::move(n);
      } else if (is_op("(")) {
        a = call(std::move(a), fold);
      } else {
        return a;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loops_ = 0;
  const std::string& src_;
  const std::string& where_;
};

}  // namespace

struct ChatTemplate::Program {
  std::string source, where;
  Body body;
};

namespace {

// ---------------------------------------------------------------------------------------------
// Built-in helpers shared by filters, methods and tests.

int64_t to_index(const Value& v, const char* what) {
  if (v.kind != Value::kInt && v.kind != Value::kBool) throw Fail{cat(what, " must be an integer, found ", type_name(v))};
  return v.as_int();
}

const std::string& need_str(const Value& v, const char* what) {
  if (!v.defined()) fail_undefined(v);
  if (v.kind != Value::kStr) throw Fail{cat(what, " must be a string, found ", type_name(v))};
  return v.s;
}

int64_t length_hint(const Value& v) {
  if (v.kind == Value::kList) return static_cast<int64_t>(v.list->size());
  if (v.kind == Value::kDict) return static_cast<int64_t>(v.dict->size());
  return 0;  // strings are charged by char_bounds()
}

void check_items(size_t n) {
  charge(static_cast<int64_t>(n));
  if (n > static_cast<size_t>(kMaxItems)) throw Fail{cat("the template builds a list longer than ", kMaxItems, " items")};
}

// Items of an iterable: a list's items, a dict's keys, a string's characters; undefined is empty.
List iterate(const Value& v) {
  charge(length_hint(v));
  switch (v.kind) {
    case Value::kUndefined: return {};
    case Value::kList: return *v.list;
    case Value::kDict: {
      List keys;
      for (const auto& e : *v.dict) keys.push_back(Value::str(e.first));
      return keys;
    }
    case Value::kStr: {
      List out;
      for (auto& c : chars(v.s)) out.push_back(Value::str(std::move(c)));
      return out;
    }
    default: throw Fail{cat("a ", type_name(v), " value is not iterable")};
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined: return 0;
    case Value::kStr: return char_count(v.s);
    case Value::kList: return static_cast<int64_t>(v.list->size());
    case Value::kDict: return static_cast<int64_t>(v.dict->size());
    default: throw Fail{cat("a ", type_name(v), " value has no length")};
  }
}

const Value* dict_find(const Dict& d, const std::string& key) {
  charge(static_cast<int64_t>(d.size()));  // a linear search: a dict of many keys read in a loop
  for (const auto& e : d)
    if (e.first == key) return &e.second;
  return nullptr;
}

Value items_of(const Value& v) {
  if (!v.defined()) return Value::of_list({});
  if (v.kind != Value::kDict) throw Fail{cat("items() needs a dict, found ", type_name(v))};
  List out;
  for (const auto& [k, x] : *v.dict) {
    out.push_back(Value::of_list({Value::str(k), x}));
    out.back().is_tuple = true;
  }
  return Value::of_list(std::move(out));
}

// Where `sub` first occurs in `s` at or after `from` (npos if nowhere), charging a unit per search
// (count, split and replace search once per match) and the bytes scanned. glibc's memmem takes
// linear time (Two-Way), where std::string::find compares `sub` at every position: a long needle
// of one repeated character took seconds per search.
size_t find_sub(std::string_view s, std::string_view sub, size_t from = 0) {
  if (from > s.size()) return std::string::npos;
  const void* hit = ::memmem(s.data() + from, s.size() - from, sub.data(), sub.size());
  const size_t at = hit ? static_cast<size_t>(static_cast<const char*>(hit) - s.data()) : std::string::npos;
  charge(1 + static_cast<int64_t>(((hit ? at + sub.size() : s.size()) - from) / 256));
  return at;
}

bool contains(const Value& hay, const Value& needle) {
  switch (hay.kind) {
    case Value::kUndefined: return false;
    case Value::kStr: return find_sub(hay.s, need_str(needle, "the left side of 'in' a string")) != std::string::npos;
    case Value::kList:
      charge(static_cast<int64_t>(hay.list->size()));
      return std::any_of(hay.list->begin(), hay.list->end(), [&](const Value& x) { return equal(x, needle); });
    case Value::kDict: return needle.kind == Value::kStr && dict_find(*hay.dict, needle.s);
    default: throw Fail{cat("'in' needs a string, list or dict on its right, found ", type_name(hay))};
  }
}

std::string strip(const std::string& s, const Value& chars_arg, bool left, bool right) {
  const std::vector<size_t> cb = char_bounds(s);
  const bool whitespace = !chars_arg.defined() || chars_arg.kind == Value::kNone;
  const std::vector<std::string> set = whitespace ? std::vector<std::string>() : chars(need_str(chars_arg, "strip's argument"));
  auto strippable = [&](size_t k) {
    const std::string_view c = std::string_view(s).substr(cb[k], cb[k + 1] - cb[k]);
    return whitespace ? is_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t a = 0, b = cb.size() - 1;
  if (left) while (a < b && strippable(a)) ++a;
  if (right) while (b > a && strippable(b - 1)) --b;
  return s.substr(cb[a], cb[b] - cb[a]);
}

List split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (!sep.defined() || sep.kind == Value::kNone) {  // runs of whitespace, no empty pieces
    const std::vector<size_t> cb = char_bounds(s);
    size_t word = 0;  // start of the current word
    bool in_word = false;
    for (size_t k = 0; k + 1 < cb.size(); ++k) {
      if (is_space(std::string_view(s).substr(cb[k], cb[k + 1] - cb[k]))) {
        if (in_word) out.push_back(Value::str(s.substr(word, cb[k] - word)));
        in_word = false;
      } else if (!in_word) {
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
          out.push_back(Value::str(strip(s.substr(cb[k]), Value::none(), false, true)));
          return out;
        }
        in_word = true;
        word = cb[k];
      }
    }
    if (in_word) out.push_back(Value::str(s.substr(word)));
    return out;
  }
  const std::string& d = need_str(sep, "split's separator");
  if (d.empty()) throw Fail{"split: empty separator"};
  size_t p = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    const size_t q = find_sub(s, d, p);
    if (q == std::string::npos) break;
    out.push_back(Value::str(s.substr(p, q - p)));
    p = q + d.size();
  }
  out.push_back(Value::str(s.substr(p)));
  return out;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) throw Fail{"replace: the string to replace is empty"};
  std::string out;
  size_t p = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t q = find_sub(s, from, p);
    if (q == std::string::npos) break;
    out += s.substr(p, q - p) + to;
    check_size(out.size());
    p = q + from.size();
  }
  return out + s.substr(p);
}

std::string map_ascii(std::string s, int (*f)(int)) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(c));
  return s;
}

std::string capitalize(const std::string& s) {
  std::string out = map_ascii(s, [](int c) { return std::tolower(c); });
  if (!out.empty() && static_cast<unsigned char>(out[0]) < 0x80) out[0] = static_cast<char>(std::toupper(out[0]));
  return out;
}

std::string title(const std::string& s) {
  std::string out = s;
  bool prev_letter = false;
  for (char& c : out) {
    const bool letter = std::isalpha(static_cast<unsigned char>(c)) != 0;
    if (letter) c = static_cast<char>(prev_letter ? std::tolower(c) : std::toupper(c));
    prev_letter = letter;
  }
  return out;
}

bool has_cased(const std::string& s, int (*is_case)(int)) {
  bool any = false;
  for (unsigned char c : s)
    if (std::isalpha(c)) {
      if (!is_case(c)) return false;
      any = true;
    }
  return any;
}

// A Python-style callable bound to fixed parameter names: positional or keyword, with defaults.
struct Params {
  Params(const char* fn, Args& a, std::vector<std::pair<const char*, Value>> spec) : values(spec.size()) {
    if (a.pos.size() > spec.size())
      throw Fail{cat(fn, "() takes at most ", spec.size(), " arguments, found ", a.pos.size())};
    for (size_t k = 0; k < spec.size(); ++k) values[k] = k < a.pos.size() ? a.pos[k] : spec[k].second;
    for (auto& [name, v] : a.kw) {
      size_t k = 0;
      while (k < spec.size() && name != spec[k].first) ++k;
      if (k == spec.size()) throw Fail{cat(fn, "() has no argument '", name, "'")};
      values[k] = v;
    }
  }
  const Value& operator[](size_t k) const { return values[k]; }
  std::vector<Value> values;
};

Value method(const Value& obj, const std::string& name) {
  if (obj.kind == Value::kStr) {
    const std::string s = obj.s;
    auto m = [&](auto f) { return Value::function([s, f](Args& a) { return f(s, a); }); };
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return m([left = name != "rstrip", right = name != "lstrip", name](const std::string& s, Args& a) {
        Params p(name.c_str(), a, {{"chars", Value::none()}});
        return Value::str(strip(s, p[0], left, right));
      });
    if (name == "split" || name == "rsplit")
      return m([name](const std::string& s, Args& a) {
        Params p(name.c_str(), a, {{"sep", Value::none()}, {"maxsplit", Value::integer(-1)}});
        const int64_t maxsplit = to_index(p[1], "maxsplit");
        if (name == "rsplit" && maxsplit >= 0) throw Fail{"rsplit with maxsplit is not supported"};
        return Value::of_list(split(s, p[0], maxsplit));
      });
    if (name == "splitlines")
      return m([](const std::string& s, Args& a) {
        Params p("splitlines", a, {});
        List out;
        size_t b = 0;
        for (size_t k = 0; k < s.size(); ++k)
          if (s[k] == '\n' || s[k] == '\r') {
            out.push_back(Value::str(s.substr(b, k - b)));
            if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
            b = k + 1;
          }
        if (b < s.size()) out.push_back(Value::str(s.substr(b)));
        return Value::of_list(std::move(out));
      });
    if (name == "startswith" || name == "endswith")
      return m([start = name == "startswith", name](const std::string& s, Args& a) {
        Params p(name.c_str(), a, {{"prefix", Value()}});
        List options = p[0].kind == Value::kList ? *p[0].list : List{p[0]};
        for (const Value& o : options) {
          const std::string& x = need_str(o, "the prefix/suffix");
          if (x.size() <= s.size() && s.compare(start ? 0 : s.size() - x.size(), x.size(), x) == 0)
            return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize")
      return m([name](const std::string& s, Args& a) {
        Params p(name.c_str(), a, {});
        if (name == "upper") return Value::str(map_ascii(s, [](int c) { return std::toupper(c); }));
        if (name == "lower") return Value::str(map_ascii(s, [](int c) { return std::tolower(c); }));
        return Value::str(name == "title" ? title(s) : capitalize(s));
      });
    if (name == "replace")
      return m([](const std::string& s, Args& a) {
        Params p("replace", a, {{"old", Value()}, {"new", Value()}, {"count", Value::integer(-1)}});
        return Value::str(replace(s, need_str(p[0], "replace's old"), need_str(p[1], "replace's new"),
                                  to_index(p[2], "replace's count")));
      });
    if (name == "find" || name == "count")
      return m([name](const std::string& s, Args& a) {
        Params p(name.c_str(), a, {{"sub", Value()}});
        const std::string& sub = need_str(p[0], "the substring");
        if (name == "find") {
          const size_t q = find_sub(s, sub);
          return Value::integer(q == std::string::npos ? -1 : char_count(std::string_view(s).substr(0, q)));
        }
        if (sub.empty()) return Value::integer(char_count(s) + 1);
        int64_t n = 0;
        for (size_t q = find_sub(s, sub); q != std::string::npos; q = find_sub(s, sub, q + sub.size())) ++n;
        return Value::integer(n);
      });
    if (name == "join")
      return m([](const std::string& s, Args& a) {
        Params p("join", a, {{"iterable", Value()}});
        std::string out;
        const List items = iterate(p[0]);
        for (size_t k = 0; k < items.size(); ++k) {
          out += (k ? s : "") + need_str(items[k], "an item joined");
          check_size(out.size());
        }
        return Value::str(out);
      });
  } else if (obj.kind == Value::kDict && !obj.is_namespace) {
    const Value d = obj;
    if (name == "items")
      return Value::function([d](Args& a) { Params p("items", a, {}); return items_of(d); });
    if (name == "keys" || name == "values")
      return Value::function([d, keys = name == "keys"](Args& a) {
        Params p(keys ? "keys" : "values", a, {});
        List out;
        for (const auto& [k, x] : *d.dict) out.push_back(keys ? Value::str(k) : x);
        return Value::of_list(std::move(out));
      });
    if (name == "get")
      return Value::function([d](Args& a) {
        Params p("get", a, {{"key", Value()}, {"default", Value::none()}});
        const Value* v = p[0].kind == Value::kStr ? dict_find(*d.dict, p[0].s) : nullptr;
        return v ? *v : p[1];
      });
  }
  return Value::undefined(name);
}

// obj.name: a dict's item or method, a string's method; missing is undefined (an error only when
// the undefined value is used).
Value get_attr(const Value& obj, const std::string& name) {
  if (!obj.defined()) throw Fail{cat("'", obj.s, "' is undefined, so it has no attribute '", name, "'")};
  if (obj.kind == Value::kDict) {
    if (const Value* v = dict_find(*obj.dict, name)) return *v;
  }
  Value m = method(obj, name);
  if (!m.defined()) m.s = name;
  return m;
}

Value get_item(const Value& obj, const Value& key) {
  if (!obj.defined()) throw Fail{cat("'", obj.s, "' is undefined, so it has no item ", repr(key))};
  if (obj.kind == Value::kList || obj.kind == Value::kStr) {
    if (key.kind != Value::kInt && key.kind != Value::kBool) {
      if (key.kind == Value::kStr) return method(obj, key.s);
      throw Fail{cat("a ", type_name(obj), " index must be an integer, found ", type_name(key))};
    }
    std::vector<size_t> cb;
    if (obj.kind == Value::kStr) cb = char_bounds(obj.s);
    const int64_t n = obj.kind == Value::kList ? static_cast<int64_t>(obj.list->size()) : static_cast<int64_t>(cb.size()) - 1;
    int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::undefined(cat(type_name(obj), "[", key.as_int(), "]"));
    return obj.kind == Value::kList ? (*obj.list)[k] : Value::str(obj.s.substr(cb[k], cb[k + 1] - cb[k]));
  }
  if (obj.kind == Value::kDict) {
    if (key.kind == Value::kStr) {
      if (const Value* v = dict_find(*obj.dict, key.s)) return *v;
      return method(obj, key.s).defined() ? method(obj, key.s) : Value::undefined(key.s);
    }
    return Value::undefined(repr(key));
  }
  return Value::undefined(repr(key));
}

Value slice(const Value& obj, const Value& a, const Value& b, const Value& c) {
  auto opt = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (!v.defined() || v.kind == Value::kNone) return std::nullopt;
    return to_index(v, what);
  };
  const int64_t step = opt(c, "a slice step").value_or(1);
  if (step == 0) throw Fail{"slice step cannot be zero"};
  std::vector<size_t> cb;
  if (obj.kind == Value::kStr) cb = char_bounds(obj.s);
  else if (obj.kind != Value::kList) {
    if (!obj.defined()) fail_undefined(obj);
    throw Fail{cat("a ", type_name(obj), " value cannot be sliced")};
  }
  const int64_t n = obj.kind == Value::kList ? static_cast<int64_t>(obj.list->size()) : static_cast<int64_t>(cb.size()) - 1;
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    return step > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t start = clamp(opt(a, "a slice start"), step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(opt(b, "a slice stop"), step > 0 ? n : -1);
  List out;
  std::string s;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
    if (obj.kind == Value::kList) out.push_back((*obj.list)[k]);
    else s.append(obj.s, cb[k], cb[k + 1] - cb[k]);
  }
  return obj.kind == Value::kList ? Value::of_list(std::move(out)) : Value::str(std::move(s));
}

Value arith(const std::string& op, const Value& a, const Value& b) {
  if (!a.defined()) fail_undefined(a);
  if (!b.defined()) fail_undefined(b);
  if (op == "+") {
    if (a.kind == Value::kStr && b.kind == Value::kStr) {
      check_size(a.s.size() + b.s.size());
      return Value::str(a.s + b.s);
    }
    if (a.kind == Value::kList && b.kind == Value::kList) {
      check_items(a.list->size() + b.list->size());
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::of_list(std::move(l));
    }
  }
  if (op == "*" && ((a.kind == Value::kStr || a.kind == Value::kList) && (b.kind == Value::kInt || b.kind == Value::kBool))) {
    const int64_t n = std::max<int64_t>(b.as_int(), 0);
    const size_t unit = a.kind == Value::kStr ? a.s.size() : a.list->size();
    const size_t limit = a.kind == Value::kStr ? kMaxOutput : static_cast<size_t>(kMaxItems);
    if (unit > 0 && static_cast<uint64_t>(n) > limit / unit) {
      if (a.kind == Value::kStr) check_size(kMaxOutput + 1);
      check_items(static_cast<size_t>(kMaxItems) + 1);
    }
    if (a.kind == Value::kStr) check_size(unit * n);
    else check_items(unit * n);
    if (a.kind == Value::kStr) {
      std::string s;
      for (int64_t k = 0; k < n; ++k) s += a.s;
      return Value::str(std::move(s));
    }
    List l;
    for (int64_t k = 0; k < n; ++k) l.insert(l.end(), a.list->begin(), a.list->end());
    return Value::of_list(std::move(l));
  }
  if (op == "*" && (b.kind == Value::kStr || b.kind == Value::kList) && a.numeric()) return arith(op, b, a);
  if (!a.numeric() || !b.numeric()) {
    if (op == "%" && a.kind == Value::kStr) throw Fail{"'%' string formatting is not supported"};
    throw Fail{cat("unsupported operand types for ", op, ": ", type_name(a), " and ", type_name(b))};
  }
  const bool ints = a.kind != Value::kFloat && b.kind != Value::kFloat;
  const int64_t x = a.as_int(), y = b.as_int();
  const double fx = a.as_double(), fy = b.as_double();
  int64_t r = 0;
  if (op == "/") {
    if (fy == 0) throw Fail{"division by zero"};
    return Value::number(fx / fy);
  }
  if (op == "//" || op == "%") {
    if (fy == 0) throw Fail{cat("integer division or modulo by zero")};
    if (ints) {
      if (x == INT64_MIN && y == -1) throw Fail{"integer overflow"};
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) { --q; m += y; }
      return Value::integer(op == "//" ? q : m);
    }
    const double q = std::floor(fx / fy);
    return Value::number(op == "//" ? q : fx - q * fy);
  }
  if (op == "**") {
    if (ints && y >= 0) {
      int64_t acc = 1;
      for (int64_t k = 0; k < y; ++k)
        if (__builtin_mul_overflow(acc, x, &acc)) throw Fail{"integer overflow"};
      return Value::integer(acc);
    }
    return Value::number(std::pow(fx, fy));
  }
  if (!ints) return Value::number(op == "+" ? fx + fy : op == "-" ? fx - fy : fx * fy);
  const bool over = op == "+" ? __builtin_add_overflow(x, y, &r) : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                                                               : __builtin_mul_overflow(x, y, &r);
  if (over) throw Fail{"integer overflow"};
  return Value::integer(r);
}

bool run_test(const std::string& name, const Value& v, const std::vector<Value>& args) {
  auto arg = [&](size_t k) -> const Value& {
    if (k >= args.size()) throw Fail{cat("the test '", name, "' needs an argument")};
    return args[k];
  };
  if (name == "defined") return v.defined();
  if (name == "undefined") return !v.defined();
  if (name == "none") return v.kind == Value::kNone;
  if (name == "boolean") return v.kind == Value::kBool;
  if (name == "true") return v.kind == Value::kBool && v.b;
  if (name == "false") return v.kind == Value::kBool && !v.b;
  if (name == "string") return v.kind == Value::kStr;
  if (name == "number") return v.numeric();
  if (name == "integer") return v.kind == Value::kInt;
  if (name == "float") return v.kind == Value::kFloat;
  if (name == "mapping") return v.kind == Value::kDict;
  if (name == "sequence" || name == "iterable") return v.kind == Value::kStr || v.kind == Value::kList || v.kind == Value::kDict;
  if (name == "callable") return v.kind == Value::kFunc;
  if (name == "odd" || name == "even" || name == "divisibleby") {
    const int64_t x = to_index(v, cat("the value tested '", name, "'").c_str());
    if (name == "divisibleby") {
      const int64_t d = to_index(arg(0), "divisibleby's argument");
      if (d == 0) throw Fail{"divisibleby 0"};
      return x % d == 0;
    }
    return (x % 2 != 0) == (name == "odd");
  }
  if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") return equal(v, arg(0));
  if (name == "ne" || name == "!=") return !equal(v, arg(0));
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg(0)) < 0;
  if (name == "le" || name == "<=") return compare(v, arg(0)) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg(0)) > 0;
  if (name == "ge" || name == ">=") return compare(v, arg(0)) >= 0;
  if (name == "in") return contains(arg(0), v);
  if (name == "lower") return v.kind == Value::kStr && has_cased(v.s, [](int c) { return std::islower(c); });
  if (name == "upper") return v.kind == Value::kStr && has_cased(v.s, [](int c) { return std::isupper(c); });
  throw Fail{cat("unknown test '", name, "'")};
}

// ---------------------------------------------------------------------------------------------
// Renderer: evaluates the tree over a stack of variable scopes (globals first).

class Renderer {
 public:
  Renderer(const ChatTemplate::Program& prog, const json& context) : prog_(prog) {
    scopes_.emplace_back();
    auto& g = scopes_.back();
    g["raise_exception"] = Value::function([](Args& a) -> Value {
      throw Fail{cat("raise_exception: ", a.pos.empty() ? std::string() : to_str(a.pos[0]))};
    });
    g["range"] = Value::function([](Args& a) {
      if (a.pos.empty() || a.pos.size() > 3 || !a.kw.empty()) throw Fail{"range() takes 1 to 3 positional arguments"};
      int64_t start = 0, stop = 0, step = 1;
      if (a.pos.size() == 1) stop = to_index(a.pos[0], "range's stop");
      else { start = to_index(a.pos[0], "range's start"); stop = to_index(a.pos[1], "range's stop"); }
      if (a.pos.size() == 3) step = to_index(a.pos[2], "range's step");
      if (step == 0) throw Fail{"range() step must not be zero"};
      const __int128 span = step > 0 ? __int128{stop} - start : __int128{start} - stop;
      const __int128 n = span <= 0 ? 0 : (span + (step > 0 ? step : -__int128{step}) - 1) / (step > 0 ? step : -__int128{step});
      check_items(static_cast<size_t>(std::min<__int128>(n, kMaxItems + 1)));
      List out;
      // Every item lies between start and stop, but k * step alone may not fit an int64.
      for (int64_t k = 0; k < static_cast<int64_t>(n); ++k) out.push_back(Value::integer(static_cast<int64_t>(start + __int128{k} * step)));
      return Value::of_list(std::move(out));
    });
    auto dict_from_kw = [](bool ns) {
      return [ns](Args& a) {
        Dict d;
        if (!a.pos.empty()) {
          if (a.pos.size() > 1 || a.pos[0].kind != Value::kDict) throw Fail{"expected one dict or keyword arguments"};
          d = *a.pos[0].dict;
        }
        for (auto& [k, v] : a.kw) d.emplace_back(k, v);
        Value v = Value::of_dict(std::move(d));
        if (ns) {
          if (v.has_namespace) throw Fail{kNamespaceInNamespace};
          v.is_namespace = v.has_namespace = true;
        }
        return v;
      };
    };
    g["namespace"] = Value::function(dict_from_kw(true));
    g["dict"] = Value::function(dict_from_kw(false));
    g["strftime_now"] = Value::function([](Args& a) {
      Params p("strftime_now", a, {{"format", Value()}});
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, need_str(p[0], "strftime_now's format").c_str(), &tm);
      return Value::str(std::string(buf, n));
    });
    LT2_CHECK(context.is_object(), prog.where, ": the context must be a JSON object");
    for (const auto& [k, v] : context.items()) g[k] = from_json(v);
  }

  std::string run() {
    int64_t steps_left = kMaxSteps;
    struct Budget {  // this render's budget for the helpers, for as long as it runs
      explicit Budget(int64_t* left) : saved(std::exchange(t_steps_left, left)) {}
      ~Budget() { t_steps_left = saved; }
      int64_t* saved;
    } budget(&steps_left);
    std::string out;
    exec(prog_.body, out);
    return out;
  }

 private:
  enum class Flow { Normal, Break, Continue };

  // One more statement or expression being evaluated, for as long as the object lives.
  struct Deeper {
    explicit Deeper(int& depth) : depth(depth) {
      if (depth == kMaxRenderDepth) throw Fail{cat("the template recurses deeper than ", kMaxRenderDepth, " levels")};
      ++depth;
    }
    ~Deeper() { --depth; }
    Deeper(const Deeper&) = delete;
    Deeper& operator=(const Deeper&) = delete;
    int& depth;
  };

  [[noreturn]] void fail_at(size_t pos, const std::string& msg) const {
    throw Error(cat(prog_.where, ":", line_col(prog_.source, pos), ": ", msg));
  }
  void step(size_t pos) {
    try {
      charge(1);
    } catch (const Fail& f) {
      fail_at(pos, f.msg);
    }
  }

  Value lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s) {
      auto it = s->find(name);
      if (it != s->end()) return it->second;
    }
    return Value::undefined(name);
  }

  Flow exec(const Body& body, std::string& out) {
    for (const NodeP& n : body) {
      const Flow f = exec_one(*n, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec_one(const Node& n, std::string& out) {
    step(n.pos);
    try {
      const Deeper deeper(render_depth_);
      switch (n.kind) {
        case N::Text: out += n.lit.s; break;
        case N::Output: out += to_str(eval(*n.kids[0])); break;
        case N::Group: return exec(n.body, out);
        case N::If: return exec(truthy(eval(*n.kids[0])) ? n.body : n.orelse, out);
        case N::For: return exec_for(n, out);
        case N::Set: {
          Value v = eval(*n.kids[0]);
          if (!n.attr.empty()) {
            Value ns = lookup(n.name);
            if (!ns.is_namespace) throw Fail{cat("'", n.name, "' is not a namespace(), so '", n.name, ".", n.attr, "' cannot be set")};
            if (v.has_namespace) throw Fail{kNamespaceInNamespace};
            auto it = std::find_if(ns.dict->begin(), ns.dict->end(), [&](const auto& e) { return e.first == n.attr; });
            if (it == ns.dict->end()) ns.dict->emplace_back(n.attr, std::move(v));
            else it->second = std::move(v);
          } else {
            assign(n.names, v);
          }
          break;
        }
        case N::SetBlock: {
          std::string s;
          exec(n.body, s);
          scopes_.back()[n.names[0]] = Value::str(std::move(s));
          break;
        }
        case N::Macro: scopes_.back()[n.name] = macro(n); break;
        case N::Break: return Flow::Break;
        case N::Continue: return Flow::Continue;
        default: fail_at(n.pos, "an expression where a statement belongs");
      }
    } catch (const Fail& f) {
      fail_at(n.pos, f.msg);
    }
    check_output(out, n.pos);
    return Flow::Normal;
  }

  void check_output(const std::string& out, size_t pos) const {
    if (out.size() > kMaxOutput) fail_at(pos, cat("the output is longer than ", kMaxOutput, " bytes"));
  }

  void assign(const std::vector<std::string>& names, const Value& v) {
    if (names.size() == 1) {
      scopes_.back()[names[0]] = v;
      return;
    }
    const List items = iterate(v);
    if (items.size() != names.size())
      throw Fail{cat("cannot unpack ", items.size(), " values into ", names.size(), " names")};
    for (size_t k = 0; k < names.size(); ++k) scopes_.back()[names[k]] = items[k];
  }

  Flow exec_for(const Node& n, std::string& out) {
    const Value seq = eval(*n.kids[0]);
    if (seq.kind == Value::kNone) throw Fail{"cannot loop over none"};
    List items = iterate(seq);
    scopes_.emplace_back();
    if (n.kids.size() > 1) {  // the inline `if` filters before loop.* counts
      List kept;
      for (const Value& it : items) {
        assign(n.names, it);
        if (truthy(eval(*n.kids[1]))) kept.push_back(it);
      }
      items = std::move(kept);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      step(n.pos);
      assign(n.names, items[k]);
      scopes_.back()["loop"] = Value::of_dict({
          {"index0", Value::integer(k)},
          {"index", Value::integer(k + 1)},
          {"revindex0", Value::integer(len - k - 1)},
          {"revindex", Value::integer(len - k)},
          {"first", Value::boolean(k == 0)},
          {"last", Value::boolean(k == len - 1)},
          {"length", Value::integer(len)},
          {"previtem", k > 0 ? items[k - 1] : Value::undefined("loop.previtem")},
          {"nextitem", k + 1 < len ? items[k + 1] : Value::undefined("loop.nextitem")},
      });
      if (exec(n.body, out) == Flow::Break) break;
    }
    if (len == 0) exec(n.orelse, out);
    scopes_.pop_back();
    return Flow::Normal;
  }

  // A macro: called with its parameters bound in a scope over the globals.
  Value macro(const Node& n) {
    return Value::function([this, &n](Args& a) {
      if (a.pos.size() > n.names.size())
        throw Fail{cat("macro '", n.name, "' takes ", n.names.size(), " arguments, found ", a.pos.size())};
      if (++call_depth_ > kMaxCallDepth) throw Fail{cat("macros call each other deeper than ", kMaxCallDepth, " levels")};
      std::vector<std::unordered_map<std::string, Value>> saved = std::move(scopes_);
      scopes_ = {saved.front(), {}};
      for (size_t k = 0; k < a.pos.size(); ++k) scopes_.back()[n.names[k]] = a.pos[k];
      for (auto& [name, v] : a.kw) {
        if (std::find(n.names.begin(), n.names.end(), name) == n.names.end())
          throw Fail{cat("macro '", n.name, "' has no parameter '", name, "'")};
        scopes_.back()[name] = v;
      }
      for (size_t k = 0; k < n.names.size(); ++k)
        if (!scopes_.back().count(n.names[k]))
          scopes_.back()[n.names[k]] = n.kids[k] ? eval(*n.kids[k]) : Value::undefined(n.names[k]);
      std::string out;
      exec(n.body, out);
      scopes_ = std::move(saved);
      --call_depth_;
      return Value::str(std::move(out));
    });
  }

  Args eval_args(const Node& n, size_t first) {
    Args a;
    const size_t n_kw = n.names.size();
    for (size_t k = first; k + n_kw < n.kids.size(); ++k) a.pos.push_back(eval(*n.kids[k]));
    for (size_t k = 0; k < n_kw; ++k) a.kw.emplace_back(n.names[k], eval(*n.kids[n.kids.size() - n_kw + k]));
    return a;
  }

  Value eval(const Node& n) {
    step(n.pos);
    try {
      const Deeper deeper(render_depth_);
      return eval_inner(n);
    } catch (const Fail& f) {
      fail_at(n.pos, f.msg);
    }
  }

  Value eval_inner(const Node& n) {
    switch (n.kind) {
      case N::Lit: return n.lit;
      case N::Name: return lookup(n.name);
      case N::ListLit: {
        List l;
        for (const auto& k : n.kids) l.push_back(eval(*k));
        Value v = Value::of_list(std::move(l));
        v.is_tuple = n.name == "tuple";
        return v;
      }
      case N::DictLit: {
        Dict d;
        std::unordered_map<std::string, size_t> at;  // key -> its entry in d: a repeated key replaces it
        for (size_t k = 0; k < n.kids.size(); k += 2) {
          Value key = eval(*n.kids[k]);
          if (key.kind != Value::kStr) throw Fail{cat("dict keys must be strings, found ", type_name(key))};
          Value v = eval(*n.kids[k + 1]);
          const auto [it, fresh] = at.emplace(key.s, d.size());
          if (fresh) d.emplace_back(key.s, std::move(v));
          else d[it->second].second = std::move(v);
        }
        return Value::of_dict(std::move(d));
      }
      case N::Attr: return get_attr(eval(*n.kids[0]), n.name);
      case N::Item: return get_item(eval(*n.kids[0]), eval(*n.kids[1]));
      case N::Slice: {
        const Value obj = eval(*n.kids[0]);
        Value parts[3];
        for (int k = 0; k < 3; ++k)
          if (n.kids[1 + k]) parts[k] = eval(*n.kids[1 + k]);
        return slice(obj, parts[0], parts[1], parts[2]);
      }
      case N::Call: {
        const Value f = eval(*n.kids[0]);
        if (f.kind != Value::kFunc) {
          if (!f.defined()) throw Fail{cat("'", f.s, "' is undefined and cannot be called")};
          throw Fail{cat("a ", type_name(f), " value is not callable")};
        }
        Args a = eval_args(n, 1);
        return (*f.fn)(a);
      }
      case N::Filter: {
        const Value v = eval(*n.kids[0]);
        Args a = eval_args(n, 1);
        return filter(n.name, v, a);
      }
      case N::Test: {
        const Value v = eval(*n.kids[0]);
        Args a = eval_args(n, 1);
        return Value::boolean(run_test(n.name, v, a.pos) != n.negated);
      }
      case N::Neg: case N::Pos: {
        const Value v = eval(*n.kids[0]);
        if (!v.defined()) fail_undefined(v);
        if (!v.numeric()) throw Fail{cat("bad operand type for unary ", n.kind == N::Neg ? "-" : "+", ": ", type_name(v))};
        if (n.kind == N::Pos) return v.kind == Value::kBool ? Value::integer(v.b) : v;
        if (v.kind == Value::kFloat) return Value::number(-v.f);
        if (v.as_int() == INT64_MIN) throw Fail{"integer overflow"};
        return Value::integer(-v.as_int());
      }
      case N::Not: return Value::boolean(!truthy(eval(*n.kids[0])));
      case N::And: {
        Value a = eval(*n.kids[0]);
        return truthy(a) ? eval(*n.kids[1]) : a;
      }
      case N::Or: {
        Value a = eval(*n.kids[0]);
        return truthy(a) ? a : eval(*n.kids[1]);
      }
      case N::Cond:
        if (truthy(eval(*n.kids[0]))) return eval(*n.kids[1]);
        return n.kids.size() > 2 ? eval(*n.kids[2]) : Value::undefined("the else branch of a conditional");
      case N::Binary: {
        const Value a = eval(*n.kids[0]);
        const Value b = eval(*n.kids[1]);
        if (n.name == "~") {
          check_size(to_str(a).size() + to_str(b).size());
          return Value::str(to_str(a) + to_str(b));
        }
        return arith(n.name, a, b);
      }
      case N::Compare: {
        Value a = eval(*n.kids[0]);
        for (size_t k = 0; k < n.names.size(); ++k) {
          Value b = eval(*n.kids[k + 1]);
          const std::string& op = n.names[k];
          bool r;
          if (op == "==") r = equal(a, b);
          else if (op == "!=") r = !equal(a, b);
          else if (op == "in") r = contains(b, a);
          else if (op == "not in") r = !contains(b, a);
          else {
            const int c = compare(a, b);
            r = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
          }
          if (!r) return Value::boolean(false);
          a = std::move(b);
        }
        return Value::boolean(true);
      }
      default: fail_at(n.pos, "a statement where an expression belongs");
    }
  }

  // Applies the filter `name` (or a test, for select/reject) to each item: map, select, ...
  Value filter(const std::string& name, const Value& v, Args& a) {
    auto p = [&](std::vector<std::pair<const char*, Value>> spec) { return Params(name.c_str(), a, std::move(spec)); };
    if (name == "trim") return Value::str(strip(to_str(v), p({{"chars", Value::none()}})[0], true, true));
    if (name == "length" || name == "count") { p({}); return Value::integer(length(v)); }
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      p({});
      Args none;
      return (*method(Value::str(to_str(v)), name).fn)(none);
    }
    if (name == "string") { p({}); return Value::str(to_str(v)); }
    if (name == "safe") { p({}); return v; }
    if (name == "tojson") {
      Params q = p({{"indent", Value::none()}, {"sort_keys", Value::boolean(false)}});
      if (!v.defined()) fail_undefined(v);
      std::string out;
      to_json(v, q[0].kind == Value::kNone ? -1 : static_cast<int>(std::clamp<int64_t>(to_index(q[0], "indent"), 0, 64)),
              truthy(q[1]), 0, out);
      return Value::str(std::move(out));
    }
    if (name == "default" || name == "d") {
      Params q = p({{"default_value", Value::str("")}, {"boolean", Value::boolean(false)}});
      return !v.defined() || (truthy(q[1]) && !truthy(v)) ? q[0] : v;
    }
    if (name == "first" || name == "last") {
      p({});
      const List items = iterate(v);
      if (items.empty()) return Value::undefined(cat("the ", name, " item of an empty sequence"));
      return name == "first" ? items.front() : items.back();
    }
    if (name == "items") { p({}); return items_of(v); }
    if (name == "list") { p({}); return Value::of_list(iterate(v)); }
    if (name == "reverse") {
      p({});
      if (v.kind == Value::kStr) return slice(v, Value(), Value(), Value::integer(-1));
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::of_list(std::move(items));
    }
    if (name == "join") {
      Params q = p({{"d", Value::str("")}, {"attribute", Value::none()}});
      std::string out;
      const List items = iterate(v);
      for (size_t k = 0; k < items.size(); ++k) {
        const Value it = q[1].kind == Value::kNone ? items[k] : get_attr(items[k], to_str(q[1]));
        out += (k ? to_str(q[0]) : "") + to_str(it);
        check_size(out.size());
      }
      return Value::str(std::move(out));
    }
    if (name == "replace") {
      Params q = p({{"old", Value()}, {"new", Value()}, {"count", Value::none()}});
      return Value::str(replace(to_str(v), need_str(q[0], "replace's old"), need_str(q[1], "replace's new"),
                                q[2].kind == Value::kNone ? -1 : to_index(q[2], "replace's count")));
    }
    if (name == "indent") {
      Params q = p({{"width", Value::integer(4)}, {"first", Value::boolean(false)}, {"blank", Value::boolean(false)}});
      const std::string pad = q[0].kind == Value::kStr ? std::string(q[0].s) : std::string(std::clamp<int64_t>(to_index(q[0], "width"), 0, 256), ' ');
      const List lines = split(to_str(v), Value::str("\n"), -1);
      std::string out;
      for (size_t k = 0; k < lines.size(); ++k) {
        const std::string& line = lines[k].s;
        const bool pad_it = (k > 0 || truthy(q[1])) && (truthy(q[2]) || !line.empty());
        out += (k ? "\n" : "") + (pad_it ? pad : "") + line;
        check_size(out.size());
      }
      return Value::str(std::move(out));
    }
    if (name == "int" || name == "float") {
      Params q = p({{"default", name == "int" ? Value::integer(0) : Value::number(0)}});
      if (v.numeric() && name == "float") return Value::number(v.as_double());
      if (v.numeric() && v.kind != Value::kFloat) return Value::integer(v.as_int());
      if (v.kind == Value::kFloat) {
        if (std::isnan(v.f)) return q[0];  // jinja2: int(nan) and int(float(nan)) fail, so the default
        // Python's int of a larger float (or of infinity, an OverflowError) does not fit an int64.
        if (!(std::fabs(v.f) < 0x1p63)) throw Fail{"integer overflow"};
        return Value::integer(static_cast<int64_t>(v.f));
      }
      if (v.kind == Value::kStr) {
        const std::string t = strip(v.s, Value::none(), true, true);
        char* end = nullptr;
        errno = 0;
        const double d = std::strtod(t.c_str(), &end);
        if (!t.empty() && end == t.c_str() + t.size() && errno == 0 && std::isfinite(d) && std::fabs(d) < 9e18)
          return name == "int" ? Value::integer(static_cast<int64_t>(d)) : Value::number(d);
      }
      return q[0];
    }
    if (name == "abs") {
      p({});
      if (v.kind == Value::kFloat) return Value::number(std::fabs(v.f));
      if (!v.numeric()) throw Fail{cat("abs needs a number, found ", type_name(v))};
      if (v.as_int() == INT64_MIN) throw Fail{"integer overflow"};
      return Value::integer(std::llabs(v.as_int()));
    }
    if (name == "round") {
      Params q = p({{"precision", Value::integer(0)}, {"method", Value::str("common")}});
      if (!v.numeric()) throw Fail{cat("round needs a number, found ", type_name(v))};
      const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(to_index(q[0], "precision"), -20, 20)));
      const std::string& m = need_str(q[1], "round's method");
      const double x = v.as_double() * scale;
      const double r = m == "floor" ? std::floor(x) : m == "ceil" ? std::ceil(x) : std::round(x);
      if (m != "common" && m != "floor" && m != "ceil") throw Fail{cat("round: unknown method '", m, "'")};
      return Value::number(r / scale);
    }
    if (name == "sum") {
      Params q = p({{"attribute", Value::none()}, {"start", Value::integer(0)}});
      Value acc = q[1];
      for (const Value& it : iterate(v)) acc = arith("+", acc, q[0].kind == Value::kNone ? it : get_attr(it, to_str(q[0])));
      return acc;
    }
    if (name == "unique") {
      p({});
      List out;
      for (const Value& it : iterate(v)) {
        charge(static_cast<int64_t>(out.size()));  // the comparisons with the items kept
        if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return equal(o, it); })) out.push_back(it);
      }
      return Value::of_list(std::move(out));
    }
    if (name == "sort") {
      Params q = p({{"reverse", Value::boolean(false)}, {"case_sensitive", Value::boolean(false)}, {"attribute", Value::none()}});
      List items = iterate(v);
      auto key = [&](const Value& it) {
        Value k = q[2].kind == Value::kNone ? it : get_attr(it, to_str(q[2]));
        if (k.kind == Value::kStr && !truthy(q[1])) k.s = map_ascii(k.s, [](int c) { return std::tolower(c); });
        return k;
      };
      const bool rev = truthy(q[0]);
      charge(static_cast<int64_t>(items.size()) * 20);
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        return rev ? compare(key(y), key(x)) < 0 : compare(key(x), key(y)) < 0;
      });
      return Value::of_list(std::move(items));
    }
    if (name == "map") {
      List out;
      const List items = iterate(v);
      if (a.pos.empty()) {
        Params q = p({{"attribute", Value()}, {"default", Value()}});
        for (const Value& it : items) {
          Value x = get_attr(it, need_str(q[0], "map's attribute"));
          out.push_back(!x.defined() && q[1].defined() ? q[1] : x);
        }
      } else {
        const std::string f = need_str(a.pos[0], "map's filter name");
        Args rest{std::vector<Value>(a.pos.begin() + 1, a.pos.end()), a.kw};
        for (const Value& it : items) {
          Args copy = rest;
          out.push_back(filter(f, it, copy));
        }
      }
      return Value::of_list(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep_if = name == "select" || name == "selectattr";
      if (!a.kw.empty()) throw Fail{cat(name, " takes positional arguments only")};
      size_t k = 0;
      std::string attr;
      if (by_attr) {
        if (a.pos.empty()) throw Fail{cat(name, " needs an attribute name")};
        attr = need_str(a.pos[k++], "the attribute name");
      }
      const std::string test = k < a.pos.size() ? need_str(a.pos[k++], "the test name") : "";
      const std::vector<Value> test_args(a.pos.begin() + std::min(k, a.pos.size()), a.pos.end());
      List out;
      for (const Value& it : iterate(v)) {
        const Value x = by_attr ? get_attr(it, attr) : it;
        const bool pass = test.empty() ? truthy(x) : run_test(test, x, test_args);
        if (pass == keep_if) out.push_back(it);
      }
      return Value::of_list(std::move(out));
    }
    throw Fail{cat("unknown filter '", name, "'")};
  }

  const ChatTemplate::Program& prog_;
  std::vector<std::unordered_map<std::string, Value>> scopes_;
  int call_depth_ = 0;
  int render_depth_ = 0;  // see Deeper
};

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, std::string where) {
  auto p = std::make_shared<Program>();
  p->where = std::move(where);
  // As jinja2 reads a source: line ends normalized to "\n", one trailing newline dropped.
  p->source.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      p->source += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      p->source += source[k];
    }
  }
  if (!p->source.empty() && p->source.back() == '\n') p->source.pop_back();
  p->body = Parser(Lexer(p->source, p->where).run(), p->source, p->where).run();
  program_ = std::move(p);
}

std::string ChatTemplate::render(const json& context) const { return Renderer(*program_, context).run(); }

}  // namespace lt2
