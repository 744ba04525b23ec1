#include "lt2/train/memory_policy.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include "lt2/kernels/kernels.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/memory_meter.h"
#include "lt2/train/aux_loss.h"
#include "lt2/train/autocast.h"
#include "lt2/train/losses.h"
#include "lt2/util/error.h"
#include "lt2/util/units.h"

namespace lt2 {

StepMemory measure_step_memory(torch::nn::Module& model, const std::function<torch::Tensor()>& step,
                               torch::Device device) {
  StepMemory m;
  {
    ops::MemoryMeter meter(device);
    auto loss = step();
    m.held = meter.current();
    loss.backward();
    m.peak = meter.peak();
  }
  for (auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
  return m;
}

namespace {
// The need of a step on `rows` rows from its measurements on one and two.
int64_t extrapolate(int64_t rows, const StepMemory& one, const StepMemory& two) {
  return one.peak + (rows - 1) * std::max<int64_t>(two.peak - one.peak, 0);
}
}  // namespace

CheckpointingChoice choose_checkpointing(int64_t rows, StepMemory stored_one, StepMemory stored_two,
                                         StepMemory recomputed_one, StepMemory recomputed_two,
                                         int64_t optimizer_bytes, int64_t available_bytes, int64_t n_loops,
                                         int64_t n_layers) {
  LT2_CHECK(rows >= 1, "choose_checkpointing: rows must be >= 1, found ", rows);
  LT2_CHECK(n_loops >= 1 && n_layers >= 1, "choose_checkpointing: n_loops and n_layers must be >= 1, found ", n_loops,
            " and ", n_layers);
  CheckpointingChoice c;
  c.n_loops = n_loops;
  c.n_layers = n_layers;
  c.recomputed_bytes = extrapolate(rows, recomputed_one, recomputed_two) + optimizer_bytes;
  c.available_bytes = available_bytes;
  if (stored_one.peak < 0 || stored_two.peak < 0) {
    c.stored_bytes = -1;
    c.stored_loops = 1;
    c.chosen_bytes = c.recomputed_bytes;
    return c;
  }
  c.stored_bytes = extrapolate(rows, stored_one, stored_two) + optimizer_bytes;
  // The need storing the last a layer applications: linear from the recomputed need (the last loop's
  // n_layers) to the stored (all n_loops n_layers).
  const int64_t least = n_layers, most = n_loops * n_layers;
  auto need = [&](int64_t a) {
    if (most == least) return c.stored_bytes;
    return c.recomputed_bytes + static_cast<int64_t>(static_cast<double>(c.stored_bytes - c.recomputed_bytes) *
                                                     static_cast<double>(a - least) /
                                                     static_cast<double>(most - least));
  };
  int64_t stored = least;
  for (int64_t a = most; a > least; --a)
    if (static_cast<double>(need(a)) <= 0.9 * static_cast<double>(available_bytes)) {
      stored = a;
      break;
    }
  c.stored_loops = stored / n_layers;
  c.partial_layers = stored % n_layers;
  c.chosen_bytes = need(stored);
  return c;
}

std::string CheckpointingChoice::summary() const {
  std::ostringstream s;
  s << "per-loop checkpointing " << (checkpoint_loops() ? "on" : "off") << " (auto): " << (n_loops - stored_loops)
    << " of " << n_loops << " loops recomputed";
  if (partial_layers > 0) s << ", the last of them only in its first " << (n_layers - partial_layers) << " of " << n_layers << " layers";
  s << "; a step needs ";
  if (stored_measured())
    s << human_bytes(stored_bytes) << " storing activations, ";
  else
    s << "more than the free memory storing activations (its measurement ran out), ";
  s << human_bytes(recomputed_bytes) << " recomputing all loops but the last, " << human_bytes(chosen_bytes)
    << " as chosen; " << human_bytes(available_bytes) << " free";
  if (chosen_bytes > 0.9 * available_bytes) s << " (it may not fit)";
  return s.str();
}

ActivationReport measure_activations(const ModelConfig& cfg, int64_t seq_len, torch::Device device, bool bf16_autocast,
                                     AuxLossStage aux_stage) {
  LT2_CHECK(seq_len >= 1, "activations: seq_len must be >= 1, found ", seq_len);
  auto step_of = [&](const ModelConfig& c, bool recompute, int64_t rows) {
    torch::manual_seed(0);
    LoopedLM model(c);
    model->to(device);
    model->train();
    set_aux_loss_stage(*model, aux_stage);
    const auto tokens = torch::randint(c.vocab_size, {rows, seq_len + 1}, torch::TensorOptions(torch::kLong).device(device));
    const auto x = tokens.narrow(1, 0, seq_len), y = tokens.narrow(1, 1, seq_len);
    return measure_step_memory(*model, [&] {
      AutocastScope ac(bf16_autocast);
      ForwardOptions fo;
      fo.checkpoint_loops = recompute;
      auto loss = lm_cross_entropy(*model, x, y, fo, LmLossOptions{});
      auto aux = aux_loss(*model);
      return aux.defined() ? loss + aux : loss;
    }, device);
  };
  ActivationReport r;
  r.name = cfg.name;
  r.pattern = cfg.layer_pattern;
  r.n_layers = cfg.n_layers;
  r.n_loops = cfg.n_loops;
  r.seq_len = seq_len;
  const double T = static_cast<double>(seq_len);
  for (bool recompute : {false, true}) {
    const auto one = step_of(cfg, recompute, 1), two = step_of(cfg, recompute, 2);
    auto& m = recompute ? r.recomputed : r.stored;
    m.held_per_token = static_cast<double>(two.held - one.held) / T;
    m.peak_per_token = static_cast<double>(two.peak - one.peak) / T;
    m.fixed_peak = static_cast<double>(one.peak) - m.peak_per_token * T;
  }
  r.layer_bytes_per_token = std::numeric_limits<double>::quiet_NaN();
  if (find_mixer(cfg.layer_pattern)) {  // one mixer everywhere: a layer's share is 2 layers minus 1
    ModelConfig one = cfg, two = cfg;
    one.n_layers = 1;
    two.n_layers = 2;
    r.layer_bytes_per_token = static_cast<double>(step_of(two, false, 1).held - step_of(one, false, 1).held) /
                              (T * static_cast<double>(cfg.n_loops));
  }
  return r;
}

int64_t available_memory(torch::Device device) {
  if (device.is_cuda()) {
    size_t free_b = 0, total_b = 0;
    return kernels::device_memory(&free_b, &total_b) ? static_cast<int64_t>(free_b) : 0;
  }
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

}  // namespace lt2
