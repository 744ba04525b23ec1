// Data-parallel training over c10d, PyTorch's distributed engine: a TCP store for the rendezvous,
// Gloo for CPU tensors, NCCL for CUDA tensors.
//
// A job is W processes (ranks), each with a full copy of the model. Every optimizer step, rank r
// runs the micro-batches r, r + W, r + 2W, ... of the step's global batch (grad_accum
// micro-batches of batch_size sequences, the same whatever W), and the gradients are summed over
// the ranks in buckets while backward still runs. Every rank then takes the same optimizer step.
//
// Rendezvous from the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT. Rank 0 hosts the store, unless TORCHELASTIC_USE_AGENT_STORE=True says the launcher
// hosts it (torchrun's agent; `lt2 train --nproc N`, which hosts it on a free port).
//
// Failures end the job in bounded time: a missing peer at start, a peer that stops answering or
// dies, and any collective slower than the timeout throw lt2::Error naming the rank and what it
// was doing. (With NCCL the CPU does not wait on collectives: a stuck one is ended by c10d's
// watchdog, which by default, TORCH_NCCL_ASYNC_ERROR_HANDLING=3, tears the process down.)
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lt2 {

// Where this process sits in a data-parallel job.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;               // index of this rank's GPU on its machine
  std::string master_addr = "127.0.0.1";
  int master_port = 0;              // 0: rank 0 hosts the store on a free port (one-rank groups)
  bool launcher_hosts_store = false;

  // The job described by RANK, WORLD_SIZE, ... ; nullopt when WORLD_SIZE is unset (a plain
  // single-process run). Malformed or missing variables throw lt2::Error naming them.
  static std::optional<DistEnv> from_environment();
};

// The micro-batch indices of a step's global batch that `rank` of `world` runs: rank, rank +
// world, ... Throws lt2::Error unless grad_accum is a multiple of world.
std::vector<int64_t> local_micro_batches(int64_t grad_accum, int rank, int world);

// A joined c10d process group. Collectives block until done and throw lt2::Error (naming this
// rank and `what`) on a failure or after the timeout.
class ProcessGroup {
 public:
  // Joins the job: connects to (or hosts) the store, waits until every rank has joined (an error
  // naming the missing ranks after `timeout`), then builds Gloo (CPU device) or NCCL (CUDA).
  ProcessGroup(const DistEnv& env, torch::Device device, std::chrono::milliseconds timeout);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool is_main() const { return rank_ == 0; }
  torch::Device device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // In place: t = sum of t over the ranks.
  void all_reduce_sum(torch::Tensor& t, const std::string& what);
  // In place: every rank's t = rank `root`'s t.
  void broadcast(torch::Tensor& t, int root, const std::string& what);

 private:
  friend class GradientBuckets;  // launches its own asynchronous all-reduces
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, world_ = 1;
  torch::Device device_{torch::kCPU};
  std::chrono::milliseconds timeout_{0};
};

// Sums the gradients of `params` over the ranks in buckets of about `bucket_bytes`, each
// launched as soon as all its gradients are final, while backward still runs.
//
// Readiness. A hook after each parameter's AccumulateGrad node counts how often that node runs
// in the step's last backward. The count is not 1: the model is weight-shared across its T
// loops, and with per-loop activation checkpointing each loop's parameters get their gradient
// from a separate, re-entrant backward (T runs of the node); without it the engine sums the T
// contributions first (one run). The first step therefore only counts, reduces after backward,
// and orders the buckets by when each gradient became final on rank 0 (broadcast, so every rank
// launches the same buckets in the same order); from the second step on, a parameter is ready
// when its node has run as often as in the first step. Parameters that got no gradient in the
// first step (a frozen branch, an exit gate the objective ignores) are left out, as a single
// process leaves their .grad undefined; one that later gets more gradient runs than in the first
// step throws lt2::Error (the graph changed, which this scheme cannot follow).
//
// Why not c10d::Reducer (what PyTorch's DDP runs): it marks a parameter ready at its first hook
// unless put in static-graph mode, which counts hooks in the first iteration — the scheme above
// — but it is an internal class whose set-up Python's DDP wrapper does (parameter broadcast,
// bucket rebuilding, no_sync for accumulation) and which finalises the step from a callback
// queued on the autograd engine. The trainer here already owns the backward calls, so the end of
// the step's last backward is a point in its own code; the hooks, the counts and the buckets are
// all that is needed, and they stay readable.
class GradientBuckets {
 public:
  GradientBuckets(std::shared_ptr<ProcessGroup> group,
                  const std::vector<std::pair<std::string, torch::Tensor>>& params, int64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // Call right before the step's last local backward: gradients become final during it.
  void begin_last_backward();
  // Call after that backward: reduces what is left and leaves every rank's .grad = the sum over
  // the ranks. `step` names the step in error messages.
  void finish(int64_t step);
  // Buckets in use (0 until the first step has finished).
  int64_t num_buckets() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// `lt2 train --nproc N`: runs `exe args...` N times on this machine as ranks 0..N-1 of one job.
// This process hosts the store on a free port and sets RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True for each rank
// (and OMP_NUM_THREADS = cores / N when unset). The ranks share this terminal (only rank 0 logs).
// When a rank fails, the others are stopped and lt2::Error says which rank failed and how;
// SIGINT/SIGTERM are passed on to the ranks. Returns when every rank has exited successfully.
void run_local_ranks(int nproc, const std::string& exe, const std::vector<std::string>& args);

}  // namespace lt2
