// FLOP counts for throughput and MFU. Matmul FLOPs only (2 per multiply-add), the convention of
// the PaLM / Chinchilla MFU figures: training = 3x forward (forward + 2x backward).
#pragma once
#include <cstdint>
#include <string>

#include "lt2/model/looped_lm.h"

namespace lt2 {

// Forward FLOPs per token at context length `seq_len` (causal: a token attends to seq_len/2
// keys on average in full attention). Weights are counted once per loop.
double forward_flops_per_token(const LoopedLMImpl& model, int64_t seq_len);
// Dense bf16 peak of the GPU (from its name), or $LT2_PEAK_TFLOPS; 0 when unknown.
double peak_flops(const std::string& device_name);

}  // namespace lt2
