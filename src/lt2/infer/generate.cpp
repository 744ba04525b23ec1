#include "lt2/infer/generate.h"

#include <algorithm>
#include <chrono>

#include "lt2/util/error.h"

namespace lt2 {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0, const torch::Device& dev) {
  if (dev.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

GenerateResult generate(LoopedLMImpl& model, const std::vector<int64_t>& prompt,
                        const GenerateOptions& opts, const std::function<bool(int64_t)>& on_token) {
  LT2_CHECK(!prompt.empty(), "generate: the prompt is empty (give at least one token)");
  LT2_CHECK(opts.max_new_tokens >= 0 && opts.prefill_chunk > 0,
            "generate: max_new_tokens must be >= 0 and prefill_chunk > 0");
  Sampler::validate(opts.sampling);
  const int64_t V = model.config().vocab_size;
  for (auto t : prompt) LT2_CHECK(t >= 0 && t < V, "prompt token ", t, " is outside the vocabulary [0, ", V, ")");
  auto param = model.parameters().front();
  const auto device = param.device();
  torch::NoGradGuard ng;
  model.eval();

  GenerateResult res;
  res.prompt_tokens = static_cast<int64_t>(prompt.size());
  auto state = model.make_state(1, res.prompt_tokens + opts.max_new_tokens,
                                torch::TensorOptions().dtype(param.scalar_type()).device(device));
  res.state_bytes = state->bytes();
  Sampler sampler(opts.sampling, opts.seed);
  auto long_opts = torch::TensorOptions().dtype(torch::kLong);

  auto t0 = std::chrono::steady_clock::now();
  torch::Tensor last_logits;
  for (int64_t begin = 0; begin < res.prompt_tokens; begin += opts.prefill_chunk) {
    const int64_t n = std::min(opts.prefill_chunk, res.prompt_tokens - begin);
    auto chunk = torch::tensor(std::vector<int64_t>(prompt.begin() + begin, prompt.begin() + begin + n), long_opts)
                     .view({1, n}).to(device);
    last_logits = model.forward(chunk, state.get(), opts.forward).logits.select(1, n - 1).squeeze(0);  // [V]
  }
  res.prefill_ms = ms_since(t0, device);

  t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    const int64_t next = sampler.sample(last_logits);
    res.tokens.push_back(next);
    if (on_token && !on_token(next)) break;
    if (std::find(opts.stop_tokens.begin(), opts.stop_tokens.end(), next) != opts.stop_tokens.end()) break;
    if (i + 1 == opts.max_new_tokens) break;
    auto tok = torch::full({1, 1}, next, long_opts.device(device));
    last_logits = model.forward(tok, state.get(), opts.forward).logits.select(1, 0).squeeze(0);
  }
  res.decode_ms = ms_since(t0, device);
  return res;
}

}  // namespace lt2
