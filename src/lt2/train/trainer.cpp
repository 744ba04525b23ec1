#include "lt2/train/trainer.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "lt2/config/presets.h"
#include "lt2/kernels/kernels.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/nn/precision.h"
#include "lt2/train/autocast.h"
#include "lt2/train/batches.h"
#include "lt2/train/gradient_reducer.h"
#include "lt2/train/rendezvous.h"
#include "lt2/train/flops.h"
#include "lt2/train/aux_loss.h"
#include "lt2/train/losses.h"
#include "lt2/train/memory_policy.h"
#include "lt2/train/optimizer.h"
#include "lt2/train/run_checkpoint.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/fs.h"

namespace fs = std::filesystem;

namespace lt2 {

namespace {

std::string format_step_line(const StepMetrics& m, int64_t total, bool gpu) {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "step %6lld/%lld | loss %.4f | gnorm %6.3f | lr %.2e | %8.1f ms | %9.0f tok/s",
                        static_cast<long long>(m.step), static_cast<long long>(total), m.loss,
                        m.grad_norm, m.lr, m.ms, m.tokens_per_s);
  if (gpu && m.mfu > 0) std::snprintf(buf + n, sizeof buf - n, " | mfu %5.1f%%", 100 * m.mfu);
  return buf;
}

std::string progress_bar(int64_t done, int64_t total, double seconds_left) {
  const int width = 30;
  int filled = static_cast<int>(width * done / std::max<int64_t>(total, 1));
  std::string bar(filled, '#');
  bar += std::string(width - filled, '.');
  char buf[128];
  std::snprintf(buf, sizeof buf, "[%s] %3d%%  eta %dm%02ds", bar.c_str(),
                static_cast<int>(100 * done / std::max<int64_t>(total, 1)),
                static_cast<int>(seconds_left) / 60, static_cast<int>(seconds_left) % 60);
  return buf;
}

// The separator token of cfg.pack_documents: cfg.document_separator, or the token summary.json
// beside the training shard names, looked up in the tokenizer.json beside it.
int64_t resolve_document_separator(const TrainConfig& cfg) {
  if (cfg.document_separator >= 0) return cfg.document_separator;
  const auto dir = fs::path(cfg.train_data).parent_path();
  const auto summary = (dir / "summary.json").string(), tokenizer = (dir / "tokenizer.json").string();
  LT2_CHECK(fs::exists(summary) && fs::exists(tokenizer), "pack_documents: no document_separator given, and no "
            "summary.json and tokenizer.json beside '", cfg.train_data, "' (as `lt2 data prepare` writes them) "
            "name the shard's; set document_separator to its token id");
  const auto name = json_require<std::string>(load_json_file(summary), "separator", "'" + summary + "'");
  LT2_CHECK(!name.empty(), "pack_documents: '", summary, "' says the shard was prepared without a document "
            "separator, so its documents cannot be told apart");
  const auto id = Tokenizer::load(tokenizer).token_to_id(name);
  LT2_CHECK(id, "pack_documents: the separator '", name, "' of '", summary, "' is not a token of '", tokenizer, "'");
  return *id;
}

}  // namespace

struct Trainer::Impl {
  torch::Device device{torch::kCPU};
  bool autocast = false;
  std::optional<Tf32Scope> tf32;  // for the trainer's lifetime under autocast (TrainConfig::tf32)
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<BatchSampler> train, val;  // the shard's (null when callbacks give the batches)
  std::vector<torch::Tensor> params;
  std::string tokenizer_path;  // tokenizer.json beside the training shard, copied into checkpoints
  int64_t separator = -1;      // cfg.pack_documents: the document separator token; -1: off
  // The packed documents of a batch's inputs ([B, T] on the CPU), or null when not packing.
  std::shared_ptr<const PackedDocuments> documents(const torch::Tensor& inputs) const {
    if (separator < 0) return nullptr;
    return std::make_shared<const PackedDocuments>(PackedDocuments::at_separator(inputs, separator));
  }
  double flops_per_token = 0, peak = 0;
  std::ofstream metrics;
  bool tty = false;
  // Data-parallel job (null outside one): the group, the gradient buckets, and which of the
  // step's micro-batches this rank runs (all of them outside a job).
  std::shared_ptr<ProcessGroup> group;
  std::unique_ptr<GradientBuckets> grads;
  std::vector<int64_t> micros;
  bool main = true;  // rank 0: logs and writes the run folder
  bool checkpoint_loops = false;  // cfg.checkpoint_loops resolved
  int64_t stored_loops = 1;       // with checkpoint_loops: the last loops that keep their activations
  int64_t partial_loop_layers = 0;  // and the last layers of the loop before them that keep theirs
  bool checkpointing_chosen = false;
  std::optional<CheckpointingChoice> checkpointing_choice;  // what "auto" measured
  // TrainConfig::keep_best: the lowest held-out loss so far and its step (0: no evaluation yet).
  double best_val = std::numeric_limits<double>::infinity();
  int64_t best_step = 0;
};

namespace {
LmLossOptions loss_options(const TrainConfig& c) {
  LmLossOptions o;
  o.fused = c.fused_loss;
  o.head.chunk_tokens = c.loss_chunk_tokens;
  return o;
}

// The RNG seed of one micro-batch (random layer patterns draw from it): a function of (step, micro)
// only, so a micro-batch draws the same whichever rank runs it.
uint64_t micro_seed(uint64_t seed, int64_t step, int64_t micro) {
  return seed + 1000003ULL * static_cast<uint64_t>(step + 1) + static_cast<uint64_t>(micro);
}
}  // namespace

int Trainer::rank() const { return impl_->group ? impl_->group->rank() : 0; }
torch::Device Trainer::device() const { return impl_->device; }
bool Trainer::autocast() const { return impl_->autocast; }
int Trainer::world_size() const { return impl_->group ? impl_->group->world_size() : 1; }
bool Trainer::checkpoint_loops() const { return impl_->checkpoint_loops; }
int64_t Trainer::stored_loops() const { return impl_->stored_loops; }
int64_t Trainer::partial_loop_layers() const { return impl_->partial_loop_layers; }
std::optional<CheckpointingChoice> Trainer::checkpointing_choice() const { return impl_->checkpointing_choice; }

torch::Device training_device(const TrainConfig& cfg) {
  const bool cuda = cfg.device == "cuda" || (cfg.device == "auto" && torch::cuda::is_available());
  return cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
}

bool training_autocast(const TrainConfig& cfg, torch::Device device) { return device.is_cuda() && cfg.dtype != "fp32"; }

std::string latest_checkpoint(const std::string& out_dir) {
  const std::string pointer = out_dir + "/latest";
  const std::string name = read_checkpoint_pointer(pointer);
  if (name.empty()) return "";
  const std::string dir = out_dir + "/" + name;
  LT2_CHECK(path_exists(dir + "/trainer_state.json"), "'", pointer, "' names '", name,
            "', which is not a complete checkpoint folder");
  return dir;
}

Trainer::Trainer(TrainConfig cfg, bool resume, TrainerCallbacks callbacks)
    : cfg_(std::move(cfg)), cb_(std::move(callbacks)), impl_(std::make_shared<Impl>()) {
  cfg_.validate(/*needs_train_data=*/!cb_.batch);
  auto& I = *impl_;
  const bool cuda = torch::cuda::is_available();
  LT2_CHECK(!(cfg_.device == "cuda" && !cuda), "device 'cuda' requested but no CUDA GPU is available");
  I.device = training_device(cfg_);
  const auto dist = cb_.data_parallel ? DistEnv::from_environment() : std::nullopt;
  I.micros = local_micro_batches(cfg_.grad_accum, dist ? dist->rank : 0, dist ? dist->world_size : 1);
  if (dist) {
    if (I.device.is_cuda()) {  // one GPU per rank: LOCAL_RANK's
      LT2_CHECK(dist->local_rank < static_cast<int>(torch::cuda::device_count()), "rank ", dist->rank, ": LOCAL_RANK ",
                dist->local_rank, " but this machine has ", torch::cuda::device_count(), " CUDA device(s)");
      I.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->local_rank));
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(I.device);
    }
    I.group = std::make_shared<ProcessGroup>(
        *dist, I.device, std::chrono::milliseconds(static_cast<int64_t>(cfg_.dist_timeout * 1000)));
    I.main = I.group->is_main();
  }
  LT2_CHECK(!(cfg_.dtype == "bf16" && !I.device.is_cuda()),
            "dtype 'bf16' (autocast) needs a CUDA device; use fp32 on the CPU");
  I.autocast = training_autocast(cfg_, I.device);
  if (I.autocast) I.tf32.emplace(cfg_.tf32);
  I.checkpoint_loops = cfg_.checkpoint_loops == LoopCheckpointing::On;
  I.checkpointing_chosen = cfg_.checkpoint_loops != LoopCheckpointing::Auto;

  std::shared_ptr<const ShardReader> train_shard;
  if (!cb_.batch) train_shard = std::make_shared<const ShardReader>(cfg_.train_data);
  std::string ckpt;
  if (resume) {
    ckpt = latest_checkpoint(cfg_.out_dir);
    LT2_CHECK(!ckpt.empty(), "--resume: no checkpoint in '", cfg_.out_dir, "' (no 'latest' file)");
    auto state = load_json_file(ckpt + "/trainer_state.json");
    start_step_ = json_require<int64_t>(state, "step", "'" + ckpt + "/trainer_state.json'");
    if (state.contains("best_step")) {
      I.best_step = state["best_step"].get<int64_t>();
      I.best_val = state["best_val_loss"].get<double>();
    }
    if (cb_.load_state) cb_.load_state(state);
    model_ = load_checkpoint(ckpt);
  } else if (!cfg_.init_from.empty()) {  // a later stage starting from an earlier stage's weights
    model_ = load_checkpoint(cfg_.init_from);
  } else {
    ModelConfig mcfg;
    if (cb_.model_config) {
      mcfg = cb_.model_config();
    } else {
      mcfg = cfg_.model_config();
      if (mcfg.vocab_size == 0) mcfg.vocab_size = train_shard->vocab_size();
    }
    torch::manual_seed(cfg_.seed);
    model_ = LoopedLM(mcfg);
  }
  model_->to(I.device);
  const auto& mcfg = model_->config();

  if (cfg_.objective == Objective::OuroGate) {  // stage 2: only the exit gate trains
    LT2_CHECK(model_->exit_gate, "objective 'ouro_gate' needs a model with an exit gate");
    for (auto& p : model_->named_parameters())
      p.value().set_requires_grad(p.key().rfind("exit_gate.", 0) == 0);
  }
  if (cb_.trainable) {
    for (auto& p : model_->named_parameters())
      if (!cb_.trainable(p.key())) p.value().set_requires_grad(false);
  }
  // Mixers with an auxiliary loss: the warm-up trains only what that loss trains.
  const auto stage = parse_aux_loss_stage(cfg_.indexer_stage);
  set_aux_loss_stage(*model_, stage);
  if (stage == AuxLossStage::Warmup) {
    LT2_CHECK(!aux_loss_parameters(*model_).empty(), "indexer_stage 'dense_warmup' needs a model with a mixer "
              "that has an auxiliary loss");
    freeze_except_aux_parameters(*model_);
  }
  LT2_CHECK(cfg_.objective == Objective::CE || model_->exit_gate,
            "objective '", to_string(cfg_.objective), "' needs an Ouro-form model with an exit gate");
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : model_->named_parameters()) {
    named.emplace_back(p.key(), p.value());
    if (p.value().requires_grad()) I.params.push_back(p.value());
  }
  if (I.group) {  // every rank starts from rank 0's weights
    torch::NoGradGuard ng;
    for (auto& [name, p] : named) I.group->broadcast(p, 0, "initial weights ('" + name + "')");
    I.grads = std::make_unique<GradientBuckets>(I.group, named,
                                                static_cast<int64_t>(cfg_.dist_bucket_mb * 1024 * 1024));
  }
  I.opt = std::make_unique<AdamW>(named, AdamWOptions{cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, cb_.lr_scale});
  if (resume) I.opt->load_state_dict(load_tensor_map(ckpt + "/optimizer.safetensors"));

  if (train_shard) {
    LT2_CHECK(train_shard->vocab_size() <= mcfg.vocab_size, "training shard '", cfg_.train_data,
              "' has vocabulary ", train_shard->vocab_size(), " but the model's vocab_size is ",
              mcfg.vocab_size);
    I.train = std::make_unique<BatchSampler>(train_shard, cfg_.seq_len, cfg_.seed);
    if (!cfg_.val_data.empty())
      I.val = std::make_unique<BatchSampler>(std::make_shared<const ShardReader>(cfg_.val_data), cfg_.seq_len, cfg_.seed);
    const auto tok = fs::path(cfg_.train_data).parent_path() / "tokenizer.json";
    if (fs::exists(tok)) I.tokenizer_path = tok.string();
  }

  if (cfg_.pack_documents) {
    I.separator = resolve_document_separator(cfg_);
    LT2_CHECK(I.separator < mcfg.vocab_size, "pack_documents: separator token ", I.separator,
              " is outside the model's vocabulary of ", mcfg.vocab_size);
  }
  I.flops_per_token = 3 * forward_flops_per_token(*model_, cfg_.seq_len);
  if (I.device.is_cuda()) {
    I.peak = peak_flops(kernels::device_name(I.device.index() < 0 ? 0 : I.device.index()));
  }

  I.tty = cb_.step_lines && ::isatty(STDERR_FILENO);
  if (!I.main) return;  // rank 0 alone writes the run folder
  remove_checkpoint_temporaries(cfg_.out_dir);
  if (!cb_.run_files) return;
  make_dirs(cfg_.out_dir);
  write_file_atomic(cfg_.out_dir + "/train_config.json", cfg_.to_json().dump(2) + "\n");
  // metrics.jsonl: keep what the resumed-from checkpoint had seen, drop what came after it.
  const std::string metrics_path = cfg_.out_dir + "/metrics.jsonl";
  std::string kept;
  if (resume && path_exists(metrics_path)) {
    std::istringstream in(read_file(metrics_path));
    for (std::string line; std::getline(in, line);) {
      auto j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= start_step_) kept += line + "\n";
    }
  }
  write_file_atomic(metrics_path, kept);
  I.metrics.open(metrics_path, std::ios::app);
}

double Trainer::evaluate() {
  auto& I = *impl_;
  LT2_CHECK(I.train, "Trainer::evaluate: no token shard (the client's callbacks give the batches; it evaluates itself)");
  const DecodeOptions switches = cfg_.kernel_switches(decode_options());
  const DecodeOptionsGuard kernel_switches(switches);
  BatchSampler& src = I.val ? *I.val : *I.train;
  torch::NoGradGuard ng;
  model_->eval();
  double total = 0;
  const int64_t first = I.group ? I.group->rank() : 0, stride = I.group ? I.group->world_size() : 1;
  for (int64_t i = first; i < cfg_.eval_batches; i += stride) {
    auto [x, y] = src.eval_batch(i, cfg_.batch_size);
    AutocastScope ac(I.autocast);
    ForwardOptions fo;
    fo.exit_at_loop = model_->exit_gate ? model_->config().n_loops : -1;
    fo.documents = I.documents(x);
    const auto loss = lm_cross_entropy(*model_, x.to(I.device), y.to(I.device), fo, loss_options(cfg_));
    aux_loss(*model_);  // drop the auxiliary losses this forward recorded
    total += loss.item<double>();
  }
  model_->train();
  if (I.group) {
    auto sum = torch::tensor(total, torch::kFloat64).to(I.device);
    I.group->all_reduce_sum(sum, "evaluation loss sum");
    total = sum.item<double>();
  }
  return total / static_cast<double>(cfg_.eval_batches);
}

std::string Trainer::save(int64_t step, bool best) {
  auto& I = *impl_;
  if (!I.main) return "";
  json state{{"step", step}, {"seed", cfg_.seed}, {"world_size", world_size()}, {"train_config", cfg_.to_json()}};
  if (I.best_step > 0) {
    state["best_step"] = I.best_step;
    state["best_val_loss"] = I.best_val;
  }
  if (cb_.save_state) {
    const json extra_state = cb_.save_state();  // held: items() refers into it
    for (const auto& [key, value] : extra_state.items()) state[key] = value;
  }
  std::vector<FileWriter> extra{safetensors_writer("optimizer.safetensors", I.opt->state_dict()),
                                text_writer("trainer_state.json", state.dump(2) + "\n")};
  if (!I.tokenizer_path.empty()) extra.push_back(text_writer("tokenizer.json", read_file(I.tokenizer_path)));
  return save_rotating_checkpoint(cfg_.out_dir, step, model_, extra, cb_.keep_checkpoints, best);
}

Batch Trainer::micro_batch(int64_t step, int64_t micro) {
  auto& I = *impl_;
  Batch b;
  if (cb_.batch) {
    b = cb_.batch(step, micro);
  } else {
    std::tie(b.inputs, b.targets) = I.train->sample(step, micro, cfg_.batch_size);
  }
  b.documents = I.documents(b.inputs);
  b.inputs = b.inputs.to(I.device, /*non_blocking=*/true);
  b.targets = b.targets.to(I.device, true);
  if (b.mask.defined()) b.mask = b.mask.to(I.device, true);
  return b;
}

torch::Tensor Trainer::micro_loss(const Batch& b, bool checkpoint_loops, int64_t stored_loops,
                                  int64_t partial_loop_layers) {
  AutocastScope ac(impl_->autocast);
  ForwardOptions fo;
  fo.checkpoint_loops = checkpoint_loops;
  fo.stored_loops = stored_loops;
  fo.partial_loop_layers = partial_loop_layers;
  fo.documents = b.documents;
  if (cb_.loss) return cb_.loss(model_, b, fo);
  torch::Tensor loss;
  if (cfg_.objective == Objective::CE) {
    loss = lm_cross_entropy(*model_, b.inputs, b.targets, fo, loss_options(cfg_));
  } else {
    fo.loop_logits = true;
    const auto out = model_->forward(b.inputs, nullptr, fo);
    loss = cfg_.objective == Objective::Ouro ? ouro_loss(out, b.targets, cfg_.ouro_entropy_beta)
                                             : ouro_gate_loss(out, b.targets, cfg_.gate_min_gain);
  }
  // Auxiliary losses of the mixers: the warm-up trains on them alone; the joint stage adds them.
  if (auto aux = aux_loss(*model_); aux.defined())
    loss = parse_aux_loss_stage(cfg_.indexer_stage) == AuxLossStage::Warmup ? aux : loss + cfg_.indexer_loss_coef * aux;
  return loss;
}

void Trainer::choose_checkpointing() {
  auto& I = *impl_;
  // Free memory before the measurements (they leave their blocks in the allocator's cache).
  const int64_t available = available_memory(I.device);
  const Batch full = micro_batch(start_step_, I.micros.front());
  const int64_t rows = full.inputs.size(0);
  auto measure = [&](bool recompute, int64_t n) {
    Batch b{full.inputs.narrow(0, 0, n), full.targets.narrow(0, 0, n),
            full.mask.defined() ? full.mask.narrow(0, 0, n) : torch::Tensor(), I.documents(full.inputs.narrow(0, 0, n).cpu())};
    torch::manual_seed(micro_seed(cfg_.seed, start_step_, I.micros.front()));
    return measure_step_memory(*model_, [&] { return micro_loss(b, recompute, 1); }, I.device);
  };
  const StepMemory recomputed_one = measure(true, 1), recomputed_two = rows > 1 ? measure(true, 2) : recomputed_one;
  // Storing needs more; a measurement that runs out of memory decides it.
  StepMemory stored_one, stored_two;
  try {
    stored_one = measure(false, 1);
    stored_two = rows > 1 ? measure(false, 2) : stored_one;
  } catch (const c10::OutOfMemoryError&) {
    for (auto& p : model_->parameters()) p.mutable_grad() = torch::Tensor();
    stored_one.peak = stored_two.peak = -1;  // choose_checkpointing: not measurable, store only the last loop
  }
  int64_t optimizer_bytes = 0;  // AdamW's two moments, fp32, of every trained parameter
  for (const auto& p : I.params) optimizer_bytes += 2 * p.numel() * static_cast<int64_t>(sizeof(float));
  const int64_t n_loops = model_->config().n_loops, n_layers = model_->config().n_layers;
  auto choice = lt2::choose_checkpointing(rows, stored_one, stored_two, recomputed_one, recomputed_two, optimizer_bytes,
                                          available, n_loops, n_layers);
  if (I.group) {  // one decision for the job: the fewest stored layer applications any rank can afford
    auto votes = torch::zeros({n_loops * n_layers + 1}, torch::kFloat64);
    votes[choice.stored_loops * n_layers + choice.partial_layers] = 1.0;
    votes = votes.to(I.device);
    I.group->all_reduce_sum(votes, "per-loop checkpointing decision");
    const int64_t stored = votes.nonzero().min().item<int64_t>();
    choice.stored_loops = stored / n_layers, choice.partial_layers = stored % n_layers;
  }
  I.checkpoint_loops = choice.checkpoint_loops();
  I.stored_loops = choice.stored_loops;
  I.partial_loop_layers = choice.partial_layers;
  I.checkpointing_chosen = true;
  I.checkpointing_choice = choice;
  if (I.main && cb_.step_lines) {
    std::printf("%s\n", choice.summary().c_str());
    std::fflush(stdout);
  }
}

StepMetrics Trainer::run() {
  auto& I = *impl_;
  const DecodeOptions switches = cfg_.kernel_switches(decode_options());
  const DecodeOptionsGuard kernel_switches(switches);
  if (!I.checkpointing_chosen && start_step_ < cfg_.steps) choose_checkpointing();
  const int64_t tokens_per_step = cfg_.batch_size * cfg_.grad_accum * cfg_.seq_len;
  StepMetrics m;
  model_->train();
  auto run_start = std::chrono::steady_clock::now();
  for (int64_t step = start_step_; step < cfg_.steps; ++step) {
    if (cb_.stop_before && cb_.stop_before(step)) break;
    auto t0 = std::chrono::steady_clock::now();
    auto loss_sum = torch::zeros({}, torch::TensorOptions().device(I.device));
    for (size_t k = 0; k < I.micros.size(); ++k) {
      const int64_t micro = I.micros[k];
      torch::manual_seed(micro_seed(cfg_.seed, step, micro));
      const auto loss = micro_loss(micro_batch(step, micro), I.checkpoint_loops, I.stored_loops, I.partial_loop_layers);
      // The last local backward reduces the gradients as they become final.
      if (I.grads && k + 1 == I.micros.size()) I.grads->begin_last_backward();
      (loss / static_cast<double>(cfg_.grad_accum)).backward();
      loss_sum += loss.detach();
    }
    m.step = step + 1;
    if (I.group) {
      I.grads->finish(m.step);
      I.group->all_reduce_sum(loss_sum, cat("loss sum (step ", m.step, ")"));
    }
    m.grad_norm = clip_grad_norm(I.params, cfg_.clip);
    m.lr = cb_.lr ? cb_.lr(step) : lr_at(step, cfg_.steps, cfg_.warmup, cfg_.lr, cfg_.min_lr_ratio);
    I.opt->step(m.lr);
    I.opt->zero_grad();
    m.loss = loss_sum.item<double>() / static_cast<double>(cfg_.grad_accum);
    if (I.device.is_cuda()) torch::cuda::synchronize();
    m.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    m.tokens_per_s = static_cast<double>(tokens_per_step) / (m.ms / 1000);
    m.mfu = I.peak > 0 ? I.flops_per_token * m.tokens_per_s / (I.peak * world_size()) : 0;
    LT2_CHECK(std::isfinite(m.loss), "loss is not finite at step ", m.step,
              " (lower the learning rate, or check the data)");

    if (I.main && I.metrics.is_open()) {
      I.metrics << json{{"step", m.step}, {"loss", m.loss}, {"grad_norm", m.grad_norm}, {"lr", m.lr},
                        {"ms", m.ms}, {"tokens_per_s", m.tokens_per_s}, {"mfu", m.mfu}}.dump()
                << "\n";
    }
    if (I.main && cb_.step_lines && (m.step % cfg_.log_every == 0 || m.step == cfg_.steps)) {
      const std::string line = format_step_line(m, cfg_.steps, I.device.is_cuda());
      if (I.tty) std::fprintf(stderr, "\r\033[K");
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    if (I.tty) {
      double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      double left = elapsed / static_cast<double>(step + 1 - start_step_) * static_cast<double>(cfg_.steps - step - 1);
      std::fprintf(stderr, "%s", progress_bar(step + 1, cfg_.steps, left).c_str());
    }
    if (on_step) on_step(m);
    if (cb_.after_step) cb_.after_step(m);
    const bool last = m.step == cfg_.steps;
    bool best = false;  // this step's evaluation is the lowest so far (keep_best)
    if (last || (cfg_.eval_every > 0 && m.step % cfg_.eval_every == 0)) {
      double val = evaluate();
      best = cfg_.keep_best && val < I.best_val;
      if (best) {
        I.best_val = val;
        I.best_step = m.step;
      }
      if (I.main) {
        json line{{"step", m.step}, {"val_loss", val}};
        if (cfg_.keep_best) line["best"] = best;
        if (I.metrics.is_open()) I.metrics << line.dump() << "\n";
        if (I.tty) std::fprintf(stderr, "\r\033[K");
        std::printf("eval  step %6lld | val_loss %.4f | val_ppl %.2f%s\n", static_cast<long long>(m.step), val,
                    std::exp(val), best ? " | best" : "");
        std::fflush(stdout);
      }
    }
    if (I.main && I.metrics.is_open()) I.metrics.flush();
    if (I.main && (last || best || (cfg_.save_every > 0 && m.step % cfg_.save_every == 0))) {
      auto dir = save(m.step, best);
      if (I.tty) std::fprintf(stderr, "\r\033[K");
      std::printf("saved %s\n", dir.c_str());
    }
  }
  if (I.tty) std::fprintf(stderr, "\n");
  return m;
}

}  // namespace lt2
