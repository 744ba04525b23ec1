#include "lt2/eval/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "lt2/data/shard.h"
#include "lt2/eval/records.h"
#include "lt2/eval/text.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2::eval {

namespace {

bool is_shard(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  return in.gcount() == 8 && std::memcmp(magic, kShardMagic, 8) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<Document> shard_documents(const std::string& path, const DocumentOptions& opts, const Tokenizer& tok) {
  ShardReader shard(path);
  LT2_CHECK(shard.vocab_size() <= tok.vocab_size(), "shard '", path, "' has vocab_size ", shard.vocab_size(),
            " but the tokenizer has ", tok.vocab_size(), " ids: it was made with another tokenizer");
  const auto sep = tok.token_to_id(opts.separator);
  LT2_CHECK(sep, "the separator '", opts.separator, "' is not a token of the tokenizer (set --separator)");
  std::vector<Document> docs;
  std::vector<int32_t> current;
  auto flush = [&] {
    if (current.empty()) return;
    Document d;
    d.tokens = std::move(current);
    d.counted = tok.decode_bytes(d.tokens);
    docs.push_back(std::move(d));
    current.clear();
  };
  for (int64_t i = 0; i < shard.size(); ++i) {
    const auto t = static_cast<int32_t>(shard.at(i));
    if (t == *sep) flush(); else current.push_back(t);
  }
  flush();
  return docs;
}

}  // namespace

std::vector<Document> read_documents(const std::string& path, const DocumentOptions& opts, const Tokenizer& tok) {
  LT2_CHECK(path_exists(path), "data file '", path, "' does not exist");
  std::vector<Document> docs;
  if (is_shard(path)) {
    LT2_CHECK(!opts.wikitext, "--wikitext reads a raw WikiText file, but '", path, "' is a token shard");
    docs = shard_documents(path, opts, tok);
  } else if (ends_with(path, ".jsonl")) {
    LT2_CHECK(!opts.wikitext, "--wikitext reads a raw WikiText file, but '", path, "' is JSONL");
    for (const auto& r : read_jsonl(path)) {
      std::string text = str_field(r, opts.field.c_str());
      docs.push_back({text, text, {}});
    }
  } else if (opts.wikitext) {
    for (auto& page : split_wikitext_articles(read_file(path))) docs.push_back({wikitext_detokenize(page), page, {}});
  } else {
    std::string text = read_file(path);
    docs.push_back({text, text, {}});
  }
  docs.erase(std::remove_if(docs.begin(), docs.end(), [](const Document& d) { return d.tokens.empty() && d.scored.empty(); }),
             docs.end());
  LT2_CHECK(!docs.empty(), "'", path, "' holds no document (the file is empty)");
  return docs;
}

std::vector<TokenRequest> rolling_windows(const std::vector<int32_t>& tokens, int32_t prefix, int64_t max_length) {
  LT2_CHECK(max_length >= 1, "rolling windows: max length must be >= 1, found ", max_length);
  std::vector<TokenRequest> out;
  const int64_t n = tokens.size();
  if (n == 0) return out;
  const int64_t first = std::min(max_length, n);
  out.push_back({{prefix}, std::vector<int32_t>(tokens.begin(), tokens.begin() + first)});
  for (int64_t predicted = first; predicted < n;) {
    const int64_t len = std::min(n - predicted, max_length), end = predicted + len;
    // Context: the max_length + 1 - len tokens before the piece (input = max_length tokens).
    out.push_back({std::vector<int32_t>(tokens.begin() + (end - max_length - 1), tokens.begin() + (end - len)),
                   std::vector<int32_t>(tokens.begin() + (end - len), tokens.begin() + end)});
    predicted = end;
  }
  return out;
}

double PerplexityResult::token_perplexity(size_t e) const { return std::exp(-loglikelihood[e] / tokens); }
double PerplexityResult::word_perplexity(size_t e) const { return std::exp(-loglikelihood[e] / words); }
double PerplexityResult::byte_perplexity(size_t e) const { return std::exp(-loglikelihood[e] / bytes); }
double PerplexityResult::bits_per_byte(size_t e) const { return -loglikelihood[e] / (bytes * std::log(2.0)); }

json PerplexityResult::to_json() const {
  json per_exit = json::array();
  for (size_t e = 0; e < exits.size(); ++e)
    per_exit.push_back({{"exit", exits[e]}, {"loglikelihood", loglikelihood[e]},
                        {"token_perplexity", token_perplexity(e)}, {"word_perplexity", word_perplexity(e)},
                        {"byte_perplexity", byte_perplexity(e)}, {"bits_per_byte", bits_per_byte(e)}});
  return {{"documents", documents}, {"tokens", tokens},          {"words", words},
          {"bytes", bytes},         {"exits", per_exit},         {"scoring_seconds", scoring_seconds},
          {"tokens_per_s", tokens_per_s()}};
}

std::string PerplexityResult::markdown() const {
  std::string s = "| exit | token ppl | word ppl | byte ppl | bits/byte |\n| --- | --- | --- | --- | --- |\n";
  char buf[256];
  for (size_t e = 0; e < exits.size(); ++e) {
    std::snprintf(buf, sizeof buf, "| %s | %.4f | %.4f | %.4f | %.4f |\n", exits[e].c_str(), token_perplexity(e),
                  word_perplexity(e), byte_perplexity(e), bits_per_byte(e));
    s += buf;
  }
  std::snprintf(buf, sizeof buf, "\n%lld documents, %lld tokens, %lld words, %lld bytes; scored in %.2f s (%.0f tokens/s)\n",
                (long long)documents, (long long)tokens, (long long)words, (long long)bytes, scoring_seconds,
                tokens_per_s());
  return s + buf;
}

PerplexityResult evaluate_perplexity(Scorer& scorer, const Tokenizer& tok, const std::vector<Document>& docs,
                                     int32_t prefix, std::ostream* per_token, bool quiet) {
  PerplexityResult res;
  res.exits = scorer.exit_names();
  res.loglikelihood.assign(res.exits.size(), 0.0);
  res.documents = docs.size();
  std::vector<TokenRequest> windows;
  std::vector<size_t> window_doc;  // the document of each window
  for (size_t d = 0; d < docs.size(); ++d) {
    const auto tokens = docs[d].tokens.empty() ? tok.encode(docs[d].scored) : docs[d].tokens;
    for (auto& w : rolling_windows(tokens, prefix, scorer.options().max_length)) {
      windows.push_back(std::move(w));
      window_doc.push_back(d);
    }
    res.tokens += tokens.size();
    res.words += count_words(docs[d].counted);
    res.bytes += docs[d].counted.size();
  }
  LT2_CHECK(res.tokens > 0, "the documents have no tokens");
  Progress progress("ppl windows", windows.size(), !quiet);
  const auto t0 = std::chrono::steady_clock::now();
  const auto scores = scorer.score(windows, &progress);
  res.scoring_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  progress.finish();
  // Windows are in document order and, within a document, in token order.
  int64_t index = 0;
  for (size_t w = 0; w < windows.size(); ++w) {
    if (w > 0 && window_doc[w] != window_doc[w - 1]) index = 0;
    const auto& s = scores[w];
    for (size_t e = 0; e < s.logprobs.size(); ++e)
      for (float v : s.logprobs[e]) res.loglikelihood[e] += v;
    if (!per_token) continue;
    for (size_t j = 0; j < windows[w].continuation.size(); ++j, ++index) {
      const int32_t id = windows[w].continuation[j];
      json line{{"doc", window_doc[w]}, {"index", index}, {"token", id}, {"text", tok.decode({id})}};
      if (s.logprobs.size() == 1) {
        line["logprob"] = s.logprobs[0][j];
      } else {
        json per_exit = json::array();
        for (const auto& lp : s.logprobs) per_exit.push_back(lp[j]);
        line["logprob"] = per_exit;
      }
      *per_token << line.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
    }
  }
  return res;
}

}  // namespace lt2::eval
