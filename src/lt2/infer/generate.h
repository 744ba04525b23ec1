// Text generation with a looped model through the inference Engine (one slot): chunked prefill of
// the prompt, then one token at a time (on CUDA a replayed graph per step).
#pragma once
#include <functional>
#include <vector>

#include "lt2/infer/sampling.h"
#include "lt2/model/looped_lm.h"
#include "lt2/ops/decode_options.h"

namespace lt2 {

struct GenerateOptions {
  int64_t max_new_tokens = 128;
  int64_t prefill_chunk = 512;   // prompt tokens per prefill call
  SamplingOptions sampling;
  uint64_t seed = 0;
  std::vector<int64_t> stop_tokens;  // generation ends after emitting one of these
  DecodeOptions decode;              // the engine's kernels and launch settings
  ForwardOptions forward;            // options of every forward (loops, Ouro exit control)
};

struct GenerateResult {
  std::vector<int64_t> tokens;  // the new tokens
  int64_t prompt_tokens = 0;
  double prefill_ms = 0, decode_ms = 0;
  int64_t state_bytes = 0;
  double decode_tokens_per_s() const { return decode_ms > 0 ? 1000.0 * (tokens.size() > 0 ? tokens.size() - 1 : 0) / decode_ms : 0; }
  double prefill_tokens_per_s() const { return prefill_ms > 0 ? 1000.0 * prompt_tokens / prefill_ms : 0; }
};

// on_token is called with each new token as soon as it is chosen; returning false stops.
// The model goes into eval mode and has its projections packed for inference (same values).
GenerateResult generate(LoopedLM model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                        const std::function<bool(int64_t)>& on_token = nullptr);

}  // namespace lt2
