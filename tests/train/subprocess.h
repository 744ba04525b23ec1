// Starting and watching `lt2` processes from a test, on the library's launcher (util/process.h):
// output to a log file, waits bounded in time.
#pragma once
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lt2/util/environment.h"
#include "lt2/util/process.h"

namespace lt2::testing {

using lt2::Process;

// Starts args[0] with args, this environment minus any data-parallel variables, plus `env`
// ("NAME=value" entries); stdout and stderr go to `log`.
inline Process start_process(const std::vector<std::string>& args, const std::vector<std::string>& env,
                             const std::string& log) {
  SpawnOptions opts;
  opts.env = current_environment({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", kLauncherPidVariable});
  opts.env->insert(opts.env->end(), env.begin(), env.end());
  opts.output = log;
  return Process::spawn(args, opts);
}

struct Exit {
  bool finished = false;  // false: still running after the timeout (then killed)
  int status = 0;         // wait status
  double seconds = 0;     // from the call to the exit
  double since_start = 0;  // from the start of the process to the exit
  bool ok() const { return finished && ExitStatus{status}.ok(); }
};

// Waits at most timeout_s for `p` to exit; kills it (SIGKILL) when it does not.
inline Exit wait_process(Process& p, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  Exit e;
  e.finished = p.wait(timeout_s);
  if (!e.finished) {
    p.kill(SIGKILL);
    p.wait();
  }
  e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  e.status = p.status().raw;
  e.since_start = p.seconds();
  return e;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls until pred() holds or timeout_s passes; returns pred().
inline bool wait_until(const std::function<bool()>& pred, double timeout_s) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// A TCP port on the loopback that was free a moment ago.
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace lt2::testing
