// Starting and watching `lt2` processes from a test: posix_spawn (no fork of a process that
// already runs libtorch threads), output to a log file, waits bounded in time.
#pragma once
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace lt2::testing {

struct Process {
  pid_t pid = -1;
  std::string log;  // stdout and stderr
  std::chrono::steady_clock::time_point started;
};

// Starts args[0] with args, this environment minus any data-parallel variables, plus `env`
// ("NAME=value" entries); stdout and stderr go to `log`.
inline Process start_process(const std::vector<std::string>& args, const std::vector<std::string>& env,
                             const std::string& log) {
  static const std::vector<std::string> job_vars{"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                                                 "LT2_LAUNCHER_PID"};
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (std::find(job_vars.begin(), job_vars.end(), kv.substr(0, kv.find('='))) == job_vars.end()) env_s.push_back(kv);
  }
  env_s.insert(env_s.end(), env.begin(), env.end());
  std::vector<std::string> args_s = args;
  std::vector<char*> argv, envp;
  for (auto& a : args_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& kv : env_s) envp.push_back(kv.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
  Process p;
  p.log = log;
  p.started = std::chrono::steady_clock::now();
  const int rc = posix_spawn(&p.pid, args_s[0].c_str(), &files, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&files);
  if (rc != 0) throw std::runtime_error("posix_spawn " + args_s[0] + " failed");
  return p;
}

struct Exit {
  bool finished = false;  // false: still running after the timeout (then killed)
  int status = 0;         // wait status
  double seconds = 0;     // from the call to the exit
  double since_start = 0;  // from the start of the process to the exit
  bool ok() const { return finished && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Waits at most timeout_s for `p` to exit; kills it (SIGKILL) when it does not.
inline Exit wait_process(Process& p, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  Exit e;
  for (;;) {
    e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waitpid(p.pid, &e.status, WNOHANG) == p.pid) {
      e.finished = true;
      break;
    }
    if (e.seconds > timeout_s) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &e.status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  e.since_start = std::chrono::duration<double>(std::chrono::steady_clock::now() - p.started).count();
  p.pid = -1;
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
