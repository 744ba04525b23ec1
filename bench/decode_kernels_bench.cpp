// Micro-benchmark of the fused decode kernels: the rows of the kernel-case table
// (tests/gpu/kernel_cases/, which the GPU tests check), by default those at a model's decode shapes
// (its GDN and attention heads, widths and projections at each batch size, attention at each
// context); --all-shapes adds the table's fixed cases, the shapes at each kernel's edges. One more
// row, gdn_layer_step, times the whole GDN layer's decode step (projections + kernel + o_proj).
// Ops (--kernels): recurrent_step, gdn_decode (the form the launcher picks), gdn_decode_registers,
// gdn_decode_per_head, gdn_decode_cluster (one form forced), attention_decode, rope_cache_write,
// rms_norm, add_rms_norm, silu_mul, gemv (each K split of --gemv-splits; 0: the one gemv picks),
// gemv_chain (a block's tail chained in one kernel, or two and a GEMV for w2; and each projection
// alone through the chain kernel), gemv_batched, gdn_layer_step.
// A kernel is captured `reps` times in one CUDA graph (as the engine runs it: no launch gaps) and
// the replays are timed with CUDA events; the median per call is reported with the bytes the call
// must move, GB/s and the % of a device-to-device copy measured in the same run. Rows whose
// weights are streamed (gemv, gemv_chain) rotate over enough weight copies that none is served
// from L2. The libtorch reference of each (what the kernel replaces) is timed next to it: eagerly
// with the fused kernels off per call with CUDA events, or, for the launch-bound ones (the
// elementwise ops, the RoPE cache write, the GEMVs against at::linear, the chain against one
// gemv_fused launch per product), graph-replayed like the kernel. A table, then one
// `RESULT {json}` line per row.
//   decode_kernels_bench [--model lt2-full-gdn-1.3b] [--batches 1,8,32]
//                        [--contexts 4096,8192,16384,32768,65536,131072] [--dtype bf16] [--kernels ...]
//                        [--all-shapes]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "gpu/kernel_cases/kernel_cases.h"
#include "lt2/config/presets.h"
#include "lt2/infer/bench.h"
#include "lt2/kernels/decode.h"
#include "lt2/mixers/gdn.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"
#include "lt2/util/json.h"

#ifdef LT2_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using torch::Tensor;
namespace kc = lt2::kernel_cases;

struct Settings {
  std::string model = "lt2-full-gdn-1.3b", dtype = "bf16";
  std::vector<int64_t> batches{1, 8, 32};
  std::vector<int64_t> contexts{4096, 8192, 16384, 32768, 65536, 131072};
  std::vector<std::string> kernels;  // empty: every op and gdn_layer_step
  std::vector<int> gemv_splits{0};   // 0: the K splits gemv picks
  bool all_shapes = false;
  int warmup = 5, iters = 20, reps = 10;
  bool reference = true;
};

struct Row {
  std::string kernel, shape;
  int64_t batch = 0, context = 0;  // context: attention only
  double us = 0, bytes = 0, reference_us = 0;
  int reps = 0;  // kernel calls per captured graph
};

#ifdef LT2_WITH_CUDA

// Median milliseconds of f over `iters` calls timed with CUDA events, after `warmup` calls.
double median_ms(int warmup, int iters, const std::function<void()>& f) {
  for (int i = 0; i < warmup; ++i) f();
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    start.record();
    f();
    stop.record();
    stop.synchronize();
    ms.push_back(start.elapsed_time(stop));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Microseconds per call of f when `reps` calls are captured in one CUDA graph and replayed.
double graph_us(const Settings& s, int reps, const std::function<void()>& f) {
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());  // capture needs a side stream
  f();  // eager warm-up: lazy initialisation and kernel attributes happen outside the capture
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  for (int r = 0; r < reps; ++r) f();
  graph.capture_end();
  return 1e3 * median_ms(s.warmup, s.iters, [&] { graph.replay(); }) / reps;
}

// Microseconds per eager call of f with the fused decode kernels off (the libtorch reference).
double reference_us(const Settings& s, const std::function<void()>& f) {
  lt2::DecodeOptions reference;
  reference.fused = false;
  lt2::DecodeOptionsGuard guard(reference);
  return 1e3 * median_ms(s.warmup, s.iters, f);
}

// A row of the kernel-case table: the kernel in a graph, its reference graph-replayed or eager.
Row bench_case(const Settings& s, const kc::KernelCase& c, const kc::KernelRun& run) {
  Row r{c.op, c.shape, c.batch, c.context};
  r.reps = std::max(s.reps, run.min_reps);
  r.us = graph_us(s, r.reps, run.kernel);
  r.bytes = run.bytes;
  if (s.reference && run.reference)
    r.reference_us = run.reference_in_graph ? graph_us(s, r.reps, run.reference) : reference_us(s, run.reference);
  return r;
}

// The GDN layer's decode step (projections + kernel + o_proj): its parameters are read once, its
// state read and written once.
Row bench_gdn_layer(const Settings& s, const lt2::ModelConfig& cfg, int64_t B, torch::ScalarType dt) {
  torch::NoGradGuard ng;
  auto m = std::dynamic_pointer_cast<lt2::GatedDeltaNetImpl>(lt2::make_mixer("gdn", cfg, 0));
  LT2_CHECK(m, "decode_kernels_bench: no GDN mixer for ", cfg.name);
  m->to(torch::kCUDA, dt);
  m->eval();
  const int64_t d = m->q_proj->weight.size(1);
  auto x = torch::randn({B, 1, d}, torch::TensorOptions().device(torch::kCUDA).dtype(dt));
  auto state = m->make_state(B, 1, x.options());
  for (auto& t : state->tensors()) t.copy_(torch::randn_like(t, torch::kFloat32) * 0.1);
  lt2::Positions pos;
  pos.seq_pos = torch::zeros({B}, x.options().dtype(torch::kInt64));  // no length bookkeeping
  Row r{"gdn_layer_step", lt2::cat("d", d, " H", m->num_heads, " K", m->head_k_dim, " V", m->head_v_dim), B};
  r.reps = s.reps;
  r.us = graph_us(s, r.reps, [&] { m->step(x, pos, *state); });
  double params = 0;
  for (const auto& p : m->parameters()) params += static_cast<double>(p.nbytes());
  r.bytes = params + 2 * static_cast<double>(state->bytes()) + 2 * static_cast<double>(x.nbytes());
  if (s.reference) r.reference_us = reference_us(s, [&] { m->step(x, pos, *state); });
  return r;
}

#endif  // LT2_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Time the fused decode kernels against the copy bandwidth and their libtorch references"};
  Settings s;
  app.add_option("--model", s.model, "Preset (or config file) whose decode shapes to time")->capture_default_str();
  app.add_option("--batches", s.batches, "Batch sizes")->delimiter(',')->capture_default_str();
  app.add_option("--contexts", s.contexts, "Keys per sequence for attention")->delimiter(',')->capture_default_str();
  app.add_option("--kernels", s.kernels, "Which ops (default: all): the table's and gdn_layer_step")->delimiter(',');
  app.add_flag("--all-shapes", s.all_shapes, "Also the table's fixed cases, the shapes at each kernel's edges");
  app.add_option("--dtype", s.dtype, "Activation dtype: bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  app.add_option("--warmup", s.warmup, "Untimed calls before timing")->capture_default_str();
  app.add_option("--iters", s.iters, "Timed calls (graph replays); the median is reported")->capture_default_str();
  app.add_option("--reps", s.reps, "Kernel calls captured per graph")->capture_default_str();
  app.add_option("--gemv-splits", s.gemv_splits,
                 "gemv rows: K splits over a thread-block cluster to time (0: the ones gemv picks)")
      ->delimiter(',')->check(CLI::Range(0, lt2::kernels::kGemvMaxKSplits))->capture_default_str();
  app.add_flag("!--no-reference", s.reference, "Skip timing the libtorch references");
  CLI11_PARSE(app, argc, argv);
#ifndef LT2_WITH_CUDA
  std::fprintf(stderr, "decode_kernels_bench: this build has no CUDA kernels\n");
  return 1;
#else
  try {
    LT2_CHECK(torch::cuda::is_available(), "decode_kernels_bench needs a CUDA GPU");
    LT2_CHECK(s.iters >= 1 && s.reps >= 1 && s.warmup >= 0, "--iters and --reps must be >= 1, --warmup >= 0");
    const auto dt = s.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    kc::CaseGrid grid;
    grid.model = lt2::load_model_config(s.model);
    grid.dtypes = {dt};
    grid.batches = s.batches, grid.contexts = s.contexts, grid.gemv_splits = s.gemv_splits;
    const auto cases = kc::kernel_cases(grid);
    auto wants = [&](const std::string& op) {
      return s.kernels.empty() || std::count(s.kernels.begin(), s.kernels.end(), op) > 0;
    };
    const double copy_gbs = lt2::measure_copy_bandwidth_gbs("cuda");
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbs);

    std::printf("\n| kernel | shape | batch | context | us | MB moved | GB/s | %% copy BW | reference us | speed-up |\n"
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    std::vector<lt2::json> results;
    auto report = [&](const Row& r) {
      const double gbs = r.bytes / (r.us * 1e-6) / 1e9;
      char context[32] = "-", reference[32] = "-", speedup[32] = "-";
      if (r.context) std::snprintf(context, sizeof context, "%lld", static_cast<long long>(r.context));
      if (r.reference_us > 0) {
        std::snprintf(reference, sizeof reference, "%.1f", r.reference_us);
        std::snprintf(speedup, sizeof speedup, "%.1fx", r.reference_us / r.us);
      }
      std::printf("| %s | %s | %lld | %s | %.1f | %.2f | %.0f | %.1f | %s | %s |\n", r.kernel.c_str(), r.shape.c_str(),
                  static_cast<long long>(r.batch), context, r.us, r.bytes / 1e6, gbs, 100 * gbs / copy_gbs, reference,
                  speedup);
      std::fflush(stdout);
      lt2::json j{{"bench", "decode_kernels"}, {"model", grid.model.name}, {"kernel", r.kernel}, {"shape", r.shape},
                  {"dtype", s.dtype}, {"batch", r.batch}, {"us", r.us}, {"bytes", r.bytes}, {"gb_per_s", gbs},
                  {"copy_gb_per_s", copy_gbs}, {"copy_pct", 100 * gbs / copy_gbs}, {"graph_reps", r.reps}};
      if (r.context) j["context"] = r.context;
      if (r.reference_us > 0) {
        j["reference_us"] = r.reference_us;
        j["speedup"] = r.reference_us / r.us;
      }
      results.push_back(j);
    };
    torch::NoGradGuard ng;
    for (const auto& c : cases) {
      if (!wants(c.op) || c.dtype != dt || !(c.model_shape || s.all_shapes)) continue;
      try {
        const auto run = c.setup(kc::Purpose::Time);
        if (run.skip.empty()) report(bench_case(s, c, run));
      } catch (const c10::OutOfMemoryError&) {
        std::printf("| %s | %s | %lld | %lld | OOM |\n", c.op.c_str(), c.shape.c_str(), static_cast<long long>(c.batch),
                    static_cast<long long>(c.context));
      }
      c10::cuda::CUDACachingAllocator::emptyCache();  // the next row's inputs may be larger
    }
    if (wants("gdn_layer_step"))
      for (int64_t B : s.batches) report(bench_gdn_layer(s, grid.model, B, dt));
    std::printf("\n");
    for (const auto& j : results) std::printf("RESULT %s\n", j.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_kernels_bench: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}
