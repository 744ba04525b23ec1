// GPU (CTest label `gpu`): attention's fused decode prologue (ops/attention/decode.h:
// rope_cache_write) beyond its kernel-case rows (tests/gpu/kernel_cases_test.cpp): what it refuses,
// and a CUDA-graph replay with new positions against the unfused math in float64 (apply_rope at
// per-sequence positions, cache_write_at). Skips where no CUDA GPU (or no CUDA kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "lt2/ops/attention/decode.h"

using namespace lt2;
using torch::Tensor;
using namespace lt2::gpu_testing;
using lt2::kernel_cases::rope_cache_checks;
using lt2::kernel_cases::rope_cache_inputs;
using lt2::kernel_cases::rope_cache_reference;
using lt2::kernel_cases::RopeCacheShape;

TEST(FusedRopeCache, RejectsWhatItCannotTake) {
  REQUIRE_FUSED_DECODE();
  const RopeCacheShape c{2, 4, 2, 64, 8, RopeStyle::Half};
  auto in = rope_cache_inputs(c, torch::kBFloat16);
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
  const RopeCacheShape c{3, 8, 2, 128, 32, RopeStyle::Half};
  const auto dt = torch::kBFloat16;
  auto in = rope_cache_inputs(c, dt);
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
    const auto expected = rope_cache_reference(in, seq_pos, 1e4, c.style);
    graph.replay();
    torch::cuda::synchronize();
    for (const auto& check : rope_cache_checks(in, q_out, expected, dt))
      EXPECT_TRUE(check.passed) << "replay " << i << " " << check.what << ": " << check.detail;
  }
#endif
}
