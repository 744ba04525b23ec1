// Log-likelihoods of continuations, batched on the model's device, in lm-evaluation-harness's
// conventions (`_loglikelihood_tokens`): a request's input is (context + continuation) cut to its
// last max_length + 1 tokens, minus the last; the continuation's tokens are scored at the end.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lt2/eval/model.h"
#include "lt2/eval/progress.h"

namespace lt2::eval {

struct TokenRequest {
  std::vector<int32_t> context;       // at least one token
  std::vector<int32_t> continuation;  // scored; at most max_length tokens
};

struct TokenScores {
  std::vector<std::vector<float>> logprobs;  // [exit][continuation token]: log p(token | before), fp32
  std::vector<bool> greedy;                  // [exit]: every continuation token is the argmax
};

struct ScorerOptions {
  int64_t max_length = 2048;     // tokens per input (the model's window)
  int64_t batch_tokens = 8192;   // padded tokens per forward (at least one request per forward)
  LoopOptions loops;
};

// Scores token requests with one model. Requests are sorted by length (longest first, so memory
// problems show at once) and packed into right-padded batches of about batch_tokens tokens; each
// forward runs under NoGradGuard, and the scored rows get their log-softmax in fp32.
class Scorer {
 public:
  Scorer(LoopedLMImpl& model, ScorerOptions opts);
  // One TokenScores per request, in request order. `progress` (optional) advances per request.
  std::vector<TokenScores> score(const std::vector<TokenRequest>& requests, Progress* progress = nullptr);
  int64_t num_exits() const { return static_cast<int64_t>(exit_names_.size()); }
  const std::vector<std::string>& exit_names() const { return exit_names_; }
  const ScorerOptions& options() const { return opts_; }

 private:
  void score_batch(const std::vector<TokenRequest>& requests, const std::vector<size_t>& batch,
                   std::vector<TokenScores>& out);
  LoopedLMImpl& model_;
  ScorerOptions opts_;
  ForwardOptions forward_;
  std::vector<std::string> exit_names_;
};

// A (context, continuation) text pair, scored as the harness's `loglikelihood` request.
struct LLRequest {
  std::string context, continuation;
};
struct LLResult {
  std::vector<double> logprob;  // [exit]: sum of the continuation's token log-probs
  std::vector<bool> greedy;     // [exit]: greedy decoding would produce the continuation
};
// Scores text pairs; one LLResult per request, each with the same number of exits. The
// multiple-choice scorer takes this, so tests can give it log-likelihoods they choose.
using LoglikelihoodFn = std::function<std::vector<LLResult>(const std::vector<LLRequest>&)>;

// The harness's `_encode_pair`: trailing whitespace of the context moves to the front of the
// continuation; the continuation's tokens are those of encode(context + continuation) past the
// length of encode(context); an empty context becomes [prefix].
TokenRequest encode_pair(const Tokenizer& tok, const std::string& context, const std::string& continuation,
                         int32_t prefix);

struct TokenLogprob {
  int64_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int64_t, float>> top;  // the most likely tokens at that position, best first
};
// The log-probability of each of `tokens` after the prompt and the tokens before it, with the
// `top_n` most likely alternatives at each position: one forward over prompt + tokens (no grad),
// log-softmax in fp32. (`lt2 generate --logprobs`: the model's distribution, before temperature.)
std::vector<TokenLogprob> continuation_logprobs(LoopedLMImpl& model, const std::vector<int64_t>& prompt,
                                                const std::vector<int64_t>& tokens, int64_t top_n,
                                                const ForwardOptions& fo);

// A LoglikelihoodFn over `scorer` and `tok` (progress on stderr labelled `label` unless quiet).
LoglikelihoodFn model_loglikelihood(Scorer& scorer, const Tokenizer& tok, int32_t prefix, std::string label,
                                    bool quiet = false);

}  // namespace lt2::eval
