// lt2 bench decode|prefill|plot: inference speed over contexts x batch sizes (infer/bench.h);
// lt2 bench activations: training activation memory per mixer (train/memory_policy.h).
#include <cstdio>
#include <cmath>
#include <ctime>

#include "commands.h"
#include "lt2/config/presets.h"
#include "lt2/infer/bench.h"
#include "lt2/mixers/registry.h"
#include "lt2/train/aux_loss.h"
#include "lt2/train/memory_policy.h"
#include "lt2/kernels/kernels.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2::cli {

namespace {

struct BenchArgs {
  BenchOptions opts;
  std::vector<std::string> contexts{"4k"}, batches{"1"};
  std::string json_path, md_path, png_path, profile_md_path;
  std::vector<std::string> decode_options;  // name=value
  bool json_stdout = false;
};

// "8192", "8k", "128K" -> tokens.
int64_t parse_count(const std::string& s, const char* what) {
  LT2_CHECK(!s.empty(), what, ": empty value");
  std::string digits = s;
  int64_t mult = 1;
  if (s.back() == 'k' || s.back() == 'K') mult = 1024, digits.pop_back();
  size_t used = 0;
  int64_t v = -1;
  try {
    v = std::stoll(digits, &used);
  } catch (...) {
  }
  LT2_CHECK(used == digits.size() && v > 0, what, ": expected a positive count like 8192 or 8k, found '", s, "'");
  return v * mult;
}

std::string today() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

void run_bench(const std::string& mode, BenchArgs& a, const std::string& command_line) {
  a.opts.contexts.clear();
  a.opts.batches.clear();
  for (const auto& c : a.contexts) a.opts.contexts.push_back(parse_count(c, "--contexts"));
  for (const auto& b : a.batches) a.opts.batches.push_back(parse_count(b, "--batches"));
  for (const auto& p : a.opts.paths)
    LT2_CHECK(p == "engine" || p == "reference", "--paths: expected engine or reference, found '", p, "'");
  for (const auto& setting : a.decode_options) {
    const auto eq = setting.find('=');
    LT2_CHECK(eq != std::string::npos, "--decode-option: expected name=value, found '", setting, "'");
    a.opts.decode.set(setting.substr(0, eq), setting.substr(eq + 1));
  }
  const double copy_gbs = mode == "decode" ? measure_copy_bandwidth_gbs(a.opts.device) : 0;
  const std::string device = a.opts.device == "cuda" ? kernels::device_name(0) : "cpu";
  if (copy_gbs > 0) std::fprintf(stderr, "device %s, measured copy bandwidth %.0f GB/s\n", device.c_str(), copy_gbs);
  std::string logged_plan;  // the decode plan, logged where it changes (a model, a batch size)
  auto progress = [&logged_plan](const BenchCell& c) {
    if (!c.decode_plan.empty() && c.decode_plan != logged_plan)
      std::fprintf(stderr, "decode plan of %s at batch %lld: %s\n", c.model.c_str(), (long long)c.batch,
                   c.decode_plan.c_str());
    if (!c.decode_plan.empty()) logged_plan = c.decode_plan;
    if (c.oom)
      std::fprintf(stderr, "%s %s %s ctx %lld batch %lld: OOM from the plan (%.1f GB)\n", c.mode.c_str(),
                   c.model.c_str(), c.path.c_str(), (long long)c.context, (long long)c.batch, c.planned_gb);
    else
      std::fprintf(stderr, "%s %s %s ctx %lld batch %lld: %.2f ms, %.1f tokens/s%s\n", c.mode.c_str(), c.model.c_str(),
                   c.path.c_str(), (long long)c.context, (long long)c.batch, c.ms, c.tokens_per_s,
                   c.mode == "decode" ? cat(", ", int(c.bandwidth_pct + 0.5), "% of copy bandwidth").c_str() : "");
    if (c.profile.steps > 0) std::fprintf(stderr, "%s\n", kernel_profile_table(c.profile, 12).c_str());
  };
  auto cells = mode == "decode" ? bench_decode(a.opts, copy_gbs, progress) : bench_prefill(a.opts, progress);
  nlohmann::json j{{"mode", mode}, {"command", command_line}, {"date", today()}, {"device", device},
                   {"copy_bandwidth_gbs", copy_gbs}, {"dtype", a.opts.dtype}, {"steps", a.opts.steps},
                   {"warmup", a.opts.warmup}, {"decode_options", a.opts.decode.describe()},
                   {"cells", nlohmann::json::array()}};
  for (const auto& c : cells) j["cells"].push_back(c.to_json());
  const std::string table = bench_table(cells);
  if (!a.json_path.empty()) write_file_atomic(a.json_path, j.dump(2) + "\n");
  if (!a.profile_md_path.empty())
    write_file_atomic(a.profile_md_path, cat("`", command_line, "` on ", device, ", ", today(), "\n\n",
                                             bench_profile_tables(cells, 30)));
  if (!a.md_path.empty()) write_file_atomic(a.md_path, cat("`", command_line, "` on ", device, ", ", today(), "\n\n", table));
  if (!a.png_path.empty() && !plot_bench(cells, mode, a.png_path))
    std::fprintf(stderr, "note: no plot written (gnuplot not installed, or no cell ran); `lt2 bench plot` "
                         "renders one later from the JSON\n");
  if (a.json_stdout) std::printf("%s\n", j.dump(2).c_str());
  else std::printf("%s", table.c_str());
}

// --profile, --profile-ops and --profile-md; `what` begins --profile's help, `ops_note` ends --profile-ops'.
void add_profile_options(CLI::App* cmd, BenchArgs& a, const std::string& what, const std::string& ops_note) {
  auto* profile = cmd->add_option("--profile", a.opts.profile_steps,
                                  what + " with the CUDA profiler and report the GPU time per kernel, busy time "
                                         "and the gaps between kernels (0: off)")
                      ->capture_default_str();
  cmd->add_flag("--profile-ops", a.opts.profile_ops,
                "With --profile: list each kernel per launching operator and its first input's sizes and dtype" +
                    ops_note)
      ->needs(profile);
  cmd->add_option("--profile-md", a.profile_md_path, "Write the per-kernel tables of --profile to this file");
}

void add_grid_options(CLI::App* cmd, BenchArgs& a) {
  cmd->add_option("--models,-m", a.opts.models,
                  "Models: presets (lt-1.3b, lt2-gdn-1.3b, lt2-full-gdn-1.3b, lt2-gdn-dsa-1.3b, ouro-1.4b, ...) or "
                  "config files; random weights")
      ->required()->delimiter(',');
  cmd->add_option("--contexts,-c", a.contexts, "Context lengths (tokens per sequence), e.g. 4k,8k,32k")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("--dtype", a.opts.dtype, "Weights and KV caches: bf16 or fp32 (recurrent states are fp32)")
      ->capture_default_str();
  cmd->add_option("--device", a.opts.device, "cuda or cpu")->capture_default_str();
  cmd->add_option("--prefill-chunk", a.opts.prefill_chunk, "Prompt tokens per prefill forward")->capture_default_str();
  cmd->add_option("--decode-option", a.decode_options,
                  "name=value, repeatable: an engine kernel switch or bound (A/B runs; docs/decode.md). Names: " +
                      decode_option_names())
      ->delimiter(';');
  cmd->add_option("--memory-limit-gb", a.opts.memory_limit_gb,
                  "Plan against this many GB instead of the device's free memory (cells that do not fit are OOM)")
      ->capture_default_str();
  cmd->add_option("--seed", a.opts.seed, "Seed of the random weights, states and tokens")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--out-json", a.json_path, "Write the results as JSON to this file");
  cmd->add_option("--out-md", a.md_path, "Write the Markdown table to this file");
  cmd->add_option("--plot", a.png_path, "Write a PNG of tokens/s vs context (needs gnuplot)");
  cmd->add_flag("--json", a.json_stdout, "Print JSON instead of the table");
}

struct ActivationArgs {
  std::string base = "lt2-gdn-100m";
  std::vector<std::string> mixers{"all"}, models;
  int64_t seq_len = 1024, vocab = 32768;
  std::string device = "auto", dtype = "auto", indexer_stage = "off", json_path, md_path;
};

void run_activations(const ActivationArgs& a, const std::string& command_line) {
  const bool cuda = a.device == "cuda" || (a.device == "auto" && torch::cuda::is_available());
  LT2_CHECK(a.device == "auto" || a.device == "cpu" || a.device == "cuda", "--device: expected auto, cpu or cuda, found '",
            a.device, "'");
  LT2_CHECK(a.dtype == "auto" || a.dtype == "fp32" || a.dtype == "bf16", "--dtype: expected auto, fp32 or bf16, found '",
            a.dtype, "'");
  LT2_CHECK(!(a.dtype == "bf16" && !cuda), "--dtype bf16 (autocast) needs a CUDA device");
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  const bool bf16 = cuda && a.dtype != "fp32";
  const auto aux_stage = parse_aux_loss_stage(a.indexer_stage);
  std::vector<ModelConfig> configs;
  std::vector<std::string> mixers = a.mixers;
  if (mixers.size() == 1 && mixers[0] == "all") {
    mixers.clear();
    for (const auto& m : mixer_registry()) mixers.push_back(m.name);
  }
  for (const auto& name : mixers) {
    if (name == "none") continue;
    LT2_CHECK(find_mixer(name), "--mixers: unknown mixer '", name, "' (registered: ", registered_mixer_names(), ")");
    ModelConfig c = load_model_config(a.base);
    c.layer_pattern = name;
    c.name = a.base + " / " + name;
    configs.push_back(c);
  }
  for (const auto& m : a.models) configs.push_back(load_model_config(m));
  for (auto& c : configs) {
    if (c.vocab_size == 0) c.vocab_size = a.vocab;  // "from the data"
    c.validate();
  }
  std::string table = cat(
      "| model | pattern | layers x loops | per token per layer-loop | per token held: stored | recomputed | "
      "per token at the peak: stored | recomputed | fixed at the peak: stored | recomputed |\n"
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  auto kib = [](double bytes) { return std::isnan(bytes) ? std::string("") : cat(std::lround(bytes / 1024), " KiB"); };
  auto mib = [](double bytes) { return cat(std::lround(bytes / (1 << 20)), " MiB"); };
  auto policy_json = [](const ActivationReport::Policy& p) {
    return nlohmann::json{{"held_per_token", p.held_per_token}, {"peak_per_token", p.peak_per_token},
                          {"fixed_peak", p.fixed_peak}};
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& c : configs) {
    std::fprintf(stderr, "activations: %s (%s)\n", c.name.c_str(), c.layer_pattern.c_str());
    const auto r = measure_activations(c, a.seq_len, device, bf16, aux_stage);
    table += cat("| ", r.name, " | ", r.pattern, " | ", r.n_layers, " x ", r.n_loops, " | ", kib(r.layer_bytes_per_token),
                 " | ", kib(r.stored.held_per_token), " | ", kib(r.recomputed.held_per_token), " | ",
                 kib(r.stored.peak_per_token), " | ", kib(r.recomputed.peak_per_token), " | ", mib(r.stored.fixed_peak),
                 " | ", mib(r.recomputed.fixed_peak), " |\n");
    rows.push_back({{"model", r.name}, {"pattern", r.pattern}, {"n_layers", r.n_layers}, {"n_loops", r.n_loops},
                    {"layer_bytes_per_token",
                     std::isnan(r.layer_bytes_per_token) ? nlohmann::json() : nlohmann::json(r.layer_bytes_per_token)},
                    {"stored", policy_json(r.stored)}, {"recomputed", policy_json(r.recomputed)}});
  }
  const std::string dev = cuda ? kernels::device_name(0) : "cpu";
  nlohmann::json j{{"mode", "activations"}, {"command", command_line}, {"date", today()}, {"device", dev},
                   {"dtype", bf16 ? "bf16 autocast" : "fp32"}, {"seq_len", a.seq_len}, {"indexer_stage", a.indexer_stage},
                   {"models", rows}};
  if (!a.json_path.empty()) write_file_atomic(a.json_path, j.dump(2) + "\n");
  if (!a.md_path.empty()) write_file_atomic(a.md_path, table);
  std::printf("%s", table.c_str());
}

// This process's command line (recorded with the results).
std::string command_line() {
  std::string raw = path_exists("/proc/self/cmdline") ? read_file("/proc/self/cmdline") : "lt2 bench";
  for (auto& ch : raw)
    if (ch == '\0') ch = ' ';
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand(
      "bench", "Benchmarks: decode and prefill speed vs context and batch; training activation memory per mixer");
  bench->require_subcommand(1);
  auto args = std::make_shared<BenchArgs>();
  args->opts.contexts = {4096};

  auto* decode = bench->add_subcommand(
      "decode",
      "Decode tokens/s per (model, context, batch), through the engine (fused kernels + CUDA graphs) and the "
      "plain libtorch reference, against the bandwidth floor");
  add_grid_options(decode, *args);
  decode->add_option("--batches,-b", args->batches, "Batch sizes (sequences decoded together)")
      ->delimiter(',')->capture_default_str();
  decode->add_option("--paths", args->opts.paths, "engine, reference, or both")->delimiter(',')->capture_default_str();
  decode->add_option("--steps", args->opts.steps, "Timed decode steps per cell")->capture_default_str();
  decode->add_option("--warmup", args->opts.warmup, "Untimed steps before timing")->capture_default_str();
  add_profile_options(decode, *args, "Engine cells: after timing, record this many steps",
                      " (kernels replayed from a CUDA graph have none)");
  decode->footer(
      "Each sequence's state is filled with random values as if it held `context` tokens; decode cost does not "
      "depend on the values. GB/step = weights once per loop + the head + what each state's step reads and "
      "writes; % copy BW compares GB/step / time with a device-to-device copy measured in the same run.");
  decode->callback([args] { run_bench("decode", *args, command_line()); });

  auto* prefill = bench->add_subcommand("prefill", "Prefill tokens/s of one prompt per (model, context), batch 1");
  add_grid_options(prefill, *args);
  add_profile_options(prefill, *args, "After timing, record this many prefills", "");
  prefill->callback([args] { run_bench("prefill", *args, command_line()); });

  auto act = std::make_shared<ActivationArgs>();
  auto* activations = bench->add_subcommand(
      "activations", "Training activation memory per mixer: bytes per token held for backward and at the peak of a "
                     "step, storing activations and recomputing each loop (per-loop checkpointing)");
  activations->add_option("--base", act->base, "Preset or config whose shape every --mixers row uses")->capture_default_str();
  activations->add_option("--mixers", act->mixers, "Mixers, each as the base's only mixer: all (every registered one), "
                                                   "none, or names (" + registered_mixer_names() + ")")
      ->delimiter(',')->capture_default_str();
  activations->add_option("--models,-m", act->models, "Further presets or configs measured as they are (hybrids)")
      ->delimiter(',');
  activations->add_option("--seq-len", act->seq_len, "Tokens per row")->capture_default_str()->check(at_least(1));
  activations->add_option("--vocab", act->vocab, "Vocabulary of configs that take theirs from the data (vocab_size 0)")
      ->capture_default_str()->check(at_least(2));
  activations->add_option("--device", act->device, "auto, cpu or cuda")->capture_default_str();
  activations->add_option("--dtype", act->dtype, "auto (bf16 autocast on CUDA, fp32 on the CPU), fp32 or bf16")
      ->capture_default_str();
  activations->add_option("--indexer-stage", act->indexer_stage,
                          "off, dense_warmup or sparse: DSA's indexer stage, its KL loss added to the step's (as "
                          "lt2 train's indexer_stage)")->capture_default_str();
  activations->add_option("--out-json", act->json_path, "Write the results as JSON to this file");
  activations->add_option("--out-md", act->md_path, "Write the Markdown table to this file");
  activations->footer("A CE training step on rows of --seq-len random tokens, measured on 1 and 2 rows: per token is "
                      "what the second row adds, fixed is the rest (gradients, the fused head's dW). 'per token per "
                      "layer-loop' is one layer application's share: the base with 2 layers minus 1, over the loops. "
                      "Recomputing keeps only each loop's input between forward and backward and rebuilds one loop "
                      "at a time.");
  activations->callback([act] { run_activations(*act, command_line()); });

  auto plot_in = std::make_shared<std::string>();
  auto plot_out = std::make_shared<std::string>();
  auto* plot = bench->add_subcommand("plot", "Render the PNG of a results JSON written by --out-json");
  plot->add_option("results", *plot_in, "Results JSON")->required();
  plot->add_option("--out,-o", *plot_out, "PNG to write")->required();
  plot->callback([plot_in, plot_out] {
    auto j = nlohmann::json::parse(read_file(*plot_in), nullptr, /*allow_exceptions=*/false);
    LT2_CHECK(!j.is_discarded(), "'", *plot_in, "' is not valid JSON");
    const std::string mode = j.value("mode", std::string("decode"));
    LT2_CHECK(plot_bench(cells_from_json(j), mode, *plot_out), "no plot written: gnuplot is not installed or '",
              *plot_in, "' has no measured cell");
  });
}

}  // namespace lt2::cli
