// lt2 distill: convert a looped transformer into an LT2 hybrid (lt2/distill/pipeline.h) from a JSON
// config with flag overrides, one stage or all of them.
#include <cstdio>

#include "commands.h"
#include "lt2/distill/pipeline.h"

namespace lt2::cli {

namespace {

struct DistillArgs {
  std::string teacher, config, stage = "all", out;
  std::vector<std::string> sets;
  bool resume = false;
  std::optional<std::string> train_data, val_data, device, dtype, mixer, select_method;
  std::optional<int64_t> seed, batch_size, log_every, probe_steps, shared_probe_steps;
  std::optional<double> keep_fraction;
  std::vector<int64_t> keep, kd_keep;
  CLI::Option *keep_given = nullptr, *kd_keep_given = nullptr;  // whether --keep / --kd-keep were given
  std::optional<int64_t> align_steps, kd_steps, long_steps, align_seq_len, kd_seq_len, long_seq_len;
};

void run_distill_command(const DistillArgs& a) {
  const std::string config_path = a.config.empty() ? distill::default_distill_config_path() : a.config;
  ConfigWithFlags flags(config_path);
  json& j = flags.j;
  auto set = [&j](const char* section, const char* key, const auto& v) {
    if (v) j[section][key] = *v;
  };
  set("train", "train_data", a.train_data);
  set("train", "val_data", a.val_data);
  set("train", "device", a.device);
  set("train", "dtype", a.dtype);
  set("train", "seed", a.seed);
  set("train", "batch_size", a.batch_size);
  set("train", "log_every", a.log_every);
  set("student", "mixer", a.mixer);
  if (a.keep_given->count()) j["student"]["keep"] = a.keep;
  set("student", "keep_fraction", a.keep_fraction);
  set("select", "method", a.select_method);
  set("select", "probe_steps", a.probe_steps);
  set("select", "shared_probe_steps", a.shared_probe_steps);
  if (a.kd_keep_given->count()) j["kd"]["keep"] = a.kd_keep;
  set("align", "steps", a.align_steps);
  set("kd", "steps", a.kd_steps);
  set("long", "steps", a.long_steps);
  set("align", "seq_len", a.align_seq_len);
  set("kd", "seq_len", a.kd_seq_len);
  set("long", "seq_len", a.long_seq_len);
  for (const auto& kv : a.sets) set_dotted(j, kv, "--set", "train, student, align, select, kd, long");
  distill::DistillRun run;
  run.teacher = a.teacher;
  run.config = distill::DistillConfig::from_json(j, "'" + config_path + "' with the flags");
  run.out = a.out;
  run.resume = a.resume;
  const auto student = distill::run_distill(run, distill::parse_stages(a.stage));
  if (!student.empty()) std::printf("student: %s\n", student.c_str());
}

}  // namespace

void add_distill_command(CLI::App& app) {
  auto a = std::make_shared<DistillArgs>();
  auto* cmd = app.add_subcommand("distill", "Convert a looped transformer into an LT2 hybrid (align, select, kd, long)");
  cmd->add_option("--teacher", a->teacher,
                  "Teacher: a checkpoint folder (lt2, or an Ouro HF folder), or a model preset / config JSON "
                  "(random weights from the seed; for tests and pipelines without a trained teacher)")
      ->required();
  cmd->add_option("--config", a->config, "Distillation config JSON (default: configs/distill/default.json)");
  cmd->add_option("--stage", a->stage, "align | select | kd | long | all (the four in order)");
  cmd->add_option("--out", a->out, "Output folder: one run folder per stage (align/ select/ kd/ long/)")->required();
  cmd->add_flag("--resume", a->resume,
                "Continue each stage exactly from its run folder's latest checkpoint; skip finished stages");
  cmd->add_option("--train-data", a->train_data, "Training token shard (from `lt2 data prepare`), every stage");
  cmd->add_option("--val-data", a->val_data, "Held-out token shard: evaluation, and the selection's KL");
  cmd->add_option("--device", a->device, "auto | cpu | cuda");
  cmd->add_option("--dtype", a->dtype, "auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16");
  cmd->add_option("--seed", a->seed, "Seed for batches (and a preset teacher's weights)")->check(at_least(0));
  cmd->add_option("--batch-size", a->batch_size, "Sequences per micro-batch, every stage")->check(at_least(1));
  cmd->add_option("--log-every", a->log_every, "Print a log line every N steps")->check(at_least(1));
  cmd->add_option("--mixer", a->mixer, "Student mixer replacing full attention (gdn, kda, deltanet, ...)");
  a->keep_given = cmd->add_option("--keep", a->keep, "Layers that stay full attention in every stage (0-based, comma separated)")
      ->delimiter(',');
  cmd->add_option("--keep-fraction", a->keep_fraction,
                  "Selection: fraction of the layers kept full attention (default 0.25)");
  cmd->add_option("--select-method", a->select_method,
                  "Selection ranking: shared (N + 1 KL evaluations on one model) | exhaustive (N + 1 probes) | both");
  cmd->add_option("--probe-steps", a->probe_steps, "Selection, exhaustive ranking: stage-2 steps of each probe")
      ->check(at_least(0));
  cmd->add_option("--shared-probe-steps", a->shared_probe_steps,
                  "Selection, shared ranking: stage-2 steps before the layers are scored (default 0: the aligned "
                  "student itself)")
      ->check(at_least(0));
  a->kd_keep_given = cmd->add_option("--kd-keep", a->kd_keep,
                  "Stage 2: layers kept full attention, overriding the selection (e.g. every 4th: 3,7,11)")
      ->delimiter(',');
  cmd->add_option("--align-steps", a->align_steps, "Stage 1 steps")->check(at_least(1));
  cmd->add_option("--kd-steps", a->kd_steps, "Stage 2 steps")->check(at_least(1));
  cmd->add_option("--long-steps", a->long_steps, "Stage 3 steps")->check(at_least(1));
  cmd->add_option("--align-seq-len", a->align_seq_len, "Stage 1 sequence length")->check(at_least(1));
  cmd->add_option("--kd-seq-len", a->kd_seq_len, "Stage 2 (and probe) sequence length")->check(at_least(1));
  cmd->add_option("--long-seq-len", a->long_seq_len, "Stage 3 sequence length")->check(at_least(1));
  cmd->add_option("--set", a->sets,
                  "Override any config field: --set section.key=value (repeatable; value is JSON), e.g. "
                  "--set kd.lr=2e-4 --set student.mixer_options={\"conv_size\":2}");
  cmd->footer(
      "Config sections (configs/distill/default.json):\n"
      "  train    TrainConfig fields every stage shares (train_data val_data device dtype seed batch_size ...)\n"
      "  student  mixer, mixer_options (over the distillation shape: GDN head dim = the teacher's, expand_v 1,\n"
      "           output gate on), keep (layers never converted), keep_fraction (selection's share of full layers)\n"
      "  align    stage 1 TrainConfig fields (spec: seq 512, lr 1e-3 cosine; only the student mixers train)\n"
      "  select   method (shared | exhaustive | both), probe_steps (exhaustive), shared_probe_steps, eval_batches\n"
      "  kd       stage 2 TrainConfig fields (spec: seq 4096, lr 1e-4) plus other_lr (7e-6: everything but the\n"
      "           student mixers), loop_weights (one per loop; default 1..T for Ouro, last loop for LT2), keep\n"
      "  long     stage 3 TrainConfig fields (cross-entropy at a longer seq_len)\n"
      "Each stage is a `lt2 train` run in <out>/<stage>/ (log line per step, metrics.jsonl, ckpt-*/, latest);\n"
      "its student, <out>/<stage>/ckpt-<step>, loads in generate, eval, bench and serve.");
  cmd->callback([a] { run_distill_command(*a); });
}

}  // namespace lt2::cli
