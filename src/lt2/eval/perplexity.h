// Perplexity of documents by rolling windows, as lm-evaluation-harness's `loglikelihood_rolling`
// scores them: every token is scored exactly once, with as much left context as the window holds.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "lt2/eval/scorer.h"
#include "lt2/util/json.h"

namespace lt2::eval {

struct Document {
  std::string scored;           // the text whose tokens are scored (wikitext: detokenised)
  std::string counted;          // the text whose words and UTF-8 bytes the metrics divide by
                                // (wikitext: the article before detokenisation, as the harness does)
  std::vector<int32_t> tokens;  // set when the data is already tokens (a shard): scored as they are
};

struct DocumentOptions {
  std::string field = "text";               // JSONL: the field holding a document
  bool wikitext = false;                    // plain text: split into WikiText articles and detokenise
  std::string separator = "<|endoftext|>";  // shards: the token between documents
};

// Documents of `path`: an `lt2 data` shard (one document per separator-delimited run of tokens),
// a JSONL file (".jsonl": one document per line, from `field`), or plain text (the whole file is
// one document; with `wikitext`, its articles). Throws lt2::Error naming the file, the line and the
// field for bad input, and for a file with no document.
std::vector<Document> read_documents(const std::string& path, const DocumentOptions& opts, const Tokenizer& tok);

// The harness's get_rolling_token_windows(tokens, prefix, max_length, context_len = 1), each window
// made disjoint (make_disjoint_window): the continuations cut `tokens` into consecutive pieces of at
// most max_length tokens; the first piece's context is [prefix], every later one's the max_length +
// 1 - len(piece) tokens before it, so its input fills the window.
std::vector<TokenRequest> rolling_windows(const std::vector<int32_t>& tokens, int32_t prefix, int64_t max_length);

struct PerplexityResult {
  int64_t documents = 0, tokens = 0, words = 0, bytes = 0;
  std::vector<std::string> exits;    // what each column is (Scorer::exit_names)
  std::vector<double> loglikelihood; // [exit]: sum over every token of every document (nats)
  double scoring_seconds = 0;        // wall time of the scoring forwards (the results back on the host)
  double tokens_per_s() const { return scoring_seconds > 0 ? tokens / scoring_seconds : 0; }
  // Per exit: exp(-ll / tokens), exp(-ll / words), exp(-ll / bytes), -ll / (bytes ln 2).
  double token_perplexity(size_t e) const;
  double word_perplexity(size_t e) const;
  double byte_perplexity(size_t e) const;
  double bits_per_byte(size_t e) const;
  json to_json() const;
  std::string markdown() const;  // a table: one row per exit
};

// Scores every document (all windows of all documents batched together). With `per_token`, writes
// one JSON line per token: {"doc", "index", "token" (id), "text", "logprob"} (logprob: a number, or
// an array with one value per exit).
PerplexityResult evaluate_perplexity(Scorer& scorer, const Tokenizer& tok, const std::vector<Document>& docs,
                                     int32_t prefix, std::ostream* per_token = nullptr, bool quiet = false);

}  // namespace lt2::eval
