// Per-loop activation checkpointing chosen from measured memory (TrainConfig::checkpoint_loops
// "auto"). Storing every loop's activations is the fastest step; recomputing each loop but the last
// in backward (checkpointed()) keeps only the loops' inputs and the last loop's activations. `auto` measures one step of the real loss on 1 and
// 2 rows of the first micro-batch under each policy (ops::MemoryMeter: what autograd holds between
// forward and backward, and the peak through backward), extrapolates linearly to the micro-batch,
// adds the optimizer's state, and stores as many of the last layer applications' activations as fit
// the device's free memory (every application holds about the same: the need falls linearly from
// storing all T loops to storing 1), recomputing the rest.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "lt2/mixers/aux_loss.h"
#include "lt2/model/looped_lm.h"

namespace lt2 {

// Bytes of one training step on a given number of rows.
struct StepMemory {
  int64_t held = 0;  // held between forward and backward (the activations autograd saved, the loss)
  int64_t peak = 0;  // the most held at once through forward and backward (gradients included)
};

// Runs `step` (a forward, returning the loss to backpropagate) and its backward under a
// MemoryMeter on `device`; afterwards every parameter's gradient is undefined again.
StepMemory measure_step_memory(torch::nn::Module& model, const std::function<torch::Tensor()>& step,
                               torch::Device device);

struct CheckpointingChoice {
  int64_t stored_loops = 1;  // the last loops that keep their activations (ForwardOptions::stored_loops)
  int64_t partial_layers = 0;  // the layers of the loop before them that keep theirs (ForwardOptions::partial_loop_layers)
  int64_t n_loops = 1, n_layers = 1;
  bool checkpoint_loops() const { return stored_loops < n_loops; }  // whether any loop is recomputed
  int64_t stored_bytes = 0, recomputed_bytes = 0;  // a step's need storing every loop / only the last, optimizer included
  int64_t chosen_bytes = 0;                        // the need with stored_loops stored
  int64_t available_bytes = 0;
  // Whether the step storing every loop could be measured: false where its measurement on one or two
  // rows ran out of memory (stored_bytes is then -1, unknown, and only the last loop is stored).
  bool stored_measured() const { return stored_bytes >= 0; }
  std::string summary() const;  // one log line
};
// `rows` rows per micro-batch; one/two: the measurements on 1 and 2 rows (two == one when
// rows == 1) storing every loop and recomputing all but the last; `optimizer_bytes` what the
// optimizer will allocate; `available_bytes` the device's free memory; `n_loops` and `n_layers` the
// model's loops and layers. Stores the most layer applications whose need is at most 90% of what is
// available (at least the last loop's): whole loops from the last, then the last layers of the loop
// before them (every application holds about the same, so the need is linear in them). A negative
// peak in the storing measurements says they ran out of memory: only the last loop is stored.
CheckpointingChoice choose_checkpointing(int64_t rows, StepMemory stored_one, StepMemory stored_two,
                                         StepMemory recomputed_one, StepMemory recomputed_two,
                                         int64_t optimizer_bytes, int64_t available_bytes, int64_t n_loops,
                                         int64_t n_layers = 1);

// The activation memory of one model config in training (`lt2 bench activations`): a CE step
// (the fused head + loss) on random rows of `seq_len` tokens, under bf16 autocast when asked (CUDA);
// mixers with an auxiliary loss (DSA's indexer) in `aux_stage`, their loss added to the CE.
// Per token is the cost of a second row over the first, so what a step holds whatever its tokens
// (gradients, the fused head's dW) stays out of it and is reported apart. Per layer application:
// the same config with 2 layers against 1 (stored activations; NaN for a pattern of several mixers).
struct ActivationReport {
  std::string name, pattern;
  int64_t n_layers = 0, n_loops = 0, seq_len = 0;
  double layer_bytes_per_token = 0;  // held per token per (layer, loop), activations stored
  struct Policy {
    double held_per_token = 0;  // held between forward and backward
    double peak_per_token = 0;  // at the step's peak
    double fixed_peak = 0;      // the peak's part that does not grow with the tokens
  } stored, recomputed;
};
ActivationReport measure_activations(const ModelConfig& cfg, int64_t seq_len, torch::Device device, bool bf16_autocast,
                                     AuxLossStage aux_stage = AuxLossStage::Off);

// Free memory of `device`: cudaMemGetInfo on a GPU, MemAvailable of /proc/meminfo on the CPU
// (0 when unknown).
int64_t available_memory(torch::Device device);

}  // namespace lt2
