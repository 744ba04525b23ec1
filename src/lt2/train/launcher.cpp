#include "lt2/train/launcher.h"

#include <signal.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "lt2/util/environment.h"
#include "lt2/util/error.h"
#include "lt2/util/process.h"

namespace lt2 {

namespace {

std::vector<pid_t> g_ranks;  // for the signal handler: pass SIGINT/SIGTERM on to the ranks

void pass_signal_on(int sig) {
  for (pid_t pid : g_ranks)
    if (pid > 0) ::kill(pid, sig);
}

}  // namespace

void run_local_ranks(int nproc, const std::string& exe, const std::vector<std::string>& args) {
  LT2_CHECK(nproc >= 1, "--nproc must be >= 1, found ", nproc);
  LT2_CHECK(!std::getenv("WORLD_SIZE"), "--nproc starts its own ranks, but this process is already part of a job "
            "(WORLD_SIZE is set); drop --nproc under torchrun or another launcher");
  // The store lives here, on a port the kernel picks at bind time: no race between choosing a free
  // port and binding it. The ranks connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True).
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  const int port = store->getPort();

  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / nproc);
  std::vector<std::string> inherited =
      current_environment({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                           "TORCHELASTIC_USE_AGENT_STORE", kLauncherPidVariable});
  if (!std::getenv("OMP_NUM_THREADS")) inherited.push_back(cat("OMP_NUM_THREADS=", threads));

  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<Process> ranks;
  g_ranks.assign(nproc, -1);
  std::string started;
  for (int r = 0; r < nproc; ++r) {
    SpawnOptions so;
    so.program = exe;
    so.env = inherited;
    for (const auto& kv : {cat("RANK=", r), cat("LOCAL_RANK=", r), cat("WORLD_SIZE=", nproc),
                           cat("LOCAL_WORLD_SIZE=", nproc), std::string("MASTER_ADDR=127.0.0.1"),
                           cat("MASTER_PORT=", port), std::string("TORCHELASTIC_USE_AGENT_STORE=True"),
                           cat(kLauncherPidVariable, "=", ::getpid())})
      so.env->push_back(kv);
    try {
      ranks.push_back(Process::spawn(args, so));
    } catch (const Error& e) {
      g_ranks.clear();
      throw Error(cat("rank ", r, ": ", e.what()));  // the ranks started so far die with `ranks`
    }
    g_ranks[r] = ranks.back().pid();
    started += cat(r ? ", " : "", "rank ", r, " pid ", ranks.back().pid());
  }
  std::printf("lt2 train --nproc %d: %s; store at 127.0.0.1:%d\n", nproc, started.c_str(), port);
  std::fflush(stdout);

  struct sigaction sa {};
  sa.sa_handler = pass_signal_on;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);

  // A rank that fails takes the job down: the others get SIGTERM, then SIGKILL after a grace period
  // (the time a rank needs to notice and print its own error).
  const auto grace = std::chrono::seconds(5);
  std::string failure;
  std::chrono::steady_clock::time_point kill_at{};
  std::vector<Process*> watched;
  for (auto& p : ranks) watched.push_back(&p);
  for (;;) {
    const int rank = wait_any(watched, failure.empty() ? -1 : 0.02);
    if (rank < 0) {
      if (std::all_of(ranks.begin(), ranks.end(), [](const Process& p) { return p.finished(); })) break;
      if (std::chrono::steady_clock::now() >= kill_at) pass_signal_on(SIGKILL);  // the grace period is over
      continue;
    }
    g_ranks[rank] = -1;
    const Process& p = ranks[rank];
    if (!p.status().ok() && failure.empty()) {
      failure = cat("rank ", rank, " (pid ", p.pid(), ") ", p.status().describe());
      pass_signal_on(SIGTERM);
      kill_at = std::chrono::steady_clock::now() + grace;
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  g_ranks.clear();
  LT2_CHECK(failure.empty(), failure, "; the other ranks were stopped");
}

}  // namespace lt2
