// Child processes: the one launcher of lt2 (`lt2 tasks sweep` runs, `lt2 train --nproc` ranks, the
// tests' `lt2` runs). posix_spawn, not fork: the parent may already run libtorch threads.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace lt2 {

// How a child ended: a wait status, as waitpid gives it.
struct ExitStatus {
  int raw = 0;
  bool exited() const;     // ended by exit() (then code() is its status)
  bool signaled() const;   // killed by a signal (then signal() is it)
  int code() const;
  int signal() const;
  bool ok() const { return exited() && code() == 0; }
  // "exited with status 3", "was killed by signal 9 (Killed)", "ended with wait status N".
  std::string describe() const;
};

struct SpawnOptions {
  // The file to run ("": argv[0]); argv[0] is then only the name the child sees.
  std::string program;
  // The child's whole environment ("NAME=value"); nullopt: this process's.
  std::optional<std::vector<std::string>> env;
  // A file that takes the child's stdout and stderr ("": the child shares this process's).
  std::string output;
  bool append = false;  // append to `output` instead of truncating it
};

// This process's environment as "NAME=value" entries, without the variables named in `drop`.
std::vector<std::string> current_environment(const std::vector<std::string>& drop = {});

// One child process. Movable, not copyable; a child still running when its Process is destroyed
// is killed (SIGKILL) and reaped, so none outlives the object that started it.
class Process {
 public:
  Process() = default;
  ~Process();
  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Starts opts.program, or else argv[0] (a path, not searched in PATH), with arguments argv.
  // Throws lt2::Error ("cannot start '<program>': <reason>") when it cannot.
  static Process spawn(const std::vector<std::string>& argv, const SpawnOptions& opts = {});

  pid_t pid() const { return pid_; }
  bool started() const { return pid_ > 0; }
  // True once the child has exited and been reaped (then status() says how it ended).
  bool finished() const { return finished_; }
  const ExitStatus& status() const { return status_; }
  // Seconds from the start to the exit (or to now, while it runs).
  double seconds() const;

  // Reaps the child if it has exited, without blocking; returns finished().
  bool poll();
  // Waits at most timeout_s seconds (negative: without limit); returns finished().
  bool wait(double timeout_s = -1);
  // Sends `sig` while the child runs (nothing once it has been reaped).
  void kill(int sig) const;

 private:
  void reset();  // kills and reaps a running child; leaves an empty Process
  pid_t pid_ = -1;
  bool finished_ = false;
  ExitStatus status_;
  std::chrono::steady_clock::time_point started_, ended_;
};

// Waits until one of `children` that has not finished yet exits, at most timeout_s seconds
// (negative: without limit); returns its index, or -1 on timeout or when none is running.
int wait_any(std::vector<Process*> children, double timeout_s = -1);

}  // namespace lt2
