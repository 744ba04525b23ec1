// lt2 train: train a looped model from a JSON config with flag overrides; with --nproc N, start N
// local data-parallel ranks of this same command.
#include <cstdio>

#include "commands.h"
#include "lt2/train/launcher.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"

namespace lt2::cli {

namespace {

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  bool resume = false;
  bool json_out = false;
  // Overrides of the config's fields: given ones replace the file's value (and are checked with it).
  std::optional<std::string> model, pattern, init_from, train_data, val_data, out_dir, device, dtype, objective;
  std::vector<std::string> mixer_options;   // MIXER.NAME=VALUE
  std::vector<std::string> kernel_options;  // NAME=VALUE
  std::optional<int64_t> steps, seq_len, batch_size, grad_accum, warmup, eval_every, save_every, log_every, seed;
  std::optional<double> lr, dist_timeout;
  std::optional<std::string> checkpoint_loops;
  bool keep_best = false, pack_documents = false;
  std::optional<int64_t> document_separator;
  int nproc = 0;
};

// This command's arguments without --nproc, for the ranks it starts (/proc/self/cmdline holds them
// exactly as given).
std::vector<std::string> rank_arguments() {
  const std::string raw = read_file("/proc/self/cmdline");
  std::vector<std::string> args;
  for (size_t begin = 0; begin < raw.size();) {
    const size_t end = raw.find('\0', begin);
    args.push_back(raw.substr(begin, end - begin));
    begin = end == std::string::npos ? raw.size() : end + 1;
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc") ++i;  // and its value
    else if (args[i].rfind("--nproc=", 0) != 0) out.push_back(args[i]);
  }
  return out;
}

void run_train(const TrainArgs& a) {
  if (a.nproc > 0) {
    run_local_ranks(a.nproc, "/proc/self/exe", rank_arguments());
    return;
  }
  ConfigWithFlags flags(a.config);
  json& j = flags.j;
  flags.set("model", a.model);
  flags.set("layer_pattern", a.pattern);
  for (const auto& kv : a.mixer_options)
    set_dotted(j["mixer_options"], kv, "--mixer-option", "a mixer name, e.g. gla.chunk_size=32");
  for (const auto& kv : a.kernel_options) {
    const auto eq = kv.find('=');
    LT2_CHECK(eq != std::string::npos && eq > 0, "--kernel-option: expected name=value, e.g. residual_norm=0, found '",
              kv, "'");
    j["kernel_options"][kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  flags.set("init_from", a.init_from);
  flags.set("train_data", a.train_data);
  flags.set("val_data", a.val_data);
  flags.set("out_dir", a.out_dir);
  flags.set("device", a.device);
  flags.set("dtype", a.dtype);
  flags.set("objective", a.objective);
  flags.set("steps", a.steps);
  flags.set("seq_len", a.seq_len);
  flags.set("batch_size", a.batch_size);
  flags.set("grad_accum", a.grad_accum);
  flags.set("warmup", a.warmup);
  flags.set("eval_every", a.eval_every);
  flags.set("save_every", a.save_every);
  flags.set("log_every", a.log_every);
  flags.set("seed", a.seed);
  flags.set("lr", a.lr);
  flags.set("dist_timeout", a.dist_timeout);
  flags.set("checkpoint_loops", a.checkpoint_loops);
  if (a.keep_best) j["keep_best"] = true;
  if (a.pack_documents) j["pack_documents"] = true;
  flags.set("document_separator", a.document_separator);
  for (const auto& kv : a.sets) {  // --set key=value, value parsed as JSON when it parses
    auto eq = kv.find('=');
    LT2_CHECK(eq != std::string::npos && eq > 0, "--set expects key=value, found '", kv, "'");
    const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
    auto parsed = json::parse(value, nullptr, false);
    j[key] = parsed.is_discarded() ? json(value) : parsed;
  }
  TrainConfig cfg = TrainConfig::from_json(j, a.config.empty() ? "train flags" : "'" + a.config + "'");
  Trainer trainer(cfg, a.resume);
  const bool main_rank = trainer.rank() == 0;
  const auto& m = trainer.model();
  if (main_rank) {
    std::printf("model %s: %.2fM parameters, %lld layers x %lld loops, pattern '%s'\n",
                m->config().name.c_str(), m->num_parameters() / 1e6, (long long)m->config().n_layers,
                (long long)m->config().n_loops, m->config().layer_pattern.c_str());
    std::printf("training %lld steps x %lld tokens%s%s -> %s\n", (long long)cfg.steps,
                (long long)(cfg.batch_size * cfg.grad_accum * cfg.seq_len),
                trainer.world_size() > 1 ? (" on " + std::to_string(trainer.world_size()) + " ranks").c_str() : "",
                a.resume ? (" (resumed at step " + std::to_string(trainer.start_step()) + ")").c_str() : "",
                cfg.out_dir.c_str());
    if (!cfg.kernel_options.empty()) std::printf("kernel switches: %s\n", cfg.kernel_options.dump().c_str());
  }
  auto last = trainer.run();
  if (a.json_out && main_rank)
    std::printf("%s\n", json{{"step", last.step}, {"loss", last.loss}, {"tokens_per_s", last.tokens_per_s},
                             {"mfu", last.mfu}, {"out_dir", cfg.out_dir}}.dump().c_str());
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a looped model on a token shard");
  cmd->add_option("--config", a->config, "Training config JSON (fields of TrainConfig; flags below override it)");
  cmd->add_option("--model", a->model, "Model preset name or model config JSON");
  cmd->add_option("--pattern", a->pattern,
                  "Layer pattern of the new model, over the model config's (e.g. gla, interleaved:4:1:gdn:window; "
                  "docs/models.md); a checkpoint resumed or started from keeps its own");
  cmd->add_option("--mixer-option", a->mixer_options,
                  "A mixer option of the new model as MIXER.NAME=VALUE (value as JSON), over the model config's "
                  "(repeatable; e.g. --mixer-option window.window=512)");
  cmd->add_option("--kernel-option", a->kernel_options,
                  "NAME=VALUE, repeatable: a kernel switch for this run (TrainConfig::kernel_options; A/B of a CUDA "
                  "kernel against its libtorch form, docs/decode.md), e.g. residual_norm=0. Names: " +
                      decode_option_names());
  cmd->add_option("--init-from", a->init_from, "Start from this checkpoint's weights (a new stage: fresh optimizer and step 0)");
  cmd->add_option("--train-data", a->train_data, "Training token shard (from `lt2 data prepare`)");
  cmd->add_option("--val-data", a->val_data, "Held-out token shard for evaluation");
  cmd->add_option("--out", a->out_dir, "Run folder: metrics.jsonl, checkpoints ckpt-<step>/, latest (and best with --keep-best)");
  cmd->add_option("--device", a->device, "auto | cpu | cuda");
  cmd->add_option("--dtype", a->dtype, "auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16");
  cmd->add_option("--objective", a->objective, "ce (LT2: last loop) | ouro (sum_t p_t CE_t - beta H) | ouro_gate (exit gate only)");
  cmd->add_option("--steps", a->steps, "Optimizer steps");
  cmd->add_option("--seq-len", a->seq_len, "Tokens per training sequence");
  cmd->add_option("--batch-size", a->batch_size, "Sequences per micro-batch");
  cmd->add_option("--grad-accum", a->grad_accum, "Micro-batches per optimizer step, over all data-parallel ranks together");
  cmd->add_option("--lr", a->lr, "Peak learning rate (AdamW)");
  cmd->add_option("--warmup", a->warmup, "Linear warm-up steps before the cosine decay");
  cmd->add_option("--eval-every", a->eval_every, "Evaluate every N steps (0 = at the end only)");
  cmd->add_option("--save-every", a->save_every, "Checkpoint every N steps (0 = at the end only)");
  cmd->add_option("--log-every", a->log_every, "Print a log line every N steps");
  cmd->add_option("--seed", a->seed, "Seed for initialisation and batches");
  cmd->add_flag("--keep-best", a->keep_best,
                "Checkpoint at every evaluation that lowers the validation loss and point <out>/best at it "
                "(needs --val-data and --eval-every N)");
  cmd->add_flag("--checkpoint-loops{on}", a->checkpoint_loops,
               "Per-loop activation checkpointing: recompute each loop in backward instead of storing its "
               "activations. auto (the default) measures a step's memory both ways at the start and stores "
               "them when that fits the device; --checkpoint-loops alone means on; =off never")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  cmd->add_flag("--pack-documents", a->pack_documents,
                "Cut each row into its documents at the separator token: no token sees another document "
                "(attention block-diagonal, recurrent states and convolutions restart, positions from 0)");
  cmd->add_option("--document-separator", a->document_separator,
                  "Separator token id for --pack-documents (default: the one the shard was prepared with, "
                  "from summary.json and tokenizer.json beside it)");
  cmd->add_option("--set", a->sets, "Override any TrainConfig field: --set key=value (repeatable; value is JSON)");
  cmd->add_flag("--resume", a->resume, "Continue exactly from the run folder's latest checkpoint");
  cmd->add_flag("--json", a->json_out, "Print the final step's metrics as JSON");
  cmd->add_option("--nproc", a->nproc,
                  "Data-parallel: start N ranks of this command on this machine (CPU: Gloo; GPU: NCCL, one GPU "
                  "each). grad_accum micro-batches are shared out, so the global batch is unchanged")
      ->check(at_least(1));
  cmd->add_option("--dist-timeout", a->dist_timeout,
                  "Data-parallel: seconds a rank waits for its peers (joining, each all-reduce) before the job "
                  "ends with an error (default 600)");
  cmd->footer("Log line per step: step, loss, grad norm, lr, ms, tokens/s (and MFU on GPU).\n"
              "TrainConfig fields: model layer_pattern mixer_options train_data val_data out_dir device dtype seq_len batch_size grad_accum\n"
              "steps lr min_lr_ratio warmup weight_decay beta1 beta2 eps clip seed log_every eval_every\n"
              "eval_batches save_every keep_best checkpoint_loops tf32 objective ouro_entropy_beta gate_min_gain init_from\n"
              "fused_loss (default true: the chunked head + cross-entropy; false: full logits) loss_chunk_tokens\n"
              "pack_documents document_separator (documents cut at the separator; docs/training.md)\n"
              "indexer_stage (off | dense_warmup | sparse: DSA indexer training) indexer_loss_coef\n"
              "dist_timeout dist_bucket_mb (gradient all-reduce bucket, MiB)\n"
              "kernel_options (kernel switches, e.g. {\"residual_norm\": false}; docs/decode.md)\n\n"
              "Data-parallel training: `--nproc N` starts N local ranks itself; or run under torchrun\n"
              "(`torchrun --nproc-per-node N --no-python lt2 train ...`), which sets RANK, WORLD_SIZE, LOCAL_RANK,\n"
              "MASTER_ADDR and MASTER_PORT. Rank r runs micro-batches r, r + N, ... of each step (grad_accum must\n"
              "be a multiple of N); gradients are summed in buckets during backward; rank 0 logs and writes\n"
              "checkpoints, which resume on any number of ranks. A failed rank ends the job with an error.");
  cmd->callback([a] { run_train(*a); });
}

}  // namespace lt2::cli
