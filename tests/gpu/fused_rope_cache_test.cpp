// GPU (CTest label `gpu`): attention's fused decode prologue (ops/fused_decode.h: rope_cache_write)
// against the unfused math computed in float64 on the CPU (apply_rope at per-sequence positions,
// cache_write_at), fresh random inputs: MHA and GQA, both RoPE styles, positions up to 131k (where
// a float32 angle would be visibly off), q / k / v as strided views of one packed projection row,
// the caches checked whole (only the written rows change; a position past the cache writes none);
// a CUDA-graph replay with new positions == eager. Skips where no CUDA GPU (or no CUDA kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/mixers/full_attention.h"
#include "lt2/nn/rope.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct Case {
  int64_t B, H, Hkv, D, L;
  RopeStyle style;
};

// Views q [B, H, D], k, v [B, H_kv, D] of one packed [B, (H + 2 H_kv) D + 8] projection row (the
// 8 trailing columns stand for a gate part), and caches [B, H_kv, L, D] of random contents.
struct Inputs {
  Tensor packed, q, k, v, k_cache, v_cache;
};

Inputs make_inputs(const Case& c, torch::ScalarType dt) {
  Inputs in;
  const int64_t qd = c.H * c.D, kd = c.Hkv * c.D;
  in.packed = torch::randn({c.B, qd + 2 * kd + 8}, gpu(dt));
  in.q = in.packed.narrow(1, 0, qd).view({c.B, c.H, c.D});
  in.k = in.packed.narrow(1, qd, kd).view({c.B, c.Hkv, c.D});
  in.v = in.packed.narrow(1, qd + kd, kd).view({c.B, c.Hkv, c.D});
  in.k_cache = torch::randn({c.B, c.Hkv, c.L, c.D}, gpu(dt));
  in.v_cache = torch::randn({c.B, c.Hkv, c.L, c.D}, gpu(dt));
  return in;
}

// The unfused math in float64 on the CPU: q rotated, the caches with rows seq_pos[b] replaced.
struct Expected {
  Tensor q, k_cache, v_cache;
};

Expected reference(const Inputs& in, const Tensor& seq_pos, double theta, RopeStyle style) {
  auto f64 = [](const Tensor& t) { return t.cpu().to(torch::kFloat64); };
  const auto pos = seq_pos.cpu();
  const int64_t B = in.q.size(0), L = in.k_cache.size(2);
  auto q = apply_rope(f64(in.q).unsqueeze(1), pos.view({B, 1}), theta, style).squeeze(1);
  auto k = apply_rope(f64(in.k).unsqueeze(1), pos.view({B, 1}), theta, style).squeeze(1);
  auto k_cache = f64(in.k_cache), v_cache = f64(in.v_cache);
  const auto in_cache = (pos >= 0) & (pos < L);
  const auto b_in = torch::nonzero(in_cache).flatten();
  if (b_in.numel() > 0) {
    auto sub = [&](const Tensor& t) { return t.index_select(0, b_in); };
    auto kc = sub(k_cache), vc = sub(v_cache);
    cache_write_at(kc, sub(k).unsqueeze(2), sub(pos));
    cache_write_at(vc, sub(f64(in.v)).unsqueeze(2), sub(pos));
    k_cache.index_copy_(0, b_in, kc);
    v_cache.index_copy_(0, b_in, vc);
  }
  return {q, k_cache, v_cache};
}

void expect_matches(const Inputs& in, const Tensor& q_out, const Expected& e, torch::ScalarType dt,
                    const std::string& what) {
  EXPECT_LT(rel_err(q_out.cpu(), e.q), tolerance(dt)) << what << " q";
  // Rows not written are bit-identical copies, so the whole cache's error is that of the new rows.
  EXPECT_LT(rel_err(in.k_cache.cpu(), e.k_cache), tolerance(dt)) << what << " k_cache";
  EXPECT_LT(rel_err(in.v_cache.cpu(), e.v_cache), tolerance(dt)) << what << " v_cache";
}

}  // namespace

TEST(FusedRopeCache, MatchesFloat64) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  torch::manual_seed(21);
  const double theta = 10000.0;
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (Case c : {Case{3, 4, 4, 64, 40, RopeStyle::Interleaved}, Case{2, 16, 4, 128, 9, RopeStyle::Half},
                   Case{4, 6, 2, 32, 17, RopeStyle::Interleaved}, Case{1, 2, 1, 256, 5, RopeStyle::Half}}) {
      auto in = make_inputs(c, dt);
      // Positions in the cache, one past it (no row written) and, for q only, a long-context one.
      auto seq_pos = torch::randint(c.L, {c.B}, torch::TensorOptions().dtype(torch::kLong));
      seq_pos[0] = c.L;
      if (c.B > 2) seq_pos[2] = 131000;
      seq_pos = seq_pos.cuda();
      const auto expected = reference(in, seq_pos, theta, c.style);
      ASSERT_TRUE(ops::rope_cache_write_supported(in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos));
      auto q_out = ops::rope_cache_write(in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos, theta,
                                         c.style == RopeStyle::Interleaved);
      ASSERT_EQ(q_out.sizes(), in.q.sizes());
      expect_matches(in, q_out, expected, dt,
                     cat(name(dt), " B ", c.B, " H ", c.H, "/", c.Hkv, " D ", c.D, " style ",
                         c.style == RopeStyle::Interleaved ? "interleaved" : "half"));
    }
}

TEST(FusedRopeCache, RejectsWhatItCannotTake) {
  REQUIRE_FUSED_DECODE();
  const Case c{2, 4, 2, 64, 8, RopeStyle::Half};
  auto in = make_inputs(c, torch::kBFloat16);
  auto pos = torch::zeros({2}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
  EXPECT_FALSE(ops::rope_cache_write_supported(in.q, in.k, in.v, in.k_cache, in.v_cache, pos.to(torch::kInt32)));
  EXPECT_FALSE(ops::rope_cache_write_supported(in.q, in.k, in.v, in.k_cache.to(torch::kFloat32), in.v_cache, pos));
  EXPECT_FALSE(ops::rope_cache_write_supported(in.q.transpose(1, 2), in.k, in.v, in.k_cache, in.v_cache, pos));
  EXPECT_THROW(ops::rope_cache_write(in.q, in.k, in.v, in.k_cache, in.v_cache, pos.cpu(), 1e4, false), Error);
}

TEST(FusedRopeCache, GraphReplayWithNewPositionsEqualsEager) {
  REQUIRE_FUSED_DECODE();
#ifdef LT2_WITH_CUDA
  torch::NoGradGuard ng;
  torch::manual_seed(22);
  const Case c{3, 8, 2, 128, 32, RopeStyle::Half};
  const auto dt = torch::kBFloat16;
  auto in = make_inputs(c, dt);
  auto seq_pos = torch::zeros({c.B}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
  Tensor q_out;
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    ops::rope_cache_write(in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos, 1e4, false);  // warm-up
    torch::cuda::synchronize();
    graph.capture_begin();
    q_out = ops::rope_cache_write(in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos, 1e4, false);
    graph.capture_end();
  }
  for (int i = 0; i < 3; ++i) {
    in.packed.copy_(torch::randn_like(in.packed));
    seq_pos.copy_(torch::randint(c.L, {c.B}, torch::TensorOptions().dtype(torch::kLong)));
    const auto expected = reference(in, seq_pos, 1e4, c.style);
    graph.replay();
    torch::cuda::synchronize();
    expect_matches(in, q_out, expected, dt, cat("replay ", i));
  }
#endif
}
