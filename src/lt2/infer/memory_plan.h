// Memory planning for inference: the bytes a model needs for a batch and a context, computed
// before anything is allocated, and whether that fits a device (`lt2 bench` reports a cell that
// does not fit as OOM from the plan instead of crashing into it).
#pragma once
#include <nlohmann/json.hpp>

#include "lt2/model/looped_lm.h"

namespace lt2 {

struct MemoryPlan {
  int64_t weight_bytes = 0;     // parameters in the inference dtype
  int64_t state_bytes = 0;      // every (loop, layer) state for batch x max_len: exactly what
                                // make_state allocates (sized on the meta device)
  int64_t workspace_bytes = 0;  // activations of a prefill chunk and of a decode step (estimate)
  int64_t total_bytes() const { return weight_bytes + state_bytes + workspace_bytes; }
  // Bytes one decode step of the whole batch moves at `context` tokens per sequence: every weight
  // of the stack once per loop, the LM head once, and what each state's step reads and writes.
  int64_t decode_step_bytes = 0;
  nlohmann::json to_json() const;
};

// dtype: the weights' and KV caches' dtype at inference (recurrent states are fp32).
// decode_context: the tokens each sequence holds when decode_step_bytes is counted.
MemoryPlan plan_memory(const LoopedLMImpl& model, int64_t batch, int64_t max_len, torch::ScalarType dtype,
                       int64_t prefill_chunk, int64_t decode_context);

// Whether `need` bytes fit in `available` with a safety margin for the CUDA context, library
// workspaces and allocator fragmentation (5% + 1 GiB).
bool fits_in(int64_t need, int64_t available);

// The most rows (sequences of max_len tokens) whose state and workspace fit in `available` bytes
// (fits_in); 0 when not even one does.
int64_t max_rows_that_fit(const LoopedLMImpl& model, int64_t max_len, torch::ScalarType dtype, int64_t prefill_chunk,
                          int64_t available);

// Free bytes of a CUDA device now; INT64_MAX / 4 elsewhere (host memory is not planned).
int64_t device_free_bytes(const torch::Device& device);

}  // namespace lt2
