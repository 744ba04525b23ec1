#include "lt2/infer/memory_plan.h"

#include <algorithm>

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

}  // namespace lt2
