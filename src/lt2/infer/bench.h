// `lt2 bench decode|prefill`: inference speed of model presets over a grid of contexts and
// batch sizes, against the bandwidth floor (llama-bench style table, JSON, PNG).
//
// Decode cell (model, context C, batch B, path):
//   engine     the Engine: fused decode kernels + one CUDA graph replay per step;
//   reference  the plain libtorch decode (LoopedLM::forward with a state, the fused kernels off,
//              no graph): what the engine is measured against.
// Each sequence's state is filled with random values as if it held C tokens (decode cost does not
// depend on the values; prefilling 32 x 128k tokens first would take longer than the whole
// benchmark), then `steps` steps are timed after `warmup` steps. Bytes per step come from the
// memory plan (weights once per loop, the head once, what each state's step reads and writes);
// bandwidth % is against a device-to-device copy measured in the same run. A cell whose plan
// does not fit the device is reported as OOM without being run.
// Prefill cell (model, C): one prompt of C random tokens through Engine::prefill, batch 1.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lt2/infer/kernel_profile.h"
#include "lt2/ops/decode_options.h"

namespace lt2 {

struct BenchOptions {
  std::vector<std::string> models;             // presets or config files
  std::vector<int64_t> contexts{4096};
  std::vector<int64_t> batches{1};
  std::vector<std::string> paths{"engine", "reference"};  // decode only
  int64_t steps = 20, warmup = 3;
  std::string dtype = "bf16";                  // bf16 or fp32
  std::string device = "cuda";                 // cuda or cpu
  int64_t prefill_chunk = 8192;
  std::optional<double> memory_limit_gb;       // plan against this instead of the device's free memory
  uint64_t seed = 0;
  int64_t profile_steps = 0;                   // engine cells: profile this many decode steps / prefills (0: off)
  bool profile_ops = false;                    // the profile lists each kernel per launching operator
  DecodeOptions decode;                        // the engine's kernels and launch settings (A/B switches)
};

struct BenchCell {
  std::string mode;   // decode | prefill
  std::string model, path;
  int64_t context = 0, batch = 0;
  bool oom = false;   // the plan did not fit: not run
  double ms = 0;                 // per decode step, or per prefill
  double tokens_per_s = 0;       // decode: batch / step time; prefill: context / time
  double gb_per_step = 0;        // decode: bytes one step moves (the floor's numerator)
  double bandwidth_pct = 0;      // decode: gb_per_step / time, as % of the measured copy bandwidth
  double floor_ms = 0;           // decode: gb_per_step / copy bandwidth
  double memory_gb = 0;          // device memory in use during the cell (planned on the CPU)
  double planned_gb = 0;         // weights + states + workspace from the plan
  KernelProfile profile;         // engine cells with profile_steps > 0 (CUDA only)
  std::string decode_plan;       // engine decode cells: the engine's DecodePlan::describe()
  nlohmann::json to_json() const;
};

// Device-to-device copy bandwidth (bytes read + written per second), median of several copies of
// a 1 GiB buffer; 0 on the CPU.
double measure_copy_bandwidth_gbs(const std::string& device);

// Runs the grid; `on_cell` sees each cell as soon as it is measured (progress, streaming JSON).
std::vector<BenchCell> bench_decode(const BenchOptions& opts, double copy_gbs,
                                    const std::function<void(const BenchCell&)>& on_cell = nullptr);
std::vector<BenchCell> bench_prefill(const BenchOptions& opts,
                                     const std::function<void(const BenchCell&)>& on_cell = nullptr);

// Markdown: each profiled cell's kernel table (kernel_profile_table), `top` kernels each.
std::string bench_profile_tables(const std::vector<BenchCell>& cells, size_t top);

// Markdown table, llama-bench style.
std::string bench_table(const std::vector<BenchCell>& cells);
// PNG of tokens/s vs context, one line per (model, path, batch) of decode cells (prefill cells:
// one line per model). Returns false when gnuplot is not installed.
bool plot_bench(const std::vector<BenchCell>& cells, const std::string& mode, const std::string& png_path);
std::vector<BenchCell> cells_from_json(const nlohmann::json& j);

}  // namespace lt2
