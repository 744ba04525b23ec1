// GPU (CTest label `gpu`): ops::sparse_attention_decode_fused, the fused sparse flash-decoding
// kernel, beyond its kernel-case rows (tests/gpu/kernel_cases_test.cpp): what it refuses, and,
// captured once in a CUDA graph and replayed with new counts, indices and queries (and gates, with
// DSA's output absorption folded into the combine), the eager call's output, within tolerance of
// float64. Skips where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <vector>

#include "common/testing.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;
using lt2::kernel_cases::random_selection;
using lt2::kernel_cases::sparse_inputs;
using lt2::kernel_cases::sparse_reference64;
using lt2::kernel_cases::SparseShape;

TEST(FusedSparseAttention, Unsupported) {
  REQUIRE_FUSED_DECODE();
  auto q = torch::randn({2, 4, 96}, gpu(torch::kBFloat16));
  auto k = torch::randn({2, 1, 10, 96}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_decode_supported(q, k, k));  // head dim 96
  auto q17 = torch::randn({1, 17, 64}, gpu(torch::kBFloat16));
  auto k17 = torch::randn({1, 1, 10, 64}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_decode_supported(q17, k17, k17));  // 17 query heads per kv head
  auto k_odd = torch::randn({1, 1, 10, 72}, gpu(torch::kBFloat16)).narrow(3, 4, 64);  // rows 8 bytes off
  auto q1 = torch::randn({1, 4, 64}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_decode_supported(q1, k_odd, k_odd));
  auto idx = torch::zeros({1, 4}, gpu(torch::kInt64)), cnt = torch::ones({1}, gpu(torch::kInt64));
  EXPECT_THROW(ops::sparse_attention_decode_fused(q1, k_odd, k_odd, idx, cnt, 1.0), lt2::Error);
  auto k1 = torch::randn({1, 1, 10, 64}, gpu(torch::kBFloat16));
  EXPECT_THROW(ops::sparse_attention_decode_fused(q1, k1, k1, idx.to(torch::kInt32), cnt, 1.0), lt2::Error);
  EXPECT_THROW(ops::sparse_attention_decode_fused(q1, k1, k1, idx, cnt.cpu(), 1.0), lt2::Error);
  // The folded absorption: absorb [Hq, Dy, Dv], gate [B, Hq, Dy], Dy <= 128, Dv a multiple of 64.
  auto absorb = torch::randn({4, 32, 64}, gpu(torch::kBFloat16));
  EXPECT_TRUE(ops::sparse_attention_absorb_supported(q1, k1, k1, absorb));
  EXPECT_FALSE(ops::sparse_attention_absorb_supported(q1, k1, k1, torch::randn({4, 129, 64}, gpu(torch::kBFloat16))));
  EXPECT_FALSE(ops::sparse_attention_absorb_supported(q1, k1, k1, absorb.transpose(1, 2).contiguous().transpose(1, 2)));
  EXPECT_THROW(ops::sparse_attention_decode_fused(q1, k1, k1, idx, cnt, 1.0, torch::randn({4, 32, 63}, gpu(torch::kBFloat16))),
               lt2::Error);
  EXPECT_THROW(ops::sparse_attention_decode_fused(q1, k1, k1, idx, cnt, 1.0, absorb, torch::randn({1, 4, 31}, gpu(torch::kBFloat16))),
               lt2::Error);
  EXPECT_THROW(ops::sparse_attention_decode_fused(q1, k1, k1, idx, cnt, 1.0, {}, torch::randn({1, 4, 32}, gpu(torch::kBFloat16))),
               lt2::Error);  // a gate without absorb
  auto q96 = torch::randn({1, 4, 96}, gpu(torch::kBFloat16)), k96 = torch::randn({1, 1, 10, 96}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_absorb_supported(q96, k96, k96, torch::randn({4, 32, 96}, gpu(torch::kBFloat16))));
}

#ifdef LT2_WITH_CUDA

// Captured once, replayed with new counts, indices and queries: equals the eager call.
TEST(FusedSparseAttention, GraphReplayWithNewSelection) {
  REQUIRE_FUSED_DECODE();
  const std::vector<std::pair<SparseShape, torch::ScalarType>> cases{
      {{3, 16, 1, 576, 512, 3000, 2048, true}, torch::kBFloat16},  // tensor-core form, 32 splits
      {{1, 16, 1, 576, 512, 3000, 2048, true}, torch::kFloat16},   // tensor-core form at batch 1
      {{8, 16, 1, 576, 512, 2100, 2048, true}, torch::kBFloat16},  // tensor-core form at batch 8
      {{2, 16, 1, 576, 512, 200, 40, true}, torch::kBFloat16},     // tensor-core form, one split
      {{2, 16, 16, 128, 128, 1000, 300, false}, torch::kFloat32}};
  for (const auto& [c, dt] : cases) {
    SCOPED_TRACE(::testing::Message() << dt << " Dk" << c.Dk << " Hkv" << c.Hkv);
    torch::manual_seed(11);
    auto in = sparse_inputs(c, dt);
    // Warm-up (reserves the kernel's shared memory), capture, replays and eager calls all on one
    // side stream (capture needs a non-default one).
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    auto out = ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    graph.capture_end();
    for (int replay = 0; replay < 3; ++replay) {
      auto [indices, counts] = random_selection(c.B, c.L, c.n);
      in.indices.copy_(indices);
      in.counts.copy_(counts.flip(0));  // the full list first, a count of 1 last
      if (c.B == 1) in.counts.fill_(c.n - 700 * replay);  // (random_selection's lone count is 1)
      in.q.copy_(torch::randn(in.q.sizes(), gpu(dt)));
      graph.replay();
      auto eager = ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale);
      torch::cuda::synchronize();
      EXPECT_TRUE(torch::equal(out, eager)) << "replay " << replay;
      EXPECT_LT(rel_err(out, sparse_reference64(in)), tolerance(dt)) << "replay " << replay;
    }
  }
}

// The folded absorption captured once, replayed with new selections, queries and gates: equals the
// eager call.
TEST(FusedSparseAttention, FoldedAbsorptionGraphReplay) {
  REQUIRE_FUSED_DECODE();
  const SparseShape c{8, 16, 1, 576, 512, 2100, 2048, true};
  torch::manual_seed(13);
  auto in = sparse_inputs(c, torch::kBFloat16);
  const auto absorb = torch::randn({c.Hq, 128, c.Dv}, gpu(torch::kBFloat16)) / std::sqrt(static_cast<double>(c.Dv));
  auto gate = torch::randn({c.B, c.Hq, 128}, gpu(torch::kBFloat16));
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  auto call = [&] { return ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale, absorb, gate); };
  call();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto y = call();
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    auto [indices, counts] = random_selection(c.B, c.L, c.n);
    in.indices.copy_(indices), in.counts.copy_(counts);
    in.q.copy_(torch::randn(in.q.sizes(), gpu(torch::kBFloat16)));
    gate.copy_(torch::randn_like(gate));
    graph.replay();
    auto eager = call();
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(y, eager)) << "replay " << replay;
    EXPECT_LT(rel_err(y, sparse_reference64(in, absorb, gate)), tolerance(torch::kBFloat16)) << "replay " << replay;
  }
}

#endif  // LT2_WITH_CUDA
