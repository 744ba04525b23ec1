// c10d guards its backend headers with the macros of PyTorch's own build: libtorch_cpu always
// carries Gloo, libtorch_cuda carries NCCL (linked only by the CUDA build). The libtorch wheel
// ships no gloo headers; Debian's libgloo-dev provides the few that ProcessGroupGloo.hpp names.
// Their version differs from the gloo inside libtorch, which is safe here: ProcessGroupGloo and
// its Options hold gloo objects only through pointers, and every Gloo function called runs in
// libtorch_cpu.
#define USE_C10D_GLOO
#ifdef LT2_WITH_CUDA
#define USE_C10D_NCCL
#endif

#include "lt2/train/distributed.h"

#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "lt2/util/environment.h"
#include "lt2/util/error.h"

extern char** environ;

namespace lt2 {

namespace {

// The first line of an exception's message, without the C++ backtrace c10 appends.
std::string short_message(const std::exception& e) {
  const auto* c10e = dynamic_cast<const c10::Error*>(&e);
  std::string s = c10e ? c10e->what_without_backtrace() : e.what();
  if (auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return s;
}

std::string seconds(std::chrono::milliseconds t) {
  return cat(static_cast<double>(t.count()) / 1000.0, " s");
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// An integer environment variable: nullopt when unset, lt2::Error when malformed.
std::optional<int64_t> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  LT2_CHECK(errno == 0 && end && *end == '\0', "environment variable ", name, " must be an integer, found '", v, "'");
  return x;
}

// Polls until something accepts TCP connections at host:port, or the deadline passes. (c10d's
// TCPStore client retries on its own, but each try may take the whole timeout and a back-off
// follows: a store that never came up was reported after ~3x the timeout.)
bool wait_for_listener(const std::string& host, int port, std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  for (;;) {
    addrinfo* found = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) == 0) {
      bool accepted = false;
      for (addrinfo* a = found; a && !accepted; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          accepted = true;
        } else if (errno == EINPROGRESS) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
          pollfd p{fd, POLLOUT, 0};
          int err = 0;
          socklen_t len = sizeof err;
          accepted = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) == 1 &&
                     ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
        }
        ::close(fd);
      }
      ::freeaddrinfo(found);
      if (accepted) return true;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

std::optional<DistEnv> DistEnv::from_environment() {
  const auto world = env_int("WORLD_SIZE");
  if (!world) return std::nullopt;
  DistEnv e;
  LT2_CHECK(*world >= 1, "WORLD_SIZE must be >= 1, found ", *world);
  e.world_size = static_cast<int>(*world);
  const auto rank = env_int("RANK");
  LT2_CHECK(rank, "WORLD_SIZE is set (", e.world_size, ") but RANK is not; set both (as torchrun does)");
  LT2_CHECK(*rank >= 0 && *rank < e.world_size, "RANK must be in [0, WORLD_SIZE = ", e.world_size, "), found ", *rank);
  e.rank = static_cast<int>(*rank);
  e.local_rank = static_cast<int>(env_int("LOCAL_RANK").value_or(e.rank));
  LT2_CHECK(e.local_rank >= 0, "LOCAL_RANK must be >= 0, found ", e.local_rank);
  const char* addr = std::getenv("MASTER_ADDR");
  const auto port = env_int("MASTER_PORT");
  if (e.world_size > 1) {
    LT2_CHECK(addr && *addr, "WORLD_SIZE is ", e.world_size, " but MASTER_ADDR (the address of rank 0's store) is not set");
    LT2_CHECK(port, "WORLD_SIZE is ", e.world_size, " but MASTER_PORT (the port of rank 0's store) is not set");
  }
  if (addr && *addr) e.master_addr = addr;
  e.master_port = static_cast<int>(port.value_or(0));
  LT2_CHECK(e.master_port >= 0 && e.master_port < 65536, "MASTER_PORT must be a port number, found ", e.master_port);
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  e.launcher_hosts_store = agent && std::string(agent) == "True";
  return e;
}

std::vector<int64_t> local_micro_batches(int64_t grad_accum, int rank, int world) {
  LT2_CHECK(grad_accum % world == 0, "grad_accum (", grad_accum, ") must be a multiple of the number of ranks (",
            world, "): the global batch is grad_accum x batch_size sequences whatever the number of ranks, "
            "and each rank runs grad_accum / ranks of its micro-batches");
  std::vector<int64_t> micros;
  for (int64_t m = rank; m < grad_accum; m += world) micros.push_back(m);
  return micros;
}

// ---------------------------------------------------------------------------------------------
// ProcessGroup

struct ProcessGroup::Impl {
  std::string who;  // "rank r of w", for messages
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  bool failed = false;

  // Waits for `work`; on failure, marks the group failed (aborted, not shut down) and throws.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    try {
      work->wait(timeout);
    } catch (const std::exception& e) {
      failed = true;
      throw Error(cat(who, ": ", what, " failed: a peer rank stopped (see its own message) or did not answer within ",
                      seconds(timeout), " (--dist-timeout) [", short_message(e), "]"));
    }
  }
};

ProcessGroup::ProcessGroup(const DistEnv& env, torch::Device device, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()), rank_(env.rank), world_(env.world_size), device_(device), timeout_(timeout) {
  const std::string who = cat("rank ", rank_, " of ", world_);
  impl_->who = who;
  impl_->timeout = timeout;
  LT2_CHECK(timeout.count() > 0, who, ": the distributed timeout must be > 0");
  // A write to the socket of a peer that died raises SIGPIPE, which would end this rank silently;
  // ignored, the write fails with EPIPE and the collective reports the lost peer.
  ::signal(SIGPIPE, SIG_IGN);
  // A rank started by `lt2 train --nproc` ends with its launcher, which hosts the store.
  if (const auto launcher = environment().launcher_pid) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    LT2_CHECK(::getppid() == *launcher, who, ": the `lt2 train --nproc` launcher (pid ", *launcher, ") has gone");
  }

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0 && !env.launcher_hosts_store;
  opts.numWorkers = env.world_size;
  opts.waitWorkers = false;  // the join below names the ranks that are missing
  opts.timeout = timeout;
  const std::string store_at = cat(env.master_addr, ":", env.master_port);
  LT2_CHECK(opts.isServer || wait_for_listener(env.master_addr, env.master_port, deadline), who,
            ": cannot reach the rendezvous store at ", store_at, " within ", seconds(timeout),
            " (is rank 0 running? are MASTER_ADDR/MASTER_PORT right? --dist-timeout)");
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  try {
    tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    throw Error(cat(who, ": cannot ", opts.isServer ? "host" : "reach", " the rendezvous store at ", store_at, ": ",
                    short_message(e)));
  }
  // Keys of this attempt only: torchrun may restart the ranks against the same agent store.
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  impl_->store = c10::make_intrusive<c10d::PrefixStore>(cat("lt2/", attempt ? attempt : "0"), tcp);

  // Join: every rank announces itself and waits for all the others.
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(cat("joined/", r));
  impl_->store->set(keys[rank_], std::string("1"));
  try {
    impl_->store->wait(keys, std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now()),
                                      std::chrono::milliseconds(1)));
  } catch (const std::exception& e) {
    std::string missing;
    try {
      for (int r = 0; r < world_; ++r)
        if (!impl_->store->check({keys[r]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    } catch (const std::exception&) {
      missing = "unknown (the store went away)";
    }
    throw Error(cat(who, ": not every rank joined within ", seconds(timeout), "; missing rank(s): ", missing,
                    " (a rank did not start or failed early, or ranks disagree on MASTER_ADDR/MASTER_PORT/WORLD_SIZE)"));
  }

  try {
    if (device.is_cuda()) {
#ifdef USE_C10D_NCCL
      // ProcessGroupNCCL's layout follows the NCCL version of the nccl.h it was compiled with; a
      // header other than the library's would build a differently sized object.
      const auto [major, minor, patch] = c10d::getNcclVersionTuple();
      LT2_CHECK(major == NCCL_MAJOR && minor == NCCL_MINOR, who, ": lt2 was compiled with nccl.h ", NCCL_MAJOR, ".",
                NCCL_MINOR, " but libtorch runs NCCL ", major, ".", minor, ".", patch,
                "; rebuild with the nccl.h of the nvidia-nccl wheel beside torch (CMake NCCL_INCLUDE_DIR)");
      auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
      nccl_opts->timeout = timeout;
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", impl_->store), rank_, world_, nccl_opts);
#else
      throw Error(cat(who, ": data-parallel training on CUDA needs NCCL, and this lt2 was built without CUDA"));
#endif
    } else {
      // On the loopback (one machine) Gloo binds the loopback too; otherwise it binds the interface of
      // this host's name (or GLOO_SOCKET_IFNAME), as PyTorch does.
      auto gloo_opts = c10d::ProcessGroupGloo::Options::create_default(timeout);
      if (is_loopback(env.master_addr))
        gloo_opts->devices = {c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")};
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo", impl_->store), rank_, world_, gloo_opts);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(cat(who, ": cannot set up ", device.is_cuda() ? "NCCL" : "Gloo", " within ", seconds(timeout), ": ",
                    short_message(e)));
  }
}

ProcessGroup::~ProcessGroup() {
  if (!impl_->backend) return;
  try {
    if (impl_->failed) impl_->backend->abort();
    else impl_->backend->shutdown();
  } catch (const std::exception&) {  // ending anyway
  }
}

void ProcessGroup::all_reduce_sum(torch::Tensor& t, const std::string& what) {
  std::vector<at::Tensor> ts{t};
  impl_->wait(impl_->backend->allreduce(ts), what);
}

void ProcessGroup::broadcast(torch::Tensor& t, int root, const std::string& what) {
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  impl_->wait(impl_->backend->broadcast(ts, opts), what);
}

// ---------------------------------------------------------------------------------------------
// GradientBuckets

struct GradientBuckets::State {
  struct Param {
    std::string name;
    torch::Tensor tensor;
    std::shared_ptr<torch::autograd::Node> accumulator;  // held, so autograd keeps using this node
    uintptr_t hook = 0;
    int runs = 0;          // runs of the accumulator in the current last backward
    int expected = 0;      // runs counted in the first step (0: not reduced)
    int64_t final_at = -1;  // counting step: when the last run happened
    int64_t bucket = -1, offset = 0;
  };
  struct Bucket {
    std::vector<size_t> members;
    torch::Tensor flat;  // [sum of the members' numel]
    size_t pending = 0;  // members not yet final in this backward
    c10::intrusive_ptr<c10d::Work> work;
  };

  std::shared_ptr<ProcessGroup> group;
  int64_t bucket_bytes = 0;
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  size_t next_bucket = 0;  // buckets launch in order, so every rank issues the same collectives
  bool armed = false, counted = false;
  int64_t clock = 0;
  std::mutex mu;

  void on_accumulated(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    if (!armed) return;
    Param& p = params[i];
    ++p.runs;
    if (!counted) {
      p.final_at = clock++;
      return;
    }
    LT2_CHECK(p.runs <= p.expected, group->impl_->who, ": parameter '", p.name, "' got ", p.runs,
              " gradient contributions in one backward, ", p.expected, " in the first step: the model's graph "
              "changed between steps, which the overlapped gradient all-reduce cannot follow");
    if (p.runs < p.expected) return;
    copy_in(i);
    if (--buckets[p.bucket].pending == 0) launch_ready();
  }

  void copy_in(size_t i) {
    Param& p = params[i];
    auto slot = buckets[p.bucket].flat.narrow(0, p.offset, p.tensor.numel());
    if (p.tensor.grad().defined()) slot.copy_(p.tensor.grad().reshape({-1}));
    else slot.zero_();
  }

  void launch(size_t b) {
    std::vector<at::Tensor> ts{buckets[b].flat};
    buckets[b].work = group->impl_->backend->allreduce(ts);
  }

  void launch_ready() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  // After the counting step: buckets in the order gradients became final on rank 0, each of one
  // dtype and at most bucket_bytes (or one larger parameter).
  void build_buckets() {
    const int64_t n = static_cast<int64_t>(params.size());
    std::vector<int64_t> order;
    for (int64_t i = 0; i < n; ++i)
      if (params[i].runs > 0) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return params[a].final_at < params[b].final_at; });
    order.resize(n, -1);
    auto shared = torch::tensor(order, torch::kLong).to(group->device());
    group->broadcast(shared, 0, "gradient bucket order");
    order.assign(n, -1);
    shared = shared.cpu();
    std::copy_n(shared.data_ptr<int64_t>(), n, order.begin());

    std::vector<bool> reduced(n, false);
    int64_t open_bytes = 0, open_numel = 0;
    for (int64_t i : order) {
      if (i < 0) break;
      Param& p = params[i];
      reduced[i] = true;
      p.expected = std::max(p.runs, 1);  // rank 0 saw a gradient; this rank contributes zeros if it did not
      const int64_t bytes = p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
      const bool same_kind = !buckets.empty() && params[buckets.back().members.front()].tensor.options().dtype() ==
                                                     p.tensor.options().dtype();
      if (!same_kind || (open_bytes > 0 && open_bytes + bytes > bucket_bytes)) {
        buckets.emplace_back();
        open_bytes = open_numel = 0;
      }
      p.bucket = static_cast<int64_t>(buckets.size()) - 1;
      p.offset = open_numel;
      open_numel += p.tensor.numel();
      open_bytes += bytes;
      buckets.back().members.push_back(static_cast<size_t>(i));
    }
    for (int64_t i = 0; i < n; ++i)
      LT2_CHECK(reduced[i] || params[i].runs == 0, group->impl_->who, ": parameter '", params[i].name,
                "' got a gradient on this rank but not on rank 0: the ranks run different graphs");
    for (auto& b : buckets) {
      int64_t numel = 0;
      for (size_t m : b.members) numel += params[m].tensor.numel();
      b.flat = torch::empty({numel}, params[b.members.front()].tensor.options().requires_grad(false));
    }
  }
};

GradientBuckets::GradientBuckets(std::shared_ptr<ProcessGroup> group,
                                 const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                 int64_t bucket_bytes)
    : s_(std::make_unique<State>()) {
  LT2_CHECK(bucket_bytes > 0, "gradient bucket size must be > 0 bytes, found ", bucket_bytes);
  s_->group = std::move(group);
  s_->bucket_bytes = bucket_bytes;
  for (const auto& [name, t] : params) {
    if (!t.requires_grad()) continue;
    State::Param p;
    p.name = name;
    p.tensor = t;
    p.accumulator = torch::autograd::impl::grad_accumulator(t);
    s_->params.push_back(std::move(p));
  }
  // A post hook on AccumulateGrad runs once .grad holds that run's contribution.
  struct Hook : torch::autograd::FunctionPostHook {
    State* state;
    size_t index;
    Hook(State* s, size_t i) : state(s), index(i) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      state->on_accumulated(index);
      return outputs;
    }
  };
  for (size_t i = 0; i < s_->params.size(); ++i)
    s_->params[i].hook = s_->params[i].accumulator->add_post_hook(std::make_unique<Hook>(s_.get(), i));
}

GradientBuckets::~GradientBuckets() {
  for (auto& p : s_->params) p.accumulator->del_post_hook(p.hook);
}

int64_t GradientBuckets::num_buckets() const { return static_cast<int64_t>(s_->buckets.size()); }

void GradientBuckets::begin_last_backward() {
  std::lock_guard<std::mutex> lock(s_->mu);
  for (auto& p : s_->params) p.runs = 0;
  for (auto& b : s_->buckets) {
    b.pending = b.members.size();
    b.work.reset();
  }
  s_->next_bucket = 0;
  s_->clock = 0;
  s_->armed = true;
}

void GradientBuckets::finish(int64_t step) {
  std::unique_lock<std::mutex> lock(s_->mu);
  LT2_CHECK(s_->armed, "GradientBuckets::finish without begin_last_backward");
  s_->armed = false;
  const std::string what = cat("gradient all-reduce (step ", step, ")");
  const bool counting = !s_->counted;
  if (counting) {
    s_->build_buckets();
    s_->counted = true;
  }
  // What backward left: everything in the counting step; otherwise the members whose gradient came
  // fewer times than counted (or not at all), final now.
  for (size_t b = s_->next_bucket; b < s_->buckets.size(); ++b)
    for (size_t m : s_->buckets[b].members)
      if (counting || s_->params[m].runs < s_->params[m].expected) s_->copy_in(m);
  while (s_->next_bucket < s_->buckets.size()) s_->launch(s_->next_bucket++);
  for (auto& b : s_->buckets) {
    s_->group->impl_->wait(b.work, what);
    b.work.reset();
  }
  for (auto& b : s_->buckets) {
    for (size_t m : b.members) {
      auto& p = s_->params[m];
      auto sum = b.flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
      if (p.tensor.grad().defined()) p.tensor.mutable_grad().copy_(sum);
      else p.tensor.mutable_grad() = sum.clone();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launcher

namespace {

std::vector<pid_t> g_ranks;  // for the signal handler: pass SIGINT/SIGTERM on to the ranks

void pass_signal_on(int sig) {
  for (pid_t pid : g_ranks)
    if (pid > 0) ::kill(pid, sig);
}

std::string describe_exit(int rank, pid_t pid, int status) {
  if (WIFEXITED(status)) return cat("rank ", rank, " (pid ", pid, ") exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return cat("rank ", rank, " (pid ", pid, ") was killed by signal ", WTERMSIG(status), " (", ::strsignal(WTERMSIG(status)), ")");
  return cat("rank ", rank, " (pid ", pid, ") ended with wait status ", status);
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
  const std::vector<std::string> ours{"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", kLauncherPidVariable};
  std::vector<std::string> inherited;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (std::find(ours.begin(), ours.end(), key) == ours.end()) inherited.push_back(kv);
  }
  if (!std::getenv("OMP_NUM_THREADS")) inherited.push_back(cat("OMP_NUM_THREADS=", threads));

  std::vector<std::string> argv_s{args};
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::fflush(stdout);
  std::fflush(stderr);
  g_ranks.assign(nproc, -1);
  std::string started;
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> env_s = inherited;
    for (const auto& kv : {cat("RANK=", r), cat("LOCAL_RANK=", r), cat("WORLD_SIZE=", nproc),
                           cat("LOCAL_WORLD_SIZE=", nproc), std::string("MASTER_ADDR=127.0.0.1"),
                           cat("MASTER_PORT=", port), std::string("TORCHELASTIC_USE_AGENT_STORE=True"),
                           cat(kLauncherPidVariable, "=", ::getpid())})
      env_s.push_back(kv);
    std::vector<char*> envp;
    for (auto& kv : env_s) envp.push_back(kv.data());
    envp.push_back(nullptr);
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data());
    if (rc != 0) {
      pass_signal_on(SIGKILL);
      for (pid_t p : g_ranks)
        if (p > 0) ::waitpid(p, nullptr, 0);
      throw Error(cat("cannot start rank ", r, " ('", exe, "'): ", std::strerror(rc)));
    }
    g_ranks[r] = pid;
    started += cat(r ? ", " : "", "rank ", r, " pid ", pid);
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
  int running = nproc;
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, failure.empty() ? 0 : WNOHANG);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {  // stopping the others: poll until they are gone or the grace period ends
      if (std::chrono::steady_clock::now() >= kill_at) pass_signal_on(SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const auto it = std::find(g_ranks.begin(), g_ranks.end(), pid);
    if (it == g_ranks.end()) continue;
    const int rank = static_cast<int>(it - g_ranks.begin());
    *it = -1;
    --running;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && failure.empty()) {
      failure = describe_exit(rank, pid, status);
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
