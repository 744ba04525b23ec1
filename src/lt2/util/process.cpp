#include "lt2/util/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "lt2/util/error.h"

extern char** environ;

namespace lt2 {

namespace {

using Clock = std::chrono::steady_clock;

// Between two checks of a child that has not exited yet.
constexpr auto kPollInterval = std::chrono::milliseconds(10);

}  // namespace

bool ExitStatus::exited() const { return WIFEXITED(raw); }
bool ExitStatus::signaled() const { return WIFSIGNALED(raw); }
int ExitStatus::code() const { return WEXITSTATUS(raw); }
int ExitStatus::signal() const { return WTERMSIG(raw); }

std::string ExitStatus::describe() const {
  if (exited()) return cat("exited with status ", code());
  if (signaled()) return cat("was killed by signal ", signal(), " (", ::strsignal(signal()), ")");
  return cat("ended with wait status ", raw);
}

std::vector<std::string> current_environment(const std::vector<std::string>& drop) {
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (std::find(drop.begin(), drop.end(), kv.substr(0, kv.find('='))) == drop.end()) out.push_back(kv);
  }
  return out;
}

Process::~Process() { reset(); }

void Process::reset() {
  if (started() && !finished_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

Process::Process(Process&& other) noexcept { *this = std::move(other); }

Process& Process::operator=(Process&& other) noexcept {
  if (this == &other) return *this;
  reset();
  pid_ = other.pid_;
  finished_ = other.finished_;
  status_ = other.status_;
  started_ = other.started_;
  ended_ = other.ended_;
  other.pid_ = -1;
  other.finished_ = false;
  return *this;
}

Process Process::spawn(const std::vector<std::string>& argv, const SpawnOptions& opts) {
  LT2_CHECK(!argv.empty(), "Process::spawn: no arguments (argv[0] at least)");
  const std::string program = opts.program.empty() ? argv[0] : opts.program;
  LT2_CHECK(!program.empty(), "Process::spawn: no program to start");
  std::vector<std::string> args = argv;
  std::vector<std::string> env_s = opts.env ? *opts.env : std::vector<std::string>{};
  std::vector<char*> cargv, cenv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& kv : env_s) cenv.push_back(kv.data());
  cenv.push_back(nullptr);

  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  if (!opts.output.empty()) {
    posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, opts.output.c_str(),
                                     O_WRONLY | O_CREAT | (opts.append ? O_APPEND : O_TRUNC), 0644);
    posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
  }
  Process p;
  p.started_ = Clock::now();
  const int rc = ::posix_spawn(&p.pid_, program.c_str(), &files, nullptr, cargv.data(),
                               opts.env ? cenv.data() : environ);
  posix_spawn_file_actions_destroy(&files);
  if (rc != 0) {
    p.pid_ = -1;
    throw Error(cat("cannot start '", program, "': ", std::strerror(rc)));
  }
  return p;
}

double Process::seconds() const {
  return std::chrono::duration<double>((finished_ ? ended_ : Clock::now()) - started_).count();
}

bool Process::poll() {
  if (!started() || finished_) return finished_;
  int status = 0;
  pid_t got;
  do {
    got = ::waitpid(pid_, &status, WNOHANG);
  } while (got < 0 && errno == EINTR);
  if (got == pid_) {
    finished_ = true;
    status_.raw = status;
    ended_ = Clock::now();
  }
  LT2_CHECK(got >= 0, "waitpid(", pid_, ") failed: ", std::strerror(errno));
  return finished_;
}

bool Process::wait(double timeout_s) {
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (!poll()) {
    if (timeout_s >= 0 && Clock::now() >= end) return false;
    std::this_thread::sleep_for(kPollInterval);
  }
  return true;
}

void Process::kill(int sig) const {
  if (started() && !finished_) ::kill(pid_, sig);
}

int wait_any(std::vector<Process*> children, double timeout_s) {
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    bool any = false;
    for (size_t i = 0; i < children.size(); ++i) {
      Process* c = children[i];
      if (!c || !c->started() || c->finished()) continue;
      any = true;
      if (c->poll()) return static_cast<int>(i);
    }
    if (!any || (timeout_s >= 0 && Clock::now() >= end)) return -1;
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace lt2
