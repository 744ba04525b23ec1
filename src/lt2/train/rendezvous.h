// Rendezvous of a data-parallel job (lt2/train/distributed.h): where this process sits in the job
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun sets them), which of a
// step's micro-batches it runs, and the c10d process group it joins: a TCP store (hosted by rank
// 0, or by the launcher when TORCHELASTIC_USE_AGENT_STORE=True), then Gloo (CPU) or NCCL (CUDA).
//
// Failures end the job in bounded time: a missing peer at start, a peer that stops answering or
// dies, and any collective slower than the timeout throw lt2::Error naming the rank and what it
// was doing. (With NCCL the CPU does not wait on collectives: a stuck one is ended by c10d's
// watchdog, which by default, TORCH_NCCL_ASYNC_ERROR_HANDLING=3, tears the process down.)
#pragma once
#include <torch/csrc/distributed/c10d/Work.hpp>
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
  // Starts t = sum of t over the ranks without waiting (the gradient reducer overlaps these with
  // backward); finish it with wait().
  c10::intrusive_ptr<c10d::Work> start_all_reduce_sum(torch::Tensor& t);
  // Waits for a collective of this group; on a failure or after the timeout, marks the group
  // failed (it is then aborted, not shut down) and throws lt2::Error naming this rank and `what`.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  // "rank r of w", for messages.
  const std::string& who() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, world_ = 1;
  torch::Device device_{torch::kCPU};
  std::chrono::milliseconds timeout_{0};
};

}  // namespace lt2
