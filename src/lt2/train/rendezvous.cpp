// c10d guards its backend headers with the macros of PyTorch's own build: libtorch_cpu always
// carries Gloo, libtorch_cuda carries NCCL (linked only by the CUDA build). The libtorch wheel
// ships no gloo headers; Debian's libgloo-dev provides the few that ProcessGroupGloo.hpp names.
// Their version differs from the gloo inside libtorch, which is safe here: ProcessGroupGloo and
// its Options hold gloo objects only through pointers, and every Gloo function called runs in
// libtorch_cpu. Torch's CMake package may define them on the command line already.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#if defined(LT2_WITH_CUDA) && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL
#endif

#include "lt2/train/rendezvous.h"

#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <thread>

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "lt2/util/environment.h"
#include "lt2/util/error.h"

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

c10::intrusive_ptr<c10d::Work> ProcessGroup::start_all_reduce_sum(torch::Tensor& t) {
  std::vector<at::Tensor> ts{t};
  return impl_->backend->allreduce(ts);
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) { impl_->wait(work, what); }

const std::string& ProcessGroup::who() const { return impl_->who; }

}  // namespace lt2
