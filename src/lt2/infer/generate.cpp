#include "lt2/infer/generate.h"

#include <algorithm>
#include <chrono>

#include "lt2/infer/engine.h"
#include "lt2/util/error.h"

namespace lt2 {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0, const torch::Device& dev) {
  if (dev.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

GenerateResult generate(LoopedLM model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                        const std::function<bool(int64_t)>& on_token) {
  LT2_CHECK(!prompt.empty(), "generate: the prompt is empty (give at least one token)");
  LT2_CHECK(opts.max_new_tokens >= 0 && opts.prefill_chunk > 0,
            "generate: max_new_tokens must be >= 0 and prefill_chunk > 0");
  Sampler::validate(opts.sampling);
  const int64_t V = model->config().vocab_size;
  for (auto t : prompt) LT2_CHECK(t >= 0 && t < V, "prompt token ", t, " is outside the vocabulary [0, ", V, ")");
  const auto device = model->parameters().front().device();
  torch::NoGradGuard ng;
  model->eval();

  GenerateResult res;
  res.prompt_tokens = static_cast<int64_t>(prompt.size());
  EngineOptions eo;
  eo.max_batch = 1;
  eo.max_len = res.prompt_tokens + std::max<int64_t>(opts.max_new_tokens, 1);
  eo.prefill_chunk = opts.prefill_chunk;
  eo.decode = opts.decode;
  eo.forward = opts.forward;
  Engine engine(model, eo);
  res.state_bytes = engine.state().bytes();
  Sampler sampler(opts.sampling, opts.seed);

  auto t0 = std::chrono::steady_clock::now();
  torch::Tensor last_logits = engine.prefill(0, torch::tensor(prompt, torch::kLong));  // [V]
  res.prefill_ms = ms_since(t0, device);

  t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    const int64_t next = sampler.sample(last_logits);
    res.tokens.push_back(next);
    if (on_token && !on_token(next)) break;
    if (std::find(opts.stop_tokens.begin(), opts.stop_tokens.end(), next) != opts.stop_tokens.end()) break;
    if (i + 1 == opts.max_new_tokens) break;
    last_logits = engine.decode(torch::full({1}, next, torch::kLong)).select(0, 0);  // [V]
  }
  res.decode_ms = ms_since(t0, device);
  return res;
}

}  // namespace lt2
