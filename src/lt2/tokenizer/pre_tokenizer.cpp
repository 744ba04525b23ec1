#include "lt2/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <functional>
#include <optional>

#include "lt2/tokenizer/byte_level.h"
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
// what happens to the matches; empty pieces are dropped.
void split_by_matches(const std::string& text, const std::vector<Span>& matches, bool invert,
                      SplitBehavior behavior, std::vector<std::string>& out) {
  std::vector<Piece> pieces;
  pieces.reserve(matches.size() * 2 + 1);
  size_t prev = 0;
  for (const Span& m : matches) {
    if (m.begin > prev) pieces.push_back({prev, m.begin, invert});
    pieces.push_back({m.begin, m.end, !invert});
    prev = m.end;
  }
  if (prev < text.size()) pieces.push_back({prev, text.size(), invert});

  std::vector<Piece> kept;  // is_match is meaningless after this step
  kept.reserve(pieces.size());
  switch (behavior) {
    case SplitBehavior::Removed:
      for (const Piece& p : pieces)
        if (!p.is_match) kept.push_back(p);
      break;
    case SplitBehavior::Isolated:
      kept = pieces;
      break;
    case SplitBehavior::MergedWithPrevious: {
      // A match joins the piece before it (unless that piece was itself a match).
      bool previous_match = false;
      for (const Piece& p : pieces) {
        if (p.is_match && !previous_match && !kept.empty())
          kept.back().end = p.end;
        else
          kept.push_back(p);
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
          kept.push_back(*it);
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
          kept.push_back(p);
        previous_match = p.is_match;
      }
      break;
    }
  }
  for (const Piece& p : kept)
    if (p.end > p.begin) out.emplace_back(text, p.begin, p.end - p.begin);
}

}  // namespace

struct PreTokenizer::Step {
  enum class Kind { Split, ByteLevel } kind = Kind::Split;
  std::optional<Regex> regex;  // Split: the pattern; ByteLevel: GPT-2's regex when use_regex
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;

  // Splits every piece in `pieces` into `out`.
  void apply(std::vector<std::string>& pieces, std::vector<std::string>& out) const {
    std::vector<Span> matches;
    for (std::string& piece : pieces) {
      if (kind == Kind::ByteLevel && add_prefix_space && (piece.empty() || piece[0] != ' '))
        piece.insert(piece.begin(), ' ');
      if (!regex) {
        if (!piece.empty()) out.push_back(std::move(piece));
        continue;
      }
      matches.clear();
      regex->find_all(piece, matches);
      split_by_matches(piece, matches, invert, behavior, out);
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
      result.last_byte_level_ = static_cast<int>(result.steps_.size());
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

void PreTokenizer::split(std::string_view segment, std::vector<std::string>& words) const {
  if (segment.empty()) return;
  std::vector<std::string> pieces{std::string(segment)};
  std::vector<std::string> next;
  const int n_steps = static_cast<int>(steps_.size());
  for (int i = 0; i < n_steps; ++i) {
    next.clear();
    steps_[i]->apply(pieces, next);
    pieces.swap(next);
    // Steps after the ByteLevel step see its character mapping, as in HF.
    if (i == last_byte_level_ && i + 1 < n_steps)
      for (std::string& p : pieces) p = byte_level::encode(p);
  }
  const bool mapped = last_byte_level_ >= 0 && last_byte_level_ + 1 < n_steps;
  for (std::string& p : pieces) {
    if (mapped) {
      // Only whole mapped characters were moved around, so this cannot fail.
      words.push_back(*byte_level::decode(p));
    } else {
      words.push_back(std::move(p));
    }
  }
}

}  // namespace lt2
