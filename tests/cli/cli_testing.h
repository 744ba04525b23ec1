// Running the real `lt2` command (LT2_CLI) from a test: its exit and everything it printed.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "lt2/util/fs.h"
#include "train/subprocess.h"

namespace lt2::testing {

const std::string kLt2 = LT2_CLI;

struct CliRun {
  int code = -1;       // exit status; -1 when it did not exit by itself
  std::string output;  // stdout and stderr together
  bool contains(const std::string& part) const { return output.find(part) != std::string::npos; }
};

// Runs `lt2 args...` with one intra-op thread (runs compare bit for bit), at most timeout_s seconds;
// `log` takes its output.
inline CliRun run_cli(const std::vector<std::string>& args, const std::string& log, double timeout_s = 120) {
  std::vector<std::string> argv{kLt2};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p = start_process(argv, {"OMP_NUM_THREADS=1"}, log);
  const Exit e = wait_process(p, timeout_s);
  CliRun r;
  if (e.finished && ExitStatus{e.status}.exited()) r.code = ExitStatus{e.status}.code();
  r.output = read_text(log);
  return r;
}

// Expects `lt2 args...` to fail with exit status 1 (a user's error) and to print every part.
inline void expect_cli_error(const std::vector<std::string>& args, const std::string& log,
                             const std::vector<std::string>& parts, int code = 1) {
  const CliRun r = run_cli(args, log);
  std::string cmd;
  for (const auto& a : args) cmd += " " + a;
  EXPECT_EQ(r.code, code) << "lt2" << cmd << "\n" << r.output;
  for (const auto& p : parts) EXPECT_TRUE(r.contains(p)) << "lt2" << cmd << ": '" << p << "' not in:\n" << r.output;
}

}  // namespace lt2::testing
