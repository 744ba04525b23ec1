// lt2 info: a model's config, parameter counts and decode-state memory for a context and batch.
#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "lt2/config/presets.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/mixers/registry.h"
#include "lt2/model/looped_lm.h"

namespace lt2::cli {

namespace {

struct InfoArgs {
  std::string model = "tiny-full";
  int64_t context = 4096;
  int64_t batch = 1;
  std::string dtype = "bf16";
  bool json_out = false;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", b, units[u]);
  return buf;
}

void run_info(const InfoArgs& a) {
  LT2_CHECK(a.context > 0 && a.batch > 0, "--context and --batch must be > 0");
  LT2_CHECK(a.dtype == "bf16" || a.dtype == "fp32", "--dtype must be bf16 or fp32, found '", a.dtype, "'");
  const bool is_dir = std::filesystem::is_directory(a.model);
  ModelConfig cfg = is_dir ? load_checkpoint_config(a.model) : load_model_config(a.model);
  if (cfg.vocab_size == 0) {  // presets that take the vocabulary from the training data
    cfg.vocab_size = 2048;
    std::fprintf(stderr, "note: '%s' takes vocab_size from its data; shown with 2048\n", a.model.c_str());
  }
  LoopedLM model(cfg);
  // A checkpoint's weights are checked against its config from the file headers (cheap: no data read).
  const int64_t checked_tensors = is_dir ? check_checkpoint_weights(a.model, model) : 0;
  const auto dtype = a.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  // States on the meta device: sizes without allocating.
  auto opts = torch::TensorOptions().dtype(dtype).device(torch::kMeta);
  const int64_t half = std::max<int64_t>(1, a.context / 2);
  const int64_t full_bytes = model->make_state(a.batch, a.context, opts)->bytes();
  const int64_t half_bytes = model->make_state(a.batch, half, opts)->bytes();
  const double per_token = a.context > half ? double(full_bytes - half_bytes) / double(a.context - half) / a.batch : 0;
  const double fixed = double(full_bytes) / a.batch - per_token * a.context;
  const int64_t params = model->num_parameters();
  const int64_t weight_bytes = params * (a.dtype == "bf16" ? 2 : 4);
  json mixers = json::array();
  for (const auto& m : model->layer_mixers()) mixers.push_back(m);
  json j{{"config", cfg.to_json()},
         {"parameters", params},
         {"parameters_non_embedding", model->num_parameters(true)},
         {"layer_mixers", mixers},
         {"weight_bytes", weight_bytes},
         {"context", a.context},
         {"batch", a.batch},
         {"dtype", a.dtype},
         {"state_bytes_total", full_bytes},
         {"state_bytes_per_sequence", full_bytes / a.batch},
         {"state_bytes_per_token", per_token},
         {"state_bytes_fixed_per_sequence", fixed},
         {"decode_bytes_per_step", static_cast<double>(weight_bytes) * cfg.n_loops + full_bytes}};
  if (is_dir) j["weights_checked_tensors"] = checked_tensors;
  if (a.json_out) {
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("model            %s (form %s)\n", cfg.name.c_str(), to_string(cfg.form).c_str());
  if (is_dir)
    std::printf("weights          %lld tensors match the config (names, shapes, dtypes, file sizes; headers only)\n",
                (long long)checked_tensors);
  std::printf("shape            d %lld, layers %lld, heads %lld (kv %lld, dim %lld), ffn %lld, loops %lld, vocab %lld\n",
              (long long)cfg.d_model, (long long)cfg.n_layers, (long long)cfg.n_heads,
              (long long)cfg.kv_heads(), (long long)cfg.dim_head(), (long long)cfg.ffn_dim(),
              (long long)cfg.n_loops, (long long)cfg.vocab_size);
  std::string pattern;
  for (const auto& m : model->layer_mixers()) pattern += (pattern.empty() ? "" : ",") + m;
  std::printf("layers           %s  (pattern '%s')\n", pattern.c_str(), cfg.layer_pattern.c_str());
  std::printf("parameters       %.2fM (%.2fM without embeddings), %s in %s\n", params / 1e6,
              model->num_parameters(true) / 1e6, human_bytes(weight_bytes).c_str(), a.dtype.c_str());
  std::printf("decode state     %lld (loop, layer) states; at context %lld, batch %lld: %s\n",
              (long long)(cfg.n_loops * cfg.n_layers), (long long)a.context, (long long)a.batch,
              human_bytes(full_bytes).c_str());
  std::printf("  per sequence   %s fixed + %s per token\n", human_bytes(fixed).c_str(), human_bytes(per_token).c_str());
  std::printf("decode step      reads weights x %lld loops + states = %s\n", (long long)cfg.n_loops,
              human_bytes(static_cast<double>(weight_bytes) * cfg.n_loops + full_bytes).c_str());
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto args = std::make_shared<InfoArgs>();
  auto* cmd = app.add_subcommand("info", "Show a model's shape, parameters and decode-state memory");
  cmd->add_option("model", args->model,
                  "Model: a preset name (configs/*.json), a config JSON file, or a checkpoint folder")
      ->capture_default_str();
  cmd->add_option("--context", args->context, "Context length (tokens per sequence) for the state sizes")
      ->capture_default_str();
  cmd->add_option("--batch", args->batch, "Sequences decoded together")->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Weight and KV-cache dtype: bf16 or fp32 (recurrent states are fp32)")
      ->capture_default_str();
  cmd->add_flag("--json", args->json_out, "Print JSON instead of a table");
  cmd->footer("Presets: " + [] {
    std::string s;
    for (const auto& n : preset_names()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }() + "\nMixers: " + registered_mixer_names());
  cmd->callback([args] { run_info(*args); });
}

}  // namespace lt2::cli
