#include "lt2/distill/pipeline.h"

#include <cstdio>
#include <filesystem>

#include "lt2/config/presets.h"
#include "lt2/data/shard.h"
#include "lt2/distill/losses.h"
#include "lt2/distill/selection.h"
#include "lt2/distill/stages.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"

namespace lt2::distill {

namespace {

// Whether a stage's run folder already holds its final checkpoint (and --resume may skip it).
bool finished(const TrainConfig& t) {
  const auto ckpt = latest_checkpoint(t.out_dir);
  if (ckpt.empty()) return false;
  const auto state = load_json_file(ckpt + "/trainer_state.json");
  return json_require<int64_t>(state, "step", "'" + ckpt + "/trainer_state.json'") >= t.steps;
}

// Removes the temporary files that processes killed mid-write left in `dir` and in every folder
// below it (the selection's logs, the stages' starting checkpoints). One process writes a
// distillation folder at a time, so every such file is stale when a run starts.
void remove_stale_temporaries_below(const std::string& dir) {
  std::vector<std::string> dirs{dir};
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
    if (it->is_directory(ec)) dirs.push_back(it->path().string());
  for (const auto& d : dirs) remove_stale_temporaries(d);  // one inside a removed folder is gone: a no-op
}

std::set<int64_t> kd_keep(const DistillConfig& cfg, const std::string& out) {
  if (cfg.kd_keep) return std::set<int64_t>(cfg.kd_keep->begin(), cfg.kd_keep->end());
  if (path_exists(out + "/select/selection.json")) {
    const auto keep = selected_keep(out);
    return std::set<int64_t>(keep.begin(), keep.end());
  }
  return cfg.student.keep;
}

void stage_align(LoopedLMImpl& teacher, const DistillRun& run) {
  TrainConfig t = run.config.stage_config(Stage::Align, run.out);
  const bool resume = run.resume && !latest_checkpoint(t.out_dir).empty();
  t.init_from = run.out + "/init-align";  // a resumed run starts from its checkpoint instead
  if (!resume) save_checkpoint(t.init_from, build_student(teacher, run.config.student, t.seed));
  run_align(teacher, t, converted_layers(teacher.config(), run.config.student.keep), resume);
}

void stage_kd(LoopedLMImpl& teacher, const DistillRun& run) {
  TrainConfig t = run.config.stage_config(Stage::Kd, run.out);
  StudentOptions opts = run.config.student;
  opts.keep = kd_keep(run.config, run.out);
  const bool resume = run.resume && !latest_checkpoint(t.out_dir).empty();
  t.init_from = run.out + "/init-kd";
  if (!resume) {
    LoopedLM aligned = load_checkpoint(stage_student(run.out, Stage::Align));
    save_checkpoint(t.init_from, hybrid_student(teacher, *aligned, opts));
  }
  std::string kept;
  for (int64_t l : opts.keep) kept += (kept.empty() ? "" : ", ") + std::to_string(l);
  std::printf("kd: layers kept full attention: %s\n", kept.empty() ? "none" : kept.c_str());
  run_kd(teacher, t, converted_layers(teacher.config(), opts.keep), loop_weights(teacher.config(), run.config.kd_loop_weights),
         t.lr > 0 ? run.config.kd_other_lr / t.lr : 0.0, resume);
}

void stage_long(const DistillRun& run) {
  TrainConfig t = run.config.stage_config(Stage::Long, run.out);
  t.init_from = stage_student(run.out, Stage::Kd);
  run_long(t, run.resume && !latest_checkpoint(t.out_dir).empty());
}

}  // namespace

LoopedLM load_teacher(const std::string& teacher, const TrainConfig& train) {
  LoopedLM m{nullptr};
  if (std::filesystem::is_directory(teacher)) {
    m = load_checkpoint(teacher);
  } else {
    ModelConfig cfg = load_model_config(teacher);
    if (cfg.vocab_size == 0) {
      LT2_CHECK(!train.train_data.empty(), "distill: teacher '", teacher,
                "' takes its vocabulary from the training data, but no train_data is set");
      cfg.vocab_size = ShardReader(train.train_data).vocab_size();
    }
    torch::manual_seed(train.seed);
    m = LoopedLM(cfg);
  }
  m->eval();
  for (auto& p : m->parameters()) p.set_requires_grad(false);
  const auto& c = m->config();
  std::printf("teacher %s (%s form): %.2fM parameters, %lld layers x %lld loops, pattern '%s', vocabulary %lld\n",
              c.name.c_str(), to_string(c.form).c_str(), m->num_parameters() / 1e6, static_cast<long long>(c.n_layers),
              static_cast<long long>(c.n_loops), c.layer_pattern.c_str(), static_cast<long long>(c.vocab_size));
  return m;
}

std::string stage_student(const std::string& out, Stage s) {
  const std::string ckpt = latest_checkpoint(out + "/" + to_string(s));
  LT2_CHECK(!ckpt.empty(), "distill: no checkpoint of stage '", to_string(s), "' in '", out, "/", to_string(s),
            "'; run `lt2 distill --stage ", to_string(s), "` with this --out first");
  return ckpt;
}

std::string run_distill(const DistillRun& run, const std::vector<Stage>& stages) {
  make_dirs(run.out);
  remove_stale_temporaries_below(run.out);
  write_file_atomic(run.out + "/distill_config.json", run.config.to_json().dump(2) + "\n");
  LoopedLM teacher = load_teacher(run.teacher, run.config.stage_config(Stage::Align, run.out));
  std::string student;
  for (Stage s : stages) {
    if (s == Stage::Select) {
      if (run.resume && path_exists(run.out + "/select/selection.json")) {
        std::printf("select: done (%s/select/selection.json)\n", run.out.c_str());
      } else {
        select_layers(*teacher, stage_student(run.out, Stage::Align), run.config, run.out, run.resume);
      }
      continue;
    }
    const TrainConfig t = run.config.stage_config(s, run.out);
    if (run.resume && finished(t)) {
      std::printf("%s: done (%s)\n", to_string(s).c_str(), latest_checkpoint(t.out_dir).c_str());
    } else if (s == Stage::Align) {
      stage_align(*teacher, run);
    } else if (s == Stage::Kd) {
      stage_kd(*teacher, run);
    } else {
      stage_long(run);
    }
    student = stage_student(run.out, s);
    std::printf("student after %s: %s\n", to_string(s).c_str(), student.c_str());
    std::fflush(stdout);
  }
  return student;
}

}  // namespace lt2::distill
