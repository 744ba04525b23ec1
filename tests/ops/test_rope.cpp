// ops::apply_rope on the CPU is the nn/ reference (lt2::apply_rope), for every kind of positions,
// gradients included, and never takes the kernel; apply_rope_prefix_ rotates the first dims only;
// the switch `rope` parses and is recorded.
// The kernel itself is tested against the reference in tests/gpu/rope_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "lt2/nn/rope.h"
#include "lt2/ops/attention/rope.h"
#include "lt2/ops/decode_options.h"

namespace {

using lt2::Positions;
using lt2::RopeStyle;
using torch::Tensor;

TEST(OpsRope, CpuIsTheReference) {
  torch::manual_seed(5);
  const int64_t B = 2, T = 7, H = 3, D = 8;
  auto documents = Positions(0);
  documents.documents =
      std::make_shared<const lt2::PackedDocuments>(std::vector<std::vector<int64_t>>{{0, 3}, {0}}, T);
  for (auto dt : {torch::kFloat32, torch::kFloat64}) {
    for (auto style : {RopeStyle::Interleaved, RopeStyle::Half}) {
      // x as attention makes it: the head view of one part of a wider projection.
      const auto p = torch::randn({B, T, 3 * H * D}, dt).requires_grad_(true);
      const auto x = p.narrow(2, H * D, H * D).reshape({B, T, H, D});
      for (const auto& pos : {Positions(0), Positions(5), documents}) {
        EXPECT_FALSE(lt2::ops::rope_kernel_applies(x, pos));
        const auto w = torch::randn({B, T, H, D}, dt);
        const auto got = lt2::ops::apply_rope(x, pos, 1e4, style);
        const auto want = lt2::apply_rope(x, pos, 1e4, style);
        EXPECT_TRUE(torch::equal(got, want));
        const auto g_got = torch::autograd::grad({(got * w).sum()}, {p}, {}, /*retain_graph=*/true)[0];
        const auto g_want = torch::autograd::grad({(want * w).sum()}, {p})[0];
        EXPECT_TRUE(torch::equal(g_got, g_want));
      }
      const auto one = x.narrow(1, 0, 1).detach();
      const Positions seq_pos(0, 0, torch::tensor({4, 9}, torch::kLong));
      EXPECT_TRUE(
          torch::equal(lt2::ops::apply_rope(one, seq_pos, 1e4, style), lt2::apply_rope(one, seq_pos, 1e4, style)));
    }
  }
}

TEST(OpsRope, PrefixRotatesTheFirstDimsAndKeepsTheRest) {
  torch::manual_seed(6);
  const int64_t B = 2, T = 5, H = 3, D = 8;
  const Positions pos(3);
  for (auto style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    const auto x = torch::randn({B, T, H, D}, torch::kFloat64);
    const auto y = lt2::ops::apply_rope_prefix_(x, 4, pos, 1e4, style);
    EXPECT_TRUE(torch::allclose(y.narrow(-1, 0, 4), lt2::apply_rope(x.narrow(-1, 0, 4), pos, 1e4, style)));
    EXPECT_TRUE(torch::equal(y.narrow(-1, 4, 4), x.narrow(-1, 4, 4)));
    EXPECT_TRUE(torch::allclose(lt2::ops::apply_rope_prefix_(x, D, pos, 1e4, style), lt2::apply_rope(x, pos, 1e4, style)));
    EXPECT_EQ(lt2::ops::apply_rope_prefix_(x, 0, pos, 1e4, style).data_ptr(), x.data_ptr());
  }
  EXPECT_THROW(lt2::ops::apply_rope_prefix_(torch::randn({1, 2, 1, 8}), 3, pos, 1e4, RopeStyle::Half), std::exception);
}

TEST(OpsRope, SwitchParsesAndIsRecorded) {
  lt2::DecodeOptions o;
  EXPECT_TRUE(o.rope);
  o.set("rope", "0");
  EXPECT_FALSE(o.rope);
  const auto fields = o.describe();
  EXPECT_NE(std::find(fields.begin(), fields.end(), "rope=0"), fields.end());
  const auto& names = lt2::DecodeOptions::names();
  EXPECT_NE(std::find(names.begin(), names.end(), "rope"), names.end());
}

}  // namespace
