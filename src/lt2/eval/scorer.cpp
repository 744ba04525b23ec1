#include "lt2/eval/scorer.h"

#include <algorithm>
#include <numeric>

#include "lt2/eval/text.h"
#include "lt2/util/error.h"

namespace lt2::eval {

namespace {
// Tokens of a request's model input: (context + continuation)[-(max_length + 1):][:-1].
int64_t input_length(const TokenRequest& r, int64_t max_length) {
  return std::min<int64_t>(r.context.size() + r.continuation.size(), max_length + 1) - 1;
}
}  // namespace

Scorer::Scorer(LoopedLMImpl& model, ScorerOptions opts)
    : model_(model), opts_(opts), forward_(forward_options(model.config(), opts.loops)),
      exit_names_(eval::exit_names(model.config(), opts.loops)) {
  LT2_CHECK(opts_.max_length > 0 && opts_.batch_tokens > 0, "max length and batch tokens must be > 0, found ",
            opts_.max_length, " and ", opts_.batch_tokens);
}

std::vector<TokenScores> Scorer::score(const std::vector<TokenRequest>& requests, Progress* progress) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    LT2_CHECK(!r.context.empty(), "request ", i, ": the context is empty (it needs at least a prefix token)");
    LT2_CHECK(!r.continuation.empty() && static_cast<int64_t>(r.continuation.size()) <= opts_.max_length, "request ",
              i, ": the continuation has ", r.continuation.size(), " tokens; expected 1 to ", opts_.max_length,
              " (the max length)");
  }
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return input_length(requests[a], opts_.max_length) > input_length(requests[b], opts_.max_length);
  });
  std::vector<TokenScores> out(requests.size());
  for (size_t begin = 0; begin < order.size();) {
    // The first request of a batch is its longest: it sets the padded length.
    const int64_t longest = input_length(requests[order[begin]], opts_.max_length);
    const size_t count = std::max<int64_t>(1, opts_.batch_tokens / longest);
    std::vector<size_t> batch(order.begin() + begin, order.begin() + std::min(order.size(), begin + count));
    score_batch(requests, batch, out);
    if (progress) progress->add(batch.size());
    begin += batch.size();
  }
  return out;
}

void Scorer::score_batch(const std::vector<TokenRequest>& requests, const std::vector<size_t>& batch,
                         std::vector<TokenScores>& out) {
  const int64_t B = batch.size(), L = input_length(requests[batch[0]], opts_.max_length);
  std::vector<int64_t> tokens(B * L, 0);     // right-padded with id 0 (never scored)
  std::vector<int64_t> rows, targets;        // scored positions (flat b * L + t) and their tokens
  for (int64_t b = 0; b < B; ++b) {
    const auto& r = requests[batch[b]];
    std::vector<int32_t> whole(r.context);
    whole.insert(whole.end(), r.continuation.begin(), r.continuation.end());
    const int64_t n = input_length(r, opts_.max_length), first = whole.size() - (n + 1);
    for (int64_t t = 0; t < n; ++t) tokens[b * L + t] = whole[first + t];
    const int64_t c = r.continuation.size();
    for (int64_t j = 0; j < c; ++j) {
      rows.push_back(b * L + n - c + j);
      targets.push_back(r.continuation[j]);
    }
  }
  const auto device = model_.parameters().front().device();
  const auto long_opts = torch::TensorOptions().dtype(torch::kLong);
  torch::NoGradGuard no_grad;
  auto input = torch::from_blob(tokens.data(), {B, L}, long_opts).to(device);
  auto row_idx = torch::from_blob(rows.data(), {(int64_t)rows.size()}, long_opts).to(device);
  auto target = torch::from_blob(targets.data(), {(int64_t)targets.size(), 1}, long_opts).to(device);
  std::vector<Tensor> exits;  // [B, L, V] per scored exit
  {
    ModelOutput o = model_.forward(input, nullptr, forward_);
    exits = forward_.loop_logits ? std::move(o.loop_logits) : std::vector<Tensor>{std::move(o.logits)};
  }
  const int64_t E = exits.size();
  std::vector<Tensor> lp_all, greedy_all;
  for (auto& logits : exits) {
    auto scored = logits.reshape({B * L, -1}).index_select(0, row_idx).to(torch::kFloat32);  // [S, V]
    lp_all.push_back(torch::log_softmax(scored, -1).gather(1, target).squeeze(1));
    greedy_all.push_back(scored.argmax(-1) == target.squeeze(1));
    logits = Tensor();  // free each exit's logits as soon as it is scored
  }
  auto lp = torch::stack(lp_all).cpu().contiguous();                              // [E, S]
  auto greedy = torch::stack(greedy_all).to(torch::kUInt8).cpu().contiguous();  // [E, S]
  const float* lp_ptr = lp.data_ptr<float>();
  const uint8_t* gr_ptr = greedy.data_ptr<uint8_t>();
  const int64_t S = rows.size();
  int64_t offset = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = requests[batch[b]].continuation.size();
    TokenScores& s = out[batch[b]];
    s.logprobs.assign(E, {});
    s.greedy.assign(E, true);
    for (int64_t e = 0; e < E; ++e) {
      s.logprobs[e].assign(lp_ptr + e * S + offset, lp_ptr + e * S + offset + c);
      for (int64_t j = 0; j < c; ++j) s.greedy[e] = s.greedy[e] && gr_ptr[e * S + offset + j];
    }
    offset += c;
  }
}

TokenRequest encode_pair(const Tokenizer& tok, const std::string& context, const std::string& continuation,
                         int32_t prefix) {
  if (context.empty()) return TokenRequest{{prefix}, tok.encode(continuation)};
  // Python's len(context) - len(context.rstrip()): the trailing whitespace, in bytes here.
  const std::string kept = rstrip(context);
  const std::string cont = context.substr(kept.size()) + continuation;
  auto whole = tok.encode(kept + cont);
  auto ctx = tok.encode(kept);
  TokenRequest r;
  r.context = ctx;
  r.continuation.assign(whole.begin() + std::min(ctx.size(), whole.size()), whole.end());
  if (r.context.empty()) r.context = {prefix};  // a context of only whitespace
  return r;
}

std::vector<TokenLogprob> continuation_logprobs(LoopedLMImpl& model, const std::vector<int64_t>& prompt,
                                                const std::vector<int64_t>& tokens, int64_t top_n,
                                                const ForwardOptions& fo) {
  LT2_CHECK(!prompt.empty() && top_n >= 0, "continuation_logprobs: the prompt is empty or top_n < 0");
  if (tokens.empty()) return {};
  std::vector<int64_t> all(prompt);
  all.insert(all.end(), tokens.begin(), tokens.end());
  const int64_t P = prompt.size(), n = tokens.size();
  torch::NoGradGuard no_grad;
  const auto device = model.parameters().front().device();
  auto input = torch::tensor(all, torch::kLong).narrow(0, 0, P + n - 1).view({1, -1}).to(device);
  // Position P - 1 + j predicts tokens[j].
  auto lp = torch::log_softmax(model.forward(input, nullptr, fo).logits[0].narrow(0, P - 1, n).to(torch::kFloat32), -1);
  auto chosen = lp.gather(1, torch::tensor(tokens, torch::kLong).view({n, 1}).to(device)).squeeze(1).cpu();
  const int64_t k = std::min<int64_t>(top_n, lp.size(1));
  auto [top_values, top_ids] = lp.topk(k, -1);
  top_values = top_values.cpu();
  top_ids = top_ids.cpu();
  std::vector<TokenLogprob> out(n);
  for (int64_t j = 0; j < n; ++j) {
    out[j].token = tokens[j];
    out[j].logprob = chosen[j].item<float>();
    for (int64_t i = 0; i < k; ++i) out[j].top.emplace_back(top_ids[j][i].item<int64_t>(), top_values[j][i].item<float>());
  }
  return out;
}

LoglikelihoodFn model_loglikelihood(Scorer& scorer, const Tokenizer& tok, int32_t prefix, std::string label,
                                    bool quiet) {
  return [&scorer, &tok, prefix, label, quiet](const std::vector<LLRequest>& requests) {
    std::vector<TokenRequest> token_requests;
    token_requests.reserve(requests.size());
    for (const auto& r : requests) token_requests.push_back(encode_pair(tok, r.context, r.continuation, prefix));
    Progress progress(label, requests.size(), !quiet);
    auto scores = scorer.score(token_requests, &progress);
    progress.finish();
    std::vector<LLResult> out(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      for (size_t e = 0; e < scores[i].logprobs.size(); ++e) {
        double sum = 0;
        for (float v : scores[i].logprobs[e]) sum += v;
        out[i].logprob.push_back(sum);
      }
      out[i].greedy = scores[i].greedy;
    }
    return out;
  };
}

}  // namespace lt2::eval
