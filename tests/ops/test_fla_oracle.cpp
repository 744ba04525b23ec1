// Independent oracle: flash-linear-attention's naive PyTorch references (tests/scripts/fla_oracle.py,
// run on the CPU) against lt2's float64 recurrences and chunked forms on the same inputs. fla's
// references compute in fp32, hence the fp32-level tolerance. Skipped, with the reason, where
// python3 cannot import fla.
#include "lt2/util/fs.h"
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "lt2/mixers/retnet.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "ops/numeric_check.h"

namespace {

using lt2::testing::rel_err;
using torch::Tensor;
namespace fs = std::filesystem;

constexpr double kFp32Tolerance = 2e-5;  // fla's fp32 references vs our float64

class FlaOracle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::temp_directory_path() / ("lt2_fla_oracle_" + std::to_string(::getpid()))).string();
    const std::string cmd = "python3 " LT2_SOURCE_DIR "/tests/scripts/fla_oracle.py " + dir_ + " 2>&1";
    std::string out;
    if (FILE* p = popen(cmd.c_str(), "r")) {
      char buf[512];
      while (fgets(buf, sizeof buf, p)) out += buf;
      status_ = pclose(p);
    }
    message_ = out;
  }
  static void TearDownTestSuite() { lt2::remove_tree(dir_); }

  void SetUp() override {
    torch::set_num_threads(1);
    if (status_ != 0)
      GTEST_SKIP() << "fla oracle unavailable (pip install flash-linear-attention): " << message_;
  }

  // The tensors of one case, as float64.
  static std::map<std::string, Tensor> load(const std::string& name) {
    std::ifstream f(dir_ + "/" + name + ".pt", std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::map<std::string, Tensor> out;
    for (const auto& kv : torch::pickle_load(bytes).toGenericDict())
      out[kv.key().toStringRef()] = kv.value().toTensor();
    return out;
  }

  static inline std::string dir_, message_;
  static inline int status_ = -1;
};

double scale_of(const Tensor& q) { return 1.0 / std::sqrt(static_cast<double>(q.size(-1))); }

// Our float64 recurrence and chunked form both agree with fla's reference output and state.
void expect_delta_matches(std::map<std::string, Tensor> c, const Tensor& g) {
  auto ref = lt2::ops::delta_rule_recurrent(c["q"], c["k"], c["v"], c["beta"], g, scale_of(c["q"]), c["h0"]);
  auto chk = lt2::ops::delta_rule_chunked(c["q"], c["k"], c["v"], c["beta"], g, scale_of(c["q"]), c["h0"], 16);
  EXPECT_LT(rel_err(ref.o, c["o"]), kFp32Tolerance);
  EXPECT_LT(rel_err(ref.final_state, c["ht"]), kFp32Tolerance);
  EXPECT_LT(rel_err(chk.o, c["o"]), kFp32Tolerance);
  EXPECT_LT(rel_err(chk.final_state, c["ht"]), kFp32Tolerance);
}

void expect_additive_matches(std::map<std::string, Tensor> c, const Tensor& g, const Tensor& h0) {
  auto ref = lt2::ops::gated_linear_recurrent(c["q"], c["k"], c["v"], g, scale_of(c["q"]), h0);
  auto chk = lt2::ops::gated_linear_chunked(c["q"], c["k"], c["v"], g, scale_of(c["q"]), h0, 16);
  EXPECT_LT(rel_err(ref.o, c["o"]), kFp32Tolerance);
  EXPECT_LT(rel_err(chk.o, c["o"]), kFp32Tolerance);
  if (c.count("ht")) {
    EXPECT_LT(rel_err(ref.final_state, c["ht"]), kFp32Tolerance);
    EXPECT_LT(rel_err(chk.final_state, c["ht"]), kFp32Tolerance);
  }
}

TEST_F(FlaOracle, GatedDeltaRule) {
  auto c = load("gated_delta_rule");
  expect_delta_matches(c, c["g"]);
}

TEST_F(FlaOracle, KdaWithGroupedValueHeads) {
  auto c = load("kda_gva");
  const int64_t groups = c["v"].size(2) / c["q"].size(2);
  c["q"] = c["q"].repeat_interleave(groups, 2);  // value head i reads q/k head i / groups
  c["k"] = c["k"].repeat_interleave(groups, 2);
  expect_delta_matches(c, c["g"]);
}

TEST_F(FlaOracle, DeltaRule) {
  auto c = load("delta_rule");
  expect_delta_matches(c, Tensor());
}

TEST_F(FlaOracle, GatedLinearAttention) {
  auto c = load("gla");
  expect_additive_matches(c, c["g"], c["h0"]);
}

TEST_F(FlaOracle, SimpleGla) {
  auto c = load("simple_gla");
  expect_additive_matches(c, c["g"], c["h0"]);
}

TEST_F(FlaOracle, Retention) {
  auto c = load("retention");
  const int64_t B = c["q"].size(0), T = c["q"].size(1), H = c["q"].size(2);
  auto g = lt2::retention_log_decay(H, torch::kFloat64, torch::kCPU).expand({B, T, H});
  expect_additive_matches(c, g, Tensor());
}

TEST_F(FlaOracle, LinearAttention) {
  auto c = load("linear_attn");
  expect_additive_matches(c, Tensor(), c["h0"]);
}

}  // namespace
