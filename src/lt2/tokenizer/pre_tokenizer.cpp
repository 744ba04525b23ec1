#include "lt2/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <functional>
#include <optional>

#include "lt2/tokenizer/byte_level.h"
#include "lt2/tokenizer/utf8.h"
#include "lt2/util/error.h"

namespace lt2 {

const char* const kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3SplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// HF's Digits tests Rust's char::is_numeric (categories Nd, Nl, No); one match per character.
const char* const kDigitPattern = R"(\p{N})";
// HF's Punctuation tests ASCII punctuation (which includes symbols such as $ + < = > ^ ` | ~) or
// a Unicode punctuation category (Pc, Pd, Pe, Pf, Pi, Po, Ps); one match per character.
const char* const kPunctuationPattern = R"([\p{P}\x21-\x2F\x3A-\x40\x5B-\x60\x7B-\x7E])";

SplitBehavior parse_behavior(const json& j, const std::string& where) {
  LT2_CHECK(j.is_string(), where, ": 'behavior' must be a string, found ", j.dump());
  const std::string s = j.get<std::string>();
  if (s == "Removed") return SplitBehavior::Removed;
  if (s == "Isolated") return SplitBehavior::Isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (s == "Contiguous") return SplitBehavior::Contiguous;
  throw Error(cat(where, ": unknown split behavior '", s,
                  "' (expected Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous)"));
}

struct Piece {
  size_t begin, end;
  bool is_match;
};

// Cuts `text` at the matches of a pattern the way HF's NormalizedString::split does: the matches
// and the gaps between them cover the text; `invert` swaps which are "matches"; the behavior says
// what happens to the matches. Appends the non-empty pieces kept to `out`.
void split_by_matches(size_t text_size, const std::vector<Span>& matches, bool invert,
                      SplitBehavior behavior, std::vector<Span>& out) {
  thread_local std::vector<Piece> pieces;
  thread_local std::vector<Span> kept;
  pieces.clear();
  kept.clear();
  size_t prev = 0;
  for (const Span& m : matches) {
    if (m.begin > prev) pieces.push_back({prev, m.begin, invert});
    pieces.push_back({m.begin, m.end, !invert});
    prev = m.end;
  }
  if (prev < text_size) pieces.push_back({prev, text_size, invert});

  switch (behavior) {
    case SplitBehavior::Removed:
      for (const Piece& p : pieces)
        if (!p.is_match) kept.push_back({p.begin, p.end});
      break;
    case SplitBehavior::Isolated:
      for (const Piece& p : pieces) kept.push_back({p.begin, p.end});
      break;
    case SplitBehavior::MergedWithPrevious: {
      // A match joins the piece before it (unless that piece was itself a match).
      bool previous_match = false;
      for (const Piece& p : pieces) {
        if (p.is_match && !previous_match && !kept.empty())
          kept.back().end = p.end;
        else
          kept.push_back({p.begin, p.end});
        previous_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      // Mirror image: walk backwards, a match joins the piece after it.
      bool previous_match = false;
      for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty())
          kept.back().begin = it->begin;
        else
          kept.push_back({it->begin, it->end});
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
    case SplitBehavior::Contiguous: {
      // Consecutive matches become one piece.
      bool previous_match = false;
      for (const Piece& p : pieces) {
        if (p.is_match && previous_match && !kept.empty())
          kept.back().end = p.end;
        else
          kept.push_back({p.begin, p.end});
        previous_match = p.is_match;
      }
      break;
    }
  }
  for (const Span& k : kept)
    if (k.end > k.begin) out.push_back(k);
}

}  // namespace

struct PreTokenizer::Step {
  enum class Kind { Split, ByteLevel } kind = Kind::Split;
  std::optional<Regex> regex;  // Split: the pattern; ByteLevel: GPT-2's regex when use_regex
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;

  // Whether this step inserts characters (so its pieces need a new buffer).
  bool adds_prefix_space() const { return kind == Kind::ByteLevel && add_prefix_space; }

  // Appends the spans of the parts of `piece` (a span of `text`) that this step keeps to `out`.
  void apply(std::string_view text, Span piece, std::vector<Span>& out) const {
    if (!regex) {
      out.push_back(piece);
      return;
    }
    thread_local std::vector<Span> matches;
    matches.clear();
    regex->find_all(text.substr(piece.begin, piece.end - piece.begin), matches);
    const size_t first = out.size();
    split_by_matches(piece.end - piece.begin, matches, invert, behavior, out);
    for (size_t i = first; i < out.size(); ++i) {
      out[i].begin += piece.begin;
      out[i].end += piece.begin;
    }
  }
};

PreTokenizer::PreTokenizer() = default;
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

namespace {

bool get_bool(const json& obj, const char* key, bool fallback, const std::string& where) {
  bool value = fallback;
  json_get(obj, key, value, where);
  return value;
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const json& config, const std::string& where) {
  PreTokenizer result;
  if (config.is_null()) return result;

  // Flattens nested Sequences into result.steps_.
  std::function<void(const json&, const std::string&)> add = [&](const json& j,
                                                                  const std::string& at) {
    LT2_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), at,
              ": expected an object with a string 'type', found ", j.dump());
    const std::string type = j["type"].get<std::string>();
    auto step = std::make_unique<Step>();
    if (type == "Sequence") {
      LT2_CHECK(j.contains("pretokenizers") && j["pretokenizers"].is_array(), at,
                ": Sequence needs an array 'pretokenizers'");
      for (size_t i = 0; i < j["pretokenizers"].size(); ++i)
        add(j["pretokenizers"][i], cat(at, ".pretokenizers[", i, "]"));
      return;
    } else if (type == "Split") {
      LT2_CHECK(j.contains("pattern") && j["pattern"].is_object(), at,
                ": Split needs a 'pattern' object ({\"Regex\": ...} or {\"String\": ...})");
      const json& p = j["pattern"];
      if (p.contains("Regex") && p["Regex"].is_string()) {
        step->regex.emplace(p["Regex"].get<std::string>(), at + ".pattern");
      } else if (p.contains("String") && p["String"].is_string()) {
        step->regex.emplace(p["String"].get<std::string>(), at + ".pattern", /*literal=*/true);
      } else {
        throw Error(cat(at, ": Split pattern must be {\"Regex\": string} or {\"String\": string}, found ",
                        p.dump()));
      }
      LT2_CHECK(j.contains("behavior"), at, ": Split needs a 'behavior'");
      step->behavior = parse_behavior(j["behavior"], at);
      step->invert = get_bool(j, "invert", false, at);
    } else if (type == "ByteLevel") {
      LT2_CHECK(!result.has_byte_level_, at, ": more than one ByteLevel pre-tokenizer is not supported");
      step->kind = Step::Kind::ByteLevel;
      step->add_prefix_space = get_bool(j, "add_prefix_space", true, at);
      if (get_bool(j, "use_regex", true, at)) step->regex.emplace(kGpt2SplitPattern, at);
      result.has_byte_level_ = true;
      result.byte_level_step_ = static_cast<int>(result.steps_.size());
    } else if (type == "Digits") {
      step->regex.emplace(kDigitPattern, at);
      step->behavior = get_bool(j, "individual_digits", false, at) ? SplitBehavior::Isolated
                                                                    : SplitBehavior::Contiguous;
    } else if (type == "Punctuation") {
      step->regex.emplace(kPunctuationPattern, at);
      step->behavior = j.contains("behavior") ? parse_behavior(j["behavior"], at)
                                              : SplitBehavior::Isolated;
    } else {
      throw Error(cat(at, ": unsupported pre-tokenizer type '", type,
                      "' (lt2 supports Sequence, Split, ByteLevel, Digits and Punctuation, the "
                      "steps byte-level BPE models use)"));
    }
    result.steps_.push_back(std::move(step));
  };
  add(config, where);
  return result;
}

void PreTokenizer::split(std::string_view segment,
                         const std::function<void(std::string_view)>& emit) const {
  // HF only ever sees valid UTF-8. Bytes that are not valid UTF-8 are words of their own here, so
  // no regex step can drop or regroup them (a Split with "Removed" would lose them), and valid
  // text is pre-tokenized exactly as HF does.
  size_t pos = 0;
  while (pos < segment.size()) {
    const size_t valid_end = pos + utf8::valid_prefix_length(segment.substr(pos));
    if (valid_end > pos) split_valid(segment.substr(pos, valid_end - pos), emit);
    pos = valid_end;
    uint32_t cp;
    while (pos < segment.size() && utf8::decode(segment, pos, cp) == 0)
      pos += utf8::invalid_prefix_length(segment, pos);
    if (pos > valid_end) emit(segment.substr(valid_end, pos - valid_end));
  }
}

void PreTokenizer::split_valid(std::string_view segment,
                               const std::function<void(std::string_view)>& emit) const {
  // Pieces are spans of a text buffer. Splitting only makes smaller spans of the same buffer; a
  // new buffer is built only where text changes: ByteLevel's prefix space, and its character
  // mapping when later steps must see it.
  std::string_view text = segment;
  std::string buffer, next_buffer;
  std::vector<Span> pieces{{0, segment.size()}}, next;
  auto rebuild = [&](const std::function<void(std::string_view, std::string&)>& transform) {
    next_buffer.clear();
    next.clear();
    for (const Span& p : pieces) {
      const size_t begin = next_buffer.size();
      transform(text.substr(p.begin, p.end - p.begin), next_buffer);
      next.push_back({begin, next_buffer.size()});
    }
    buffer.swap(next_buffer);
    text = buffer;
    pieces.swap(next);
  };
  const int n_steps = static_cast<int>(steps_.size());
  for (int i = 0; i < n_steps; ++i) {
    const Step& step = *steps_[i];
    if (step.adds_prefix_space()) {
      rebuild([](std::string_view piece, std::string& out) {
        if (piece[0] != ' ') out.push_back(' ');
        out.append(piece);
      });
    }
    next.clear();
    for (const Span& p : pieces) step.apply(text, p, next);
    pieces.swap(next);
    // Steps after the ByteLevel step see its character mapping, as in HF.
    if (i == byte_level_step_ && i + 1 < n_steps)
      rebuild([](std::string_view piece, std::string& out) { out += byte_level::encode(piece); });
  }
  const bool mapped = byte_level_step_ >= 0 && byte_level_step_ + 1 < n_steps;
  for (const Span& p : pieces) {
    if (p.end == p.begin) continue;
    const std::string_view word = text.substr(p.begin, p.end - p.begin);
    if (mapped) {
      // Only whole mapped characters were moved around, so this cannot fail.
      emit(*byte_level::decode(word));
    } else {
      emit(word);
    }
  }
}

void PreTokenizer::split(std::string_view segment, std::vector<std::string>& words) const {
  split(segment, [&](std::string_view w) { words.emplace_back(w); });
}

}  // namespace lt2
