#include "lt2/tokenizer/trainer.h"

#include <algorithm>
#include <queue>
#include <thread>
#include <unordered_map>

#include "lt2/tokenizer/added_vocabulary.h"
#include "lt2/tokenizer/byte_level.h"
#include "lt2/tokenizer/pre_tokenizer.h"
#include "lt2/util/error.h"

namespace lt2 {

namespace {

// Texts are counted in batches of about this many bytes, cut into pieces of about kPieceBytes
// that the threads share.
constexpr size_t kBatchBytes = size_t{16} << 20;
constexpr size_t kPieceBytes = size_t{1} << 20;

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Cuts a long text into pieces at line ends followed by a non-space character. Both split
// regexes end a word at such a point, so counting the pieces separately counts the same words.
void cut_into_pieces(std::string_view text, std::vector<std::string_view>& pieces) {
  size_t begin = 0;
  while (text.size() - begin > kPieceBytes) {
    size_t cut = begin + kPieceBytes;
    while (cut < text.size() && !(text[cut - 1] == '\n' && !is_ascii_space(text[cut]))) ++cut;
    pieces.push_back(text.substr(begin, cut - begin));
    begin = cut;
  }
  if (begin < text.size()) pieces.push_back(text.substr(begin));
}

json pre_tokenizer_config(const std::string& pattern) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
}

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

struct BpeTrainer::Impl {
  PreTokenizer pre_tokenizer;
  std::vector<AddedToken> specials;
  std::unique_ptr<AddedTokenMatcher> special_matcher;
  std::vector<std::string> pending;  // texts not yet counted
  size_t pending_bytes = 0;
  std::unordered_map<std::string, int64_t> word_counts;

  // Counts the words of `piece` (special tokens cut out) into `counts`.
  void count_piece(std::string_view piece, std::unordered_map<std::string, int64_t>& counts) const {
    std::vector<Segment> segments;
    special_matcher->split(piece, segments);
    std::vector<std::string> words;
    for (const Segment& s : segments) {
      if (s.token >= 0) continue;
      words.clear();
      pre_tokenizer.split(piece.substr(s.begin, s.end - s.begin), words);
      for (std::string& w : words) ++counts[std::move(w)];
    }
  }
};

BpeTrainer::BpeTrainer(BpeTrainerOptions options) : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  if (options_.split_pattern.empty()) options_.split_pattern = kLlama3SplitPattern;
  const int32_t minimum = 256 + static_cast<int32_t>(options_.special_tokens.size());
  LT2_CHECK(options_.vocab_size >= minimum, "BPE training: vocab size ", options_.vocab_size,
            " is below the ", minimum, " ids the 256 bytes and ", options_.special_tokens.size(),
            " special tokens take");
  LT2_CHECK(options_.min_frequency >= 1, "BPE training: min frequency must be at least 1, got ",
            options_.min_frequency);
  LT2_CHECK(options_.threads >= 0, "BPE training: threads must be >= 0 (0: all cores), got ", options_.threads);
  impl_->pre_tokenizer = PreTokenizer::from_json(pre_tokenizer_config(options_.split_pattern), "BPE training: split pattern");
  for (size_t i = 0; i < options_.special_tokens.size(); ++i) {
    const std::string& s = options_.special_tokens[i];
    LT2_CHECK(!s.empty(), "BPE training: special token ", i, " is empty");
    for (size_t j = 0; j < i; ++j)
      LT2_CHECK(options_.special_tokens[j] != s, "BPE training: special token '", s, "' is given twice");
    AddedToken a;
    a.id = static_cast<int32_t>(i);
    a.content = s;
    a.special = true;
    impl_->specials.push_back(a);
  }
  std::vector<const AddedToken*> ptrs;
  for (const AddedToken& a : impl_->specials) ptrs.push_back(&a);
  impl_->special_matcher = std::make_unique<AddedTokenMatcher>(ptrs);
}

BpeTrainer::~BpeTrainer() = default;

void BpeTrainer::add_text(std::string_view text) {
  impl_->pending.emplace_back(text);
  impl_->pending_bytes += text.size();
  bytes_added_ += static_cast<int64_t>(text.size());
  if (impl_->pending_bytes >= kBatchBytes) count_pending();
}

void BpeTrainer::count_pending() {
  Impl& im = *impl_;
  if (im.pending.empty()) return;
  std::vector<std::string_view> pieces;
  for (const std::string& t : im.pending) cut_into_pieces(t, pieces);
  int threads = options_.threads > 0 ? options_.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(1, std::min<int>(threads, static_cast<int>(pieces.size())));
  std::vector<std::unordered_map<std::string, int64_t>> local(threads);
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      try {
        for (size_t i = t; i < pieces.size(); i += threads) im.count_piece(pieces[i], local[t]);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (auto& counts : local)
    for (auto& [word, n] : counts) im.word_counts[word] += n;
  im.pending.clear();
  im.pending_bytes = 0;
  if (options_.progress)
    options_.progress(cat("counted ", bytes_added_, " bytes: ", im.word_counts.size(), " distinct words"));
}

Tokenizer BpeTrainer::train() {
  count_pending();
  Impl& im = *impl_;

  // Tokens by their vocabulary text (byte-level characters), to find a merge result that already
  // exists (e.g. "ab"+"c" after "a"+"bc").
  std::vector<std::string> token_bytes;  // id -> raw bytes (the content for special tokens)
  std::unordered_map<std::string, int32_t> id_of_text;
  std::vector<std::string> token_text;  // id -> vocabulary text
  for (const AddedToken& a : im.specials) {
    token_bytes.push_back(a.content);
    token_text.push_back(a.content);
    id_of_text.emplace(a.content, a.id);
  }
  std::array<int32_t, 256> byte_id{};
  for (int b = 0; b < 256; ++b) {
    const std::string bytes(1, static_cast<char>(b));
    const std::string text = byte_level::encode(bytes);
    const int32_t id = static_cast<int32_t>(token_bytes.size());
    LT2_CHECK(!id_of_text.count(text), "BPE training: special token '", text, "' collides with a byte token");
    byte_id[b] = id;
    token_bytes.push_back(bytes);
    token_text.push_back(text);
    id_of_text.emplace(text, id);
  }

  // Distinct words, sorted so that training does not depend on hash order.
  std::vector<std::pair<std::string, int64_t>> sorted(im.word_counts.begin(), im.word_counts.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::vector<int32_t>> words(sorted.size());
  std::vector<int64_t> freq(sorted.size());
  for (size_t w = 0; w < sorted.size(); ++w) {
    freq[w] = sorted[w].second;
    words[w].reserve(sorted[w].first.size());
    for (unsigned char c : sorted[w].first) words[w].push_back(byte_id[c]);
  }
  sorted.clear();
  sorted.shrink_to_fit();

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> words_with_pair;  // may hold stale entries
  for (size_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w];
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t p = pair_key(s[i], s[i + 1]);
      pair_count[p] += freq[w];
      words_with_pair[p].push_back(static_cast<uint32_t>(w));
    }
  }
  struct Entry {
    int64_t count;
    uint64_t pair;
    // Max-heap on count; among equal counts the smaller pair of ids first.
    bool operator<(const Entry& o) const { return count != o.count ? count < o.count : pair > o.pair; }
  };
  std::priority_queue<Entry> heap;
  for (const auto& [p, c] : pair_count) heap.push({c, p});

  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<uint32_t> last_visit(words.size(), UINT32_MAX);
  std::unordered_map<uint64_t, int64_t> delta;
  int32_t vocab = static_cast<int32_t>(token_bytes.size());
  while (vocab < options_.vocab_size && !heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    const auto it = pair_count.find(top.pair);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {  // stale: counts dropped since this entry was pushed
      if (current > 0) heap.push({current, top.pair});
      continue;
    }
    if (current < options_.min_frequency) break;
    const int32_t a = static_cast<int32_t>(top.pair >> 32), b = static_cast<int32_t>(top.pair & 0xFFFFFFFFu);
    const std::string merged_bytes = token_bytes[a] + token_bytes[b];
    const std::string merged_text = token_text[a] + token_text[b];
    int32_t merged;
    if (const auto found = id_of_text.find(merged_text); found != id_of_text.end()) {
      merged = found->second;
    } else {
      merged = static_cast<int32_t>(token_bytes.size());
      token_bytes.push_back(merged_bytes);
      token_text.push_back(merged_text);
      id_of_text.emplace(merged_text, merged);
      ++vocab;
    }
    merges.emplace_back(a, b);
    const uint32_t step = static_cast<uint32_t>(merges.size());

    std::vector<uint32_t> occurrences = std::move(words_with_pair[top.pair]);
    words_with_pair.erase(top.pair);
    delta.clear();
    for (uint32_t w : occurrences) {
      if (last_visit[w] == step) continue;
      last_visit[w] = step;
      std::vector<int32_t>& s = words[w];
      bool contains = false;
      for (size_t i = 0; i + 1 < s.size() && !contains; ++i) contains = s[i] == a && s[i + 1] == b;
      if (!contains) continue;
      const int64_t f = freq[w];
      for (size_t i = 0; i + 1 < s.size(); ++i) delta[pair_key(s[i], s[i + 1])] -= f;
      size_t out = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          s[out++] = merged;
          ++i;
        } else {
          s[out++] = s[i];
        }
      }
      s.resize(out);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t p = pair_key(s[i], s[i + 1]);
        delta[p] += f;
        if (s[i] == merged || s[i + 1] == merged) words_with_pair[p].push_back(w);
      }
    }
    for (const auto& [p, d] : delta) {
      if (d == 0) continue;
      int64_t& c = pair_count[p];
      c += d;
      if (c <= 0) {
        pair_count.erase(p);
      } else if (d > 0) {
        heap.push({c, p});
      }
    }
    if (options_.progress && step % 1000 == 0)
      options_.progress(cat("merge ", step, ": vocabulary ", vocab, "/", options_.vocab_size, ", '",
                            merged_text, "' seen ", current, " times"));
  }

  // The tokenizer.json document.
  json vocab_json = json::object();
  for (size_t id = 0; id < token_text.size(); ++id) vocab_json[token_text[id]] = id;
  json merges_json = json::array();
  for (const auto& [l, r] : merges) merges_json.push_back({token_text[l], token_text[r]});
  json added = json::array();
  for (const AddedToken& s : im.specials)
    added.push_back({{"id", s.id}, {"content", s.content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  const json doc = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre_tokenizer_config(options_.split_pattern)},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
        {"ignore_merges", false}, {"vocab", vocab_json}, {"merges", merges_json}}}};
  if (options_.progress)
    options_.progress(cat("trained ", merges.size(), " merges, vocabulary ", vocab));
  return Tokenizer::from_json(doc, "trained BPE");
}

Tokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainerOptions& options) {
  BpeTrainer trainer(options);
  for (const std::string& t : texts) trainer.add_text(t);
  return trainer.train();
}

}  // namespace lt2
