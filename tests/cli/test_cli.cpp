// The `lt2` command as a user meets it: a numeric flag that is given is used or refused, never
// replaced by a default; a config's integer field takes only integers; `lt2 info` checks a
// checkpoint's weights against its config; an Hugging Face config without model_type is refused
// naming that field.
#include <gtest/gtest.h>

#include <filesystem>

#include "cli/cli_testing.h"
#include "common/testing.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/tokenizer/tokenizer.h"
#include "lt2/util/json.h"
#include "train/train_testing.h"

using namespace lt2;
using namespace lt2::testing;
namespace fs = std::filesystem;

namespace {

// CLI11's exit status for a value its check refuses.
constexpr int kValidationError = 105;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("lt2_cli_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name())))
               .string();
    remove_tree(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { remove_tree(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string log() { return path("log" + std::to_string(++runs_) + ".txt"); }

  // The tiny CPU run of the trainer tests, one step, as a `--config` file.
  std::string train_config() {
    auto c = tiny_run(dir_);
    c.steps = 1;
    c.eval_batches = 1;
    write_file_atomic(path("train.json"), c.to_json().dump(2));
    return path("train.json");
  }

  // A saved tiny model: the folder of `lt2 info` and `lt2 generate`.
  std::string checkpoint() {
    auto cfg = tiny_config();
    cfg.vocab_size = 300;  // the byte-level tokenizer's 257 tokens fit
    torch::manual_seed(1);
    save_checkpoint(path("ckpt"), LoopedLM(cfg));
    return path("ckpt");
  }

  std::string dir_;
  int runs_ = 0;
};

}  // namespace

TEST_F(Cli, TrainFlagsAreUsedOrRefused) {
  const std::string cfg = train_config();
  // --lr 0 used to be replaced by the default 3e-4; every numeric flag reaches the config's checks.
  expect_cli_error({"train", "--config", cfg, "--lr", "0"}, log(), {"'lr' must be > 0, found 0"});
  expect_cli_error({"train", "--config", cfg, "--steps", "-1"}, log(), {"'steps' must be > 0, found -1"});
  expect_cli_error({"train", "--config", cfg, "--seq-len", "0"}, log(), {"'seq_len' must be > 0, found 0"});
  expect_cli_error({"train", "--config", cfg, "--warmup", "-2"}, log(), {"'warmup' must be >= 0, found -2"});
  expect_cli_error({"train", "--config", cfg, "--save-every", "-1"}, log(), {"'save_every' must be >= 0"});
  expect_cli_error({"train", "--config", cfg, "--seed", "-1"}, log(),
                   {"field 'seed' must be an integer in [0, 18446744073709551615], found -1"});
  expect_cli_error({"train", "--config", cfg, "--dist-timeout", "0"}, log(), {"'dist_timeout' must be > 0 seconds, found 0"});
  expect_cli_error({"train", "--config", cfg, "--nproc", "0"}, log(), {"--nproc: must be >= 1, found 0"}, kValidationError);
  expect_cli_error({"train", "--config", cfg, "--steps", "2.5"}, log(), {"--steps", "2.5"}, 104 /* conversion */);
  // --keep-best selects on the validation loss: without validation data it says so.
  expect_cli_error({"train", "--config", cfg, "--keep-best", "--eval-every", "1"}, log(),
                   {"'keep_best'", "needs 'val_data'"});
  // Kernel switches: an unknown name lists the known ones; a bad value names the switch.
  expect_cli_error({"train", "--config", cfg, "--kernel-option", "residual_norms=0"}, log(),
                   {"'kernel_options'", "unknown decode option 'residual_norms'", "residual_norm"});
  expect_cli_error({"train", "--config", cfg, "--kernel-option", "residual_norm=maybe"}, log(),
                   {"'kernel_options'", "'residual_norm'", "maybe"});
  expect_cli_error({"train", "--config", cfg, "--kernel-option", "residual_norm"}, log(),
                   {"--kernel-option: expected name=value"});
  // Given values are used, 0 included where 0 means something (--eval-every 0: at the end only).
  const CliRun ok = run_cli({"train", "--config", cfg, "--lr", "0.0125", "--seed", "0", "--eval-every", "0",
                             "--warmup", "0", "--kernel-option", "residual_norm=0", "--out", path("run")},
                            log());
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("kernel switches: {\"residual_norm\":\"0\"}"), std::string::npos) << ok.output;
  const json used = load_json_file(path("run/train_config.json"));
  EXPECT_EQ(used["lr"], 0.0125);
  EXPECT_EQ(used["seed"], 0);
  EXPECT_EQ(used["eval_every"], 0);
  EXPECT_EQ(used["warmup"], 0);
  EXPECT_EQ(used["kernel_options"], json({{"residual_norm", "0"}}));
}

TEST_F(Cli, TrainPatternAndMixerOptionsBuildTheNewModel) {
  const std::string cfg = train_config();
  const CliRun ok = run_cli({"train", "--config", cfg, "--pattern", "gla,window", "--mixer-option", "gla.chunk_size=8",
                             "--mixer-option", "window.window=3", "--eval-every", "0", "--out", path("run")},
                            log());
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_TRUE(ok.contains("pattern 'gla,window'")) << ok.output;
  const json used = load_json_file(path("run/train_config.json"));
  EXPECT_EQ(used["layer_pattern"], "gla,window");
  EXPECT_EQ(used["mixer_options"]["gla"]["chunk_size"], 8);
  const ModelConfig saved = load_checkpoint_config(latest_checkpoint(path("run")));
  EXPECT_EQ(saved.layer_pattern, "gla,window");
  EXPECT_EQ(saved.mixer_options["gla"]["chunk_size"], 8);
  EXPECT_EQ(saved.mixer_options["window"]["window"], 3);
  expect_cli_error({"train", "--config", cfg, "--mixer-option", "chunk_size=8"}, log(),
                   {"--mixer-option expects section.key=value"});
  expect_cli_error({"train", "--config", cfg, "--pattern", "gla", "--mixer-option", "gla.chunk_sise=8"}, log(),
                   {"chunk_sise"});
  expect_cli_error({"train", "--config", cfg, "--pattern", "glaa"}, log(), {"glaa"});
}

TEST_F(Cli, OtherCommandsRefuseBadNumbers) {
  const std::string ck = checkpoint();
  // Flags whose value was a sentinel (-1: unset) or wrapped into an unsigned.
  expect_cli_error({"generate", ck, "-n", "2", "--loops", "-1"}, log(), {"--loops must be in [1, 3]", "found -1"});
  expect_cli_error({"generate", ck, "-n", "2", "--seed", "-1"}, log(), {"--seed: must be >= 0, found -1"}, kValidationError);
  expect_cli_error({"eval", "ppl", ck, "--data", path("none.txt"), "--limit", "-1"}, log(),
                   {"--limit: must be >= 0, found -1"}, kValidationError);
  expect_cli_error({"bench", "prefill", "-m", "tiny-full", "--device", "cpu", "--dtype", "fp32", "-c", "64",
                    "--memory-limit-gb", "0"},
                   log(), {"--memory-limit-gb must be > 0, found 0"});
  expect_cli_error({"bench", "prefill", "-m", "tiny-full", "--device", "cpu", "--dtype", "fp32", "-c", "64",
                    "--profile", "-1"},
                   log(), {"--profile must be >= 0 (0: off), found -1"});
  write_file_atomic(path("text.txt"), std::string("some text for the tokenizer\n"));
  Tokenizer::byte_level({"<|endoftext|>"}).save(path("tokenizer.json"));
  expect_cli_error({"data", "prepare", "--input", path("text.txt"), "--tokenizer", path("tokenizer.json"), "--out",
                    path("data"), "--threads", "-1"},
                   log(), {"--threads must be >= 0 (0: all cores), got -1"});
  expect_cli_error({"tokenizer", "train", "--input", path("text.txt"), "--threads", "-3", "--out", path("t.json")}, log(),
                   {"threads must be >= 0 (0: all cores), got -3"});
  expect_cli_error({"tasks", "run", "--seed", "-5", "--out", path("tasks")}, log(), {"'seed' must be an integer in [0, "});
}

TEST_F(Cli, InfoChecksTheWeightsAgainstTheConfig) {
  const std::string ck = checkpoint();
  const CliRun ok = run_cli({"info", ck}, log());
  ASSERT_EQ(ok.code, 0) << ok.output;
  const auto n = module_tensors(*load_checkpoint(ck)).size();
  EXPECT_TRUE(ok.contains("weights          " + std::to_string(n) + " tensors match the config")) << ok.output;

  const std::string weights = ck + "/model.safetensors";
  const std::string good = read_file(weights);
  write_file_atomic(weights, good.substr(0, good.size() / 2));
  expect_cli_error({"info", ck}, log(), {weights, "truncated"});
  LoopedLM model(load_checkpoint_config(ck));
  auto tensors = module_tensors(*model);
  tensors["tok_embeddings.weight"] = torch::zeros({299, 32});
  save_safetensors(weights, tensors);
  expect_cli_error({"info", ck}, log(),
                   {"shape mismatch for key 'tok_embeddings.weight': expected [300, 32], found [299, 32]"});
  fs::remove(weights);
  expect_cli_error({"info", ck}, log(), {"neither model.safetensors nor model.safetensors.index.json"});
}

TEST_F(Cli, HuggingFaceConfigsNameTheFieldTheyNeed) {
  json ouro = {{"architectures", {"OuroForCausalLM"}}, {"model_type", "ouro"}, {"hidden_size", 32},
               {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
               {"vocab_size", 64}, {"total_ut_steps", 2.5}};
  fs::create_directories(path("ouro"));
  write_file_atomic(path("ouro/config.json"), ouro.dump());
  // 2.5 loops used to run 2.
  expect_cli_error({"info", path("ouro")}, log(), {"field 'total_ut_steps' must be an integer, found number 2.5"});
  ouro["total_ut_steps"] = 2;
  ouro.erase("model_type");
  write_file_atomic(path("ouro/config.json"), ouro.dump());
  expect_cli_error({"info", path("ouro")}, log(), {"no 'model_type'", "\"ouro\""});
}

// `lt2 distill`: the default config (configs/distill/default.json) with the flags over it reaches the
// stage's run folder; a preset teacher takes the shard's vocabulary; bad stages and --set are refused.
TEST_F(Cli, DistillFlagsOverTheDefaultConfig) {
  const std::string shard = write_pattern_shard(dir_ + "/data", 2000, 1);
  const CliRun ok = run_cli({"distill", "--teacher", "tiny-ouro", "--train-data", shard, "--device", "cpu",
                             "--batch-size", "2", "--align-steps", "2", "--align-seq-len", "16", "--set",
                             "train.eval_batches=1", "--set", "kd.other_lr=1e-5", "--stage", "align", "--out", path("d")},
                            log());
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_TRUE(ok.contains("student: " + path("d") + "/align/ckpt-2")) << ok.output;
  const json align = load_json_file(path("d/align/train_config.json"));
  EXPECT_EQ(align["steps"], 2);
  EXPECT_EQ(align["seq_len"], 16);
  EXPECT_EQ(align["batch_size"], 2);
  EXPECT_EQ(align["lr"], 1e-3);  // the default config's stage 1 rate
  EXPECT_EQ(load_json_file(path("d/distill_config.json"))["kd"]["other_lr"], 1e-5);
  expect_cli_error({"distill", "--teacher", "tiny-ouro", "--out", path("e"), "--stage", "distil"}, log(),
                   {"unknown stage 'distil'"});
  expect_cli_error({"distill", "--teacher", "tiny-ouro", "--out", path("e"), "--set", "lr=1"}, log(),
                   {"--set expects section.key=value"});
  expect_cli_error({"distill", "--teacher", "tiny-ouro", "--out", path("e"), "--set", "kd.learning_rate=1"}, log(),
                   {"learning_rate"});
}
