#include "lt2/infer/memory_plan.h"

#include <algorithm>

#include "lt2/kernels/kernels.h"

namespace lt2 {

nlohmann::json MemoryPlan::to_json() const {
  return {{"weight_bytes", weight_bytes},
          {"state_bytes", state_bytes},
          {"workspace_bytes", workspace_bytes},
          {"total_bytes", total_bytes()},
          {"decode_step_bytes", decode_step_bytes}};
}

MemoryPlan plan_memory(const LoopedLMImpl& model, int64_t batch, int64_t max_len, torch::ScalarType dtype,
                       int64_t prefill_chunk, int64_t decode_context) {
  LT2_CHECK(batch > 0 && max_len > 0 && prefill_chunk > 0 && decode_context >= 0,
            "plan_memory: batch, max_len and prefill_chunk must be > 0 and decode_context >= 0");
  const auto& cfg = model.config();
  const int64_t elem = c10::elementSize(dtype);
  MemoryPlan p;
  p.weight_bytes = model.num_parameters() * elem;
  auto state = model.make_state(batch, max_len, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
  p.state_bytes = state->bytes();

  // Activations alive at once, with room for the widest mixer's projections and the fp32 copies
  // the recurrences make: ~12 d + 4 ffn values per prefill token; the decode step's logits.
  const int64_t d = cfg.d_model, ffn = cfg.ffn_dim(), V = cfg.vocab_size;
  // Mixers with dense score blocks (DSA's prefill) add one block's worth.
  const int64_t chunk = std::min(prefill_chunk, max_len);
  int64_t blocks = 0;
  for (const auto& m : model.mixers()) blocks = std::max(blocks, m->prefill_workspace_bytes(1, chunk, max_len));
  const int64_t prefill = chunk * (12 * d + 4 * ffn) * 4 + blocks;
  const int64_t decode = batch * (V * (elem + 4) + 16 * d * 4);
  p.workspace_bytes = std::max(prefill, decode);

  // Decode traffic: the stack's weights once per loop; the embedding rows and the head once.
  const int64_t embedding = model.tok_embeddings->weight.numel();
  const int64_t head = model.output ? model.output->weight.numel() : embedding;
  const int64_t stack = model.num_parameters() - embedding - (model.output ? head : 0);
  p.decode_step_bytes = (stack * cfg.n_loops + head + batch * d) * elem;
  for (const auto& m : state->mixers) p.decode_step_bytes += m->decode_bytes(decode_context);
  return p;
}

bool fits_in(int64_t need, int64_t available) {
  const double margin = 0.05 * double(available) + double(int64_t(1) << 30);
  return double(need) + margin <= double(available);
}

int64_t max_rows_that_fit(const LoopedLMImpl& model, int64_t max_len, torch::ScalarType dtype, int64_t prefill_chunk,
                          int64_t available) {
  const auto fits = [&](int64_t rows) {
    const auto p = plan_memory(model, rows, max_len, dtype, prefill_chunk, max_len);
    return fits_in(p.state_bytes + p.workspace_bytes, available);
  };
  // Need grows with rows: double to a bound that does not fit, then bisect. Past 2^20 rows the
  // answer is "more than any batch" (and byte counts would near overflow).
  constexpr int64_t kMaxRows = int64_t(1) << 20;
  int64_t lo = 0, hi = 1;
  while (fits(hi)) {
    lo = hi;
    if (hi >= kMaxRows) return lo;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

int64_t device_free_bytes(const torch::Device& device) {
  size_t free_b = 0, total_b = 0;
  if (device.is_cuda() && kernels::device_memory(&free_b, &total_b)) return static_cast<int64_t>(free_b);
  return INT64_MAX / 4;
}

}  // namespace lt2
