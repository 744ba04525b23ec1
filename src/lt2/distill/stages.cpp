#include "lt2/distill/stages.h"

#include <cstdio>

#include "lt2/distill/losses.h"
#include "lt2/distill/student.h"
#include "lt2/train/autocast.h"
#include "lt2/train/batches.h"

namespace lt2::distill {

namespace {

// The teacher beside the trainer's student: on its device, frozen.
void place_teacher(LoopedLMImpl& teacher, const Trainer& trainer) {
  teacher.to(trainer.device());
  teacher.eval();
  for (auto& p : teacher.parameters()) p.set_requires_grad(false);
}

void check_pair(LoopedLMImpl& teacher, Trainer& trainer) {
  check_student_of(teacher.config(), trainer.model()->config());
}

StageResult finish(Trainer& trainer) {
  StageResult r;
  r.last = trainer.run();
  r.checkpoint = latest_checkpoint(trainer.config().out_dir);
  r.device = trainer.device();
  r.autocast = trainer.autocast();
  return r;
}

ops::HeadLossOptions head_options(const TrainConfig& cfg) {
  ops::HeadLossOptions o;
  o.chunk_tokens = cfg.loss_chunk_tokens;
  return o;
}

}  // namespace

StageResult run_align(LoopedLMImpl& teacher, const TrainConfig& cfg, const std::vector<int64_t>& layers, bool resume) {
  const auto prefixes = mixer_prefixes(layers);
  TrainerCallbacks cb;
  cb.trainable = [prefixes](const std::string& name) { return has_prefix(name, prefixes); };
  LoopedLMImpl* t = &teacher;
  // Alignment runs single mixers, not loops: nothing to checkpoint.
  cb.loss = [t, layers](LoopedLM& student, const Batch& b, const ForwardOptions&) {
    return alignment_loss(*t, *student, b.inputs, layers);
  };
  Trainer trainer(cfg, resume, cb);
  check_pair(teacher, trainer);
  place_teacher(teacher, trainer);
  std::printf("align: %zu student mixer(s) train (layers", layers.size());
  for (int64_t l : layers) std::printf(" %lld", static_cast<long long>(l));
  std::printf("), %lld steps x %lld tokens -> %s\n", static_cast<long long>(cfg.steps),
              static_cast<long long>(cfg.batch_size * cfg.grad_accum * cfg.seq_len), cfg.out_dir.c_str());
  return finish(trainer);
}

StageResult run_kd(LoopedLMImpl& teacher, const TrainConfig& cfg, const std::vector<int64_t>& layers,
                   const std::vector<double>& weights, double other_lr_scale, bool resume, bool step_lines) {
  const auto prefixes = mixer_prefixes(layers);
  TrainerCallbacks cb;
  cb.lr_scale = [prefixes, other_lr_scale](const std::string& name) {
    return has_prefix(name, prefixes) ? 1.0 : other_lr_scale;
  };
  LoopedLMImpl* t = &teacher;
  const auto head = head_options(cfg);
  cb.loss = [t, weights, head](LoopedLM& student, const Batch& b, const ForwardOptions& fo) {
    return kd_loss(*t, *student, b.inputs, weights, head, fo.checkpoint_loops, fo.stored_loops,
                   fo.partial_loop_layers);
  };
  cb.step_lines = step_lines;
  Trainer trainer(cfg, resume, cb);
  check_pair(teacher, trainer);
  place_teacher(teacher, trainer);
  if (step_lines) {
    std::printf("kd: KL(teacher || student) over loops with weights");
    for (double w : weights) std::printf(" %.3g", w);
    std::printf("; lr %.3g for the %zu student mixer(s), %.3g for the rest; %lld steps x %lld tokens -> %s\n", cfg.lr,
                layers.size(), cfg.lr * other_lr_scale, static_cast<long long>(cfg.steps),
                static_cast<long long>(cfg.batch_size * cfg.grad_accum * cfg.seq_len), cfg.out_dir.c_str());
  }
  return finish(trainer);
}

StageResult run_long(const TrainConfig& cfg, bool resume) {
  Trainer trainer(cfg, resume);
  std::printf("long: cross-entropy at seq_len %lld, %lld steps x %lld tokens -> %s\n",
              static_cast<long long>(cfg.seq_len), static_cast<long long>(cfg.steps),
              static_cast<long long>(cfg.batch_size * cfg.grad_accum * cfg.seq_len), cfg.out_dir.c_str());
  return finish(trainer);
}

double held_out_kl(LoopedLMImpl& teacher, LoopedLMImpl& student, std::shared_ptr<const ShardReader> shard,
                   const TrainConfig& cfg, int64_t batches, const std::vector<double>& weights, torch::Device device,
                   bool autocast) {
  BatchSampler sampler(std::move(shard), cfg.seq_len, cfg.seed);
  torch::NoGradGuard ng;
  teacher.to(device);
  student.to(device);
  teacher.eval();
  student.eval();
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const auto x = sampler.eval_batch(i, cfg.batch_size).first.to(device);
    AutocastScope ac(autocast);
    total += kd_loss(teacher, student, x, weights, head_options(cfg)).item<double>();
  }
  return total / static_cast<double>(batches);
}

}  // namespace lt2::distill
