#include "lt2/infer/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <map>
#include <set>

#include "lt2/config/presets.h"
#include "lt2/infer/engine.h"
#include "lt2/infer/memory_plan.h"
#include "lt2/kernels/kernels.h"
#include "lt2/model/looped_lm.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"
#include "lt2/util/gnuplot.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace lt2 {

namespace {

constexpr double kGB = 1e9;

void synchronize(const torch::Device& dev) {
  if (dev.is_cuda()) torch::cuda::synchronize();
}

// Seconds per call of f, over `iters` calls after the device is idle.
template <class F>
double seconds_per_call(const torch::Device& dev, int64_t iters, F&& f) {
  synchronize(dev);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) f();
  synchronize(dev);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(iters);
}

void release_cached_memory() {
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

// Device memory in use (everything, the caching allocator's reserve included), in GB; 0 on the CPU.
double device_used_gb() {
  size_t free_b = 0, total_b = 0;
  return kernels::device_memory(&free_b, &total_b) ? double(total_b - free_b) / kGB : 0;
}

// Bytes the cell may allocate: the given limit, or the device's free memory now.
int64_t available_bytes(const BenchOptions& o, const torch::Device& dev) {
  return o.memory_limit_gb ? static_cast<int64_t>(*o.memory_limit_gb * kGB) : device_free_bytes(dev);
}

struct LoadedModel {
  std::string name;
  LoopedLM model{nullptr};
};

LoadedModel load_bench_model(const std::string& name, const BenchOptions& o, const torch::Device& dev) {
  auto cfg = load_model_config(name);
  if (cfg.vocab_size == 0) cfg.vocab_size = 32000;  // presets that take it from data
  torch::manual_seed(o.seed);
  LoadedModel m{cfg.name, LoopedLM(cfg)};
  m.model->to(dev, o.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32);
  m.model->eval();
  return m;
}

BenchCell run_decode_cell(LoopedLM& model, const std::string& name, const std::string& path, int64_t C,
                          int64_t B, const BenchOptions& o, double copy_gbs, const torch::Device& dev) {
  BenchCell c;
  c.mode = "decode", c.model = name, c.path = path, c.context = C, c.batch = B;
  const auto dtype = model->parameters().front().scalar_type();
  const int64_t max_len = C + o.warmup + o.steps + o.profile_steps + 1;
  const auto plan = plan_memory(*model, B, max_len, dtype, o.prefill_chunk, C);
  c.gb_per_step = double(plan.decode_step_bytes) / kGB;
  c.planned_gb = double(plan.total_bytes()) / kGB;
  if (copy_gbs > 0) c.floor_ms = 1e3 * c.gb_per_step / copy_gbs;
  release_cached_memory();
  if (!fits_in(plan.state_bytes + plan.workspace_bytes, available_bytes(o, dev))) {
    c.oom = true;
    return c;
  }
  torch::NoGradGuard no_grad;
  const int64_t V = model->config().vocab_size;
  auto tokens = torch::randint(V, {B}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  auto input = tokens.view({B, 1});
  std::function<void()> step;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ModelState> state;
  DecodeOptions reference_options;
  reference_options.fused = false;
  DecodeOptionsGuard decode_options(path == "engine" ? o.decode : reference_options);
  if (path == "engine") {
    EngineOptions eo;
    eo.decode = o.decode;
    eo.max_batch = B;
    eo.max_len = max_len;
    eo.prefill_chunk = o.prefill_chunk;
    eo.every_bucket = false;  // the benchmark decodes full batches only
    engine = std::make_unique<Engine>(model, eo);
    c.decode_plan = engine->decode_plan(B).describe();
    engine->fill_random(C, o.seed);
    step = [&] { engine->decode(tokens); };
  } else {
    LT2_CHECK(path == "reference", "bench path must be 'engine' or 'reference', found '", path, "'");
    state = model->make_state(B, max_len, torch::TensorOptions().dtype(dtype).device(dev));
    torch::manual_seed(o.seed);
    for (auto& m : state->mixers) {
      for (auto& t : m->tensors()) t.normal_(0.0, 0.1);
      m->length = C;
    }
    state->length = C;
    step = [&] { model->forward(input, state.get()); };
  }
  for (int64_t i = 0; i < o.warmup; ++i) step();
  const double s = seconds_per_call(dev, o.steps, step);
  c.memory_gb = device_used_gb();
  if (engine && o.profile_steps > 0) c.profile = profile_device_activity(step, o.profile_steps, o.profile_ops);
  c.ms = 1e3 * s;
  c.tokens_per_s = double(B) / s;
  if (copy_gbs > 0) c.bandwidth_pct = 100.0 * (c.gb_per_step / s) / copy_gbs;
  return c;
}

BenchCell run_prefill_cell(LoopedLM& model, const std::string& name, int64_t C, const BenchOptions& o,
                           const torch::Device& dev) {
  BenchCell c;
  c.mode = "prefill", c.model = name, c.path = "engine", c.context = C, c.batch = 1;
  const auto dtype = model->parameters().front().scalar_type();
  const auto plan = plan_memory(*model, 1, C, dtype, o.prefill_chunk, C);
  c.planned_gb = double(plan.total_bytes()) / kGB;
  release_cached_memory();
  if (!fits_in(plan.state_bytes + plan.workspace_bytes, available_bytes(o, dev))) {
    c.oom = true;
    return c;
  }
  EngineOptions eo;
  eo.max_batch = 1;
  eo.max_len = C;
  eo.prefill_chunk = o.prefill_chunk;
  eo.decode = o.decode;
  eo.cuda_graphs = false;  // prefill does not replay graphs
  Engine engine(model, eo);
  torch::manual_seed(o.seed);
  auto prompt = torch::randint(model->config().vocab_size, {C}, torch::kLong).to(dev);
  // Warm-up over up to two chunks, so that a prompt's second chunk (attention over a cached prefix,
  // a masked path with a one-time cost at its first use in a process) has run once before the
  // timed prefill (bench/notes/prefill.md).
  engine.prefill(0, prompt.narrow(0, 0, std::min<int64_t>(C, 2 * o.prefill_chunk)));
  const double s = seconds_per_call(dev, 1, [&] { engine.prefill(0, prompt); });
  c.memory_gb = device_used_gb();
  c.ms = 1e3 * s;
  c.tokens_per_s = double(C) / s;
  if (o.profile_steps > 0)
    c.profile = profile_device_activity([&] { engine.prefill(0, prompt); }, o.profile_steps, o.profile_ops);
  return c;
}

template <class RunModel>
std::vector<BenchCell> for_each_model(const BenchOptions& o, RunModel&& run) {
  LT2_CHECK(!o.models.empty(), "bench: give at least one model");
  LT2_CHECK(o.dtype == "bf16" || o.dtype == "fp32", "bench: --dtype must be bf16 or fp32, found '", o.dtype, "'");
  LT2_CHECK(o.device == "cuda" || o.device == "cpu", "bench: --device must be cuda or cpu, found '", o.device, "'");
  LT2_CHECK(o.device == "cpu" || torch::cuda::is_available(), "bench: --device cuda but no CUDA GPU is visible");
  LT2_CHECK(o.steps > 0 && o.warmup >= 0, "bench: --steps must be > 0 and --warmup >= 0, found ", o.steps, " and ",
            o.warmup);
  LT2_CHECK(o.profile_steps >= 0, "bench: --profile must be >= 0 (0: off), found ", o.profile_steps);
  LT2_CHECK(!o.memory_limit_gb || *o.memory_limit_gb > 0, "bench: --memory-limit-gb must be > 0, found ",
            o.memory_limit_gb.value_or(0));
  for (auto c : o.contexts) LT2_CHECK(c > 0, "bench: contexts must be > 0, found ", c);
  for (auto b : o.batches) LT2_CHECK(b > 0, "bench: batch sizes must be > 0, found ", b);
  const torch::Device dev(o.device == "cuda" ? torch::kCUDA : torch::kCPU);
  std::vector<BenchCell> cells;
  for (const auto& name : o.models) {
    auto m = load_bench_model(name, o, dev);
    run(m, dev, cells);
    m.model = LoopedLM(nullptr);
    release_cached_memory();
  }
  return cells;
}

}  // namespace

nlohmann::json BenchCell::to_json() const {
  nlohmann::json j{{"mode", mode}, {"model", model}, {"path", path}, {"context", context}, {"batch", batch},
          {"oom", oom}, {"ms", ms}, {"tokens_per_s", tokens_per_s}, {"gb_per_step", gb_per_step},
          {"bandwidth_pct", bandwidth_pct}, {"floor_ms", floor_ms}, {"memory_gb", memory_gb},
          {"planned_gb", planned_gb}};
  if (profile.steps > 0) j["profile"] = profile.to_json(40);
  if (!decode_plan.empty()) j["decode_plan"] = decode_plan;
  return j;
}

std::vector<BenchCell> cells_from_json(const nlohmann::json& j) {
  std::vector<BenchCell> out;
  const auto& rows = j.contains("cells") ? j.at("cells") : j;
  LT2_CHECK(rows.is_array(), "bench results: expected an array of cells or {\"cells\": [...]}");
  for (const auto& r : rows) {
    BenchCell c;
    c.mode = r.at("mode"), c.model = r.at("model"), c.path = r.at("path");
    c.context = r.at("context"), c.batch = r.at("batch"), c.oom = r.at("oom");
    c.ms = r.at("ms"), c.tokens_per_s = r.at("tokens_per_s"), c.gb_per_step = r.at("gb_per_step");
    c.bandwidth_pct = r.at("bandwidth_pct"), c.floor_ms = r.at("floor_ms");
    c.memory_gb = r.at("memory_gb"), c.planned_gb = r.at("planned_gb");
    c.decode_plan = r.value("decode_plan", "");
    out.push_back(c);
  }
  return out;
}

double measure_copy_bandwidth_gbs(const std::string& device) {
  if (device != "cuda") return 0;
  const int64_t n = int64_t(1) << 30;
  auto src = torch::empty({n}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA)).fill_(1);
  auto dst = torch::empty_like(src);
  const torch::Device dev(torch::kCUDA);
  std::vector<double> rates;
  for (int i = 0; i < 7; ++i)
    rates.push_back(2.0 * double(n) / kGB / seconds_per_call(dev, 5, [&] { dst.copy_(src); }));
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

std::vector<BenchCell> bench_decode(const BenchOptions& o, double copy_gbs,
                                    const std::function<void(const BenchCell&)>& on_cell) {
  return for_each_model(o, [&](LoadedModel& m, const torch::Device& dev, std::vector<BenchCell>& cells) {
    // The reference first: the engine packs the model's projections, which the plain libtorch
    // path must not benefit from.
    auto paths = o.paths;
    std::stable_sort(paths.begin(), paths.end(), [](const std::string& a, const std::string& b) {
      return a == "reference" && b != "reference";
    });
    for (const auto& path : paths)
      for (int64_t B : o.batches)
        for (int64_t C : o.contexts) {
          cells.push_back(run_decode_cell(m.model, m.name, path, C, B, o, copy_gbs, dev));
          if (on_cell) on_cell(cells.back());
        }
  });
}

std::vector<BenchCell> bench_prefill(const BenchOptions& o, const std::function<void(const BenchCell&)>& on_cell) {
  return for_each_model(o, [&](LoadedModel& m, const torch::Device& dev, std::vector<BenchCell>& cells) {
    for (int64_t C : o.contexts) {
      cells.push_back(run_prefill_cell(m.model, m.name, C, o, dev));
      if (on_cell) on_cell(cells.back());
    }
  });
}

std::string bench_profile_tables(const std::vector<BenchCell>& cells, size_t top) {
  std::string out;
  for (const auto& c : cells)
    if (c.profile.steps > 0)
      out += cat("### ", c.model, " ", c.path, ", context ", c.context, ", batch ", c.batch, ": ",
                 std::round(c.ms * 100) / 100, c.mode == "prefill" ? " ms per prefill\n\n" : " ms/step\n\n",
                 kernel_profile_table(c.profile, top), "\n");
  return out;
}

std::string bench_table(const std::vector<BenchCell>& cells) {
  std::string out =
      "| mode | model | path | context | batch | ms | tokens/s | GB/step | floor ms | % copy BW | mem GB |\n"
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  char buf[512];
  for (const auto& c : cells) {
    if (c.oom) {
      std::snprintf(buf, sizeof buf, "| %s | %s | %s | %lld | %lld | OOM (plan %.1f GB) | | | | | |\n", c.mode.c_str(),
                    c.model.c_str(), c.path.c_str(), (long long)c.context, (long long)c.batch, c.planned_gb);
    } else if (c.mode == "decode") {
      std::snprintf(buf, sizeof buf, "| decode | %s | %s | %lld | %lld | %.2f | %.1f | %.2f | %.2f | %.0f%% | %.1f |\n",
                    c.model.c_str(), c.path.c_str(), (long long)c.context, (long long)c.batch, c.ms, c.tokens_per_s,
                    c.gb_per_step, c.floor_ms, c.bandwidth_pct, c.memory_gb);
    } else {
      std::snprintf(buf, sizeof buf, "| prefill | %s | %s | %lld | %lld | %.1f | %.0f | | | | %.1f |\n", c.model.c_str(),
                    c.path.c_str(), (long long)c.context, (long long)c.batch, c.ms, c.tokens_per_s, c.memory_gb);
    }
    out += buf;
  }
  return out;
}

bool plot_bench(const std::vector<BenchCell>& cells, const std::string& mode, const std::string& png_path) {
  // One series per (model, path, batch); points (context, tokens/s), OOM cells left out. A model
  // keeps one colour, a batch size one point shape, the reference path dashed lines, so that
  // fifteen series stay tellable apart.
  struct Series {
    std::string model, path;
    int64_t batch = 0;
    std::vector<std::pair<int64_t, double>> points;
  };
  std::map<std::string, Series> series;
  std::vector<std::string> models;
  std::vector<int64_t> batches;
  for (const auto& c : cells) {
    if (c.mode != mode || c.oom) continue;
    const std::string key = mode == "decode" ? cat(c.model, " ", c.path, " b", c.batch) : c.model;
    auto& s = series[key];
    s.model = c.model, s.path = c.path, s.batch = mode == "decode" ? c.batch : 0;
    s.points.push_back({c.context, c.tokens_per_s});
    if (std::find(models.begin(), models.end(), c.model) == models.end()) models.push_back(c.model);
    if (std::find(batches.begin(), batches.end(), s.batch) == batches.end()) batches.push_back(s.batch);
  }
  if (series.empty()) return false;
  static const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  constexpr int kPointTypes[] = {7, 5, 9, 11, 13, 1, 2, 3};
  auto index_of = [](const auto& v, const auto& x) { return std::find(v.begin(), v.end(), x) - v.begin(); };
  std::string script = cat("set title ", gnuplot_quote(mode == "decode" ? "decode tokens/s vs context" : "prefill tokens/s vs context"),
                           "\nset xlabel 'context (tokens)'\nset ylabel 'tokens/s'\nset logscale xy 2\n"
                           "set key outside right\nset grid\nplot ");
  std::string data;
  bool first = true;
  for (const auto& [key, s] : series) {
    const auto colour = kColours[index_of(models, s.model) % std::size(kColours)];
    const int point = kPointTypes[index_of(batches, s.batch) % std::size(kPointTypes)];
    script += cat(first ? "" : ", ", "'-' using 1:2 with linespoints lw 2 lc rgb '", colour, "' pt ", point,
                  " dt ", s.path == "reference" ? 2 : 1, " title ", gnuplot_quote(key));
    first = false;
    for (const auto& [x, y] : s.points) data += cat(x, " ", y, "\n");
    data += "e\n";
  }
  return plot_png(png_path, script + "\n" + data, 1200, 650);
}

}  // namespace lt2
