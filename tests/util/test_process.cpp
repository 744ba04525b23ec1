// util/process: start a child with its arguments, environment and output file, wait for it with a
// time limit, kill it, and read how it ended.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <filesystem>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"
#include "lt2/util/process.h"

using namespace lt2;

namespace {

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() / name).string();
}

Process sh(const std::string& script, const SpawnOptions& opts = {}) {
  return Process::spawn({"/bin/sh", "-c", script}, opts);
}

}  // namespace

TEST(Process, ExitStatusOutputAndEnvironment) {
  const std::string out = temp_file("lt2_test_process.log");
  SpawnOptions opts;
  opts.output = out;
  setenv("LT2_TEST_DROPPED", "x", 1);
  opts.env = current_environment({"LT2_TEST_DROPPED"});
  unsetenv("LT2_TEST_DROPPED");
  opts.env->push_back("LT2_TEST_VALUE=42");
  auto p = sh("echo out $LT2_TEST_VALUE; echo err \"[$LT2_TEST_DROPPED]\" >&2; exit 3", opts);
  EXPECT_GT(p.pid(), 0);
  ASSERT_TRUE(p.wait(30));
  EXPECT_TRUE(p.finished());
  EXPECT_TRUE(p.status().exited());
  EXPECT_EQ(p.status().code(), 3);
  EXPECT_FALSE(p.status().ok());
  EXPECT_EQ(p.status().describe(), "exited with status 3");
  EXPECT_EQ(read_file(out), "out 42\nerr []\n");

  // Appending keeps what the file held; truncating does not.
  opts.append = true;
  ASSERT_TRUE(sh("echo more", opts).wait(30));
  EXPECT_EQ(read_file(out), "out 42\nerr []\nmore\n");
  opts.append = false;
  auto ok = sh("echo fresh", opts);
  ASSERT_TRUE(ok.wait(30));
  EXPECT_TRUE(ok.status().ok());
  EXPECT_EQ(read_file(out), "fresh\n");
}

TEST(Process, TimeoutKillAndWaitAny) {
  auto slow = sh("exec sleep 30");
  EXPECT_FALSE(slow.wait(0.05));
  EXPECT_FALSE(slow.poll());
  auto quick = sh("exit 0");
  std::vector<Process*> both{&slow, &quick};
  EXPECT_EQ(wait_any(both, 30), 1);
  EXPECT_TRUE(quick.status().ok());
  EXPECT_EQ(wait_any(both, 0.05), -1);  // the slow one still runs
  slow.kill(SIGKILL);
  EXPECT_EQ(wait_any(both, 30), 0);
  EXPECT_TRUE(slow.status().signaled());
  EXPECT_EQ(slow.status().signal(), SIGKILL);
  EXPECT_NE(slow.status().describe().find("was killed by signal 9"), std::string::npos) << slow.status().describe();
  EXPECT_LT(slow.seconds(), 30);
  EXPECT_EQ(wait_any(both, 0), -1);  // none left running
}

TEST(Process, DestroyingARunningChildKillsIt) {
  pid_t pid = -1;
  {
    auto p = sh("exec sleep 30");
    pid = p.pid();
    Process moved = std::move(p);
    EXPECT_FALSE(p.started());
    EXPECT_EQ(moved.pid(), pid);
  }
  EXPECT_NE(::kill(pid, 0), 0);  // reaped: no such process
}

TEST(Process, AProgramThatCannotStartIsAnError) {
  try {
    Process::spawn({"/no/such/program"});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot start '/no/such/program'"), std::string::npos) << e.what();
  }
}
