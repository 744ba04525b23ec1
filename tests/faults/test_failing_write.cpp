// A checkpoint write that fails (files may not grow past 8 KiB: the write fails with EFBIG, as it
// fails with ENOSPC on a full disk; this works as root, unlike a read-only folder) ends `lt2 train`
// with an error naming the file and the system's reason, and leaves the previous checkpoint and
// `latest` as they were, with no temporary file; the run then resumes to an uninterrupted run's
// weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "cli/cli_testing.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/train/trainer.h"
#include "train/train_testing.h"

using namespace lt2;
using namespace lt2::testing;
namespace fs = std::filesystem;

namespace {

std::map<std::string, std::string> files_of(const std::string& folder) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(folder)) out[e.path().filename().string()] = read_file(e.path().string());
  return out;
}

}  // namespace

TEST(FailingWrite, AFullDiskLeavesThePreviousCheckpoint) {
  const std::string dir = (fs::temp_directory_path() / "lt2_failing_write").string();
  remove_tree(dir);
  auto c = tiny_run(dir);
  c.steps = 4;
  c.save_every = 1;
  const std::string cfg = dir + "/train.json", out = dir + "/run";
  write_file_atomic(cfg, c.to_json().dump(2));
  const CliRun full = run_cli({"train", "--config", cfg}, dir + "/full.log");
  ASSERT_EQ(full.code, 0) << full.output;
  std::map<std::string, torch::Tensor> expected;
  for (const auto& [name, t] : module_tensors(*load_checkpoint(out + "/ckpt-4"))) expected[name] = t.clone();
  // Step 4's checkpoint not written yet: as a run stopped after saving step 3.
  remove_tree(out + "/ckpt-4");
  write_file_atomic(out + "/latest", std::string("ckpt-3\n"));
  const auto before = files_of(out + "/ckpt-3");

  // `ulimit -f` counts 512-byte blocks in /bin/sh (dash); SIGXFSZ ignored, the write returns EFBIG.
  const std::string log = dir + "/limited.log";
  Process p = start_process({"/bin/sh", "-c", "trap '' XFSZ; ulimit -f 16; exec \"$0\" \"$@\"", kLt2, "train", "--config",
                             cfg, "--resume"},
                            {"OMP_NUM_THREADS=1"}, log);
  const Exit e = wait_process(p, 120);
  const std::string output = read_text(log);
  EXPECT_TRUE(e.finished && ExitStatus{e.status}.exited() && ExitStatus{e.status}.code() == 1) << output;
  EXPECT_NE(output.find("lt2: error: write to '" + out + "/ckpt-4.tmp/"), std::string::npos) << output;
  EXPECT_NE(output.find("failed: File too large"), std::string::npos) << output;
  // The previous checkpoint, `latest` and nothing else.
  EXPECT_EQ(read_file(out + "/latest"), "ckpt-3\n");
  EXPECT_EQ(files_of(out + "/ckpt-3"), before);
  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(out)) entries.push_back(entry.path().filename().string());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"ckpt-3", "latest", "metrics.jsonl", "train_config.json"}));
  load_checkpoint(out + "/ckpt-3");

  // With room again, the run resumes and ends where the uninterrupted run did.
  const CliRun resumed = run_cli({"train", "--config", cfg, "--resume"}, dir + "/resumed.log");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  for (const auto& [name, t] : module_tensors(*load_checkpoint(out + "/ckpt-4")))
    EXPECT_TRUE(torch::equal(t, expected.at(name))) << name;
  remove_tree(dir);
}
