#include "lt2/tokenizer/normalizer.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lt2/tokenizer/utf8.h"
#include "lt2/util/error.h"

namespace lt2 {

namespace {

#include "lt2/tokenizer/unicode_nfc_tables.inc"

// Hangul syllables compose and decompose arithmetically (Unicode chapter 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;
// Bytes that are not valid UTF-8 travel through the algorithm as these values: starters that
// compose with nothing, written back as the original byte.
constexpr uint32_t kRawByteBase = 0x110000;

uint32_t combining_class(uint32_t cp) {
  auto it = std::lower_bound(std::begin(kCombiningClass), std::end(kCombiningClass), cp,
                             [](const uint32_t(&e)[2], uint32_t v) { return e[0] < v; });
  return (it != std::end(kCombiningClass) && (*it)[0] == cp) ? (*it)[1] : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  auto it = std::lower_bound(std::begin(kDecomposition), std::end(kDecomposition), cp,
                             [](const uint32_t(&e)[3], uint32_t v) { return e[0] < v; });
  if (it != std::end(kDecomposition) && (*it)[0] == cp) {
    out.insert(out.end(), kDecompositionPool + (*it)[1], kDecompositionPool + (*it)[1] + (*it)[2]);
  } else {
    out.push_back(cp);
  }
}

// The primary composite of a pair, or 0 when there is none.
uint32_t compose_pair(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  auto it = std::lower_bound(std::begin(kComposition), std::end(kComposition), std::make_pair(a, b),
                             [](const uint32_t(&e)[3], const std::pair<uint32_t, uint32_t>& v) {
                               return e[0] < v.first || (e[0] == v.first && e[1] < v.second);
                             });
  if (it != std::end(kComposition) && (*it)[0] == a && (*it)[1] == b) return (*it)[2];
  return 0;
}

}  // namespace

std::string nfc(std::string_view text) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
    return std::string(text);

  // 1. Full canonical decomposition.
  std::vector<uint32_t> cps;
  cps.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    uint32_t cp;
    const size_t len = utf8::decode(text, pos, cp);
    if (len == 0) {
      cps.push_back(kRawByteBase + static_cast<unsigned char>(text[pos]));
      ++pos;
    } else {
      decompose(cp, cps);
      pos += len;
    }
  }
  // 2. Canonical ordering: stable-sort every run of non-starters by combining class.
  std::vector<uint32_t> ccc(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) ccc[i] = cps[i] >= kRawByteBase ? 0 : combining_class(cps[i]);
  for (size_t i = 0; i < cps.size();) {
    if (ccc[i] == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && ccc[j] != 0) ++j;
    std::vector<std::pair<uint32_t, uint32_t>> run;  // (class, code point)
    for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], cps[k]);
    std::stable_sort(run.begin(), run.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    for (size_t k = i; k < j; ++k) {
      ccc[k] = run[k - i].first;
      cps[k] = run[k - i].second;
    }
    i = j;
  }
  // 3. Canonical composition: each character joins the last starter unless a character between
  // them blocks it (has class 0, or a class >= its own).
  std::vector<uint32_t> out_cps;
  std::vector<uint32_t> out_ccc;
  out_cps.reserve(cps.size());
  long starter = -1;  // index in out_cps of the last starter
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t cp = cps[i], c = ccc[i];
    if (starter >= 0 && cp < kRawByteBase && out_cps[starter] < kRawByteBase) {
      const bool adjacent = static_cast<size_t>(starter) + 1 == out_cps.size();
      const uint32_t last_class = out_ccc.back();
      if (adjacent || (last_class != 0 && last_class < c)) {
        if (const uint32_t composite = compose_pair(out_cps[starter], cp)) {
          out_cps[starter] = composite;
          continue;
        }
      }
    }
    if (c == 0) starter = static_cast<long>(out_cps.size());
    out_cps.push_back(cp);
    out_ccc.push_back(c);
  }
  std::string out;
  out.reserve(text.size());
  for (uint32_t cp : out_cps) {
    if (cp >= kRawByteBase)
      out.push_back(static_cast<char>(cp - kRawByteBase));
    else
      utf8::append(out, cp);
  }
  return out;
}

Normalizer Normalizer::from_json(const json& config, const std::string& where) {
  Normalizer n;
  if (config.is_null()) return n;
  LT2_CHECK(config.is_object() && config.contains("type") && config["type"].is_string(), where,
            ": expected an object with a string 'type', found ", config.dump());
  const std::string type = config["type"].get<std::string>();
  if (type == "NFC") {
    n.nfc_ = true;
  } else if (type == "Sequence") {
    LT2_CHECK(config.contains("normalizers") && config["normalizers"].is_array(), where,
              ": Sequence needs an array 'normalizers'");
    for (size_t i = 0; i < config["normalizers"].size(); ++i) {
      const Normalizer inner = from_json(config["normalizers"][i], cat(where, ".normalizers[", i, "]"));
      n.nfc_ = n.nfc_ || inner.nfc_;
    }
  } else {
    throw Error(cat(where, ": unsupported normalizer type '", type,
                    "' (lt2 supports none, NFC and a Sequence of them, what byte-level BPE models use)"));
  }
  return n;
}

std::string Normalizer::apply(std::string_view text) const {
  return nfc_ ? nfc(text) : std::string(text);
}

}  // namespace lt2
