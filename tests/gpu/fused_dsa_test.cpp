// GPU (CTest label `gpu`): the fused DSA decode-selection kernels (ops/fused_dsa.h). Index scores
// against a float64 CPU reference (lightning_indexer_scores on the same, upcast inputs) at several
// shapes and dtypes, relative RMS error < 1e-5 in fp32 and < 5e-3 in bf16/fp16 over the valid
// entries, exactly -inf past each length, every element written; topk_select's set == topk_indices'
// set exactly on fp32 scores, tie-heavy rows included; dsa_index_topk == topk_select of the scores;
// a captured CUDA graph replayed with new lengths == eager. Skips where no CUDA GPU (or no CUDA
// kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "lt2/ops/fused_dsa.h"
#include "lt2/ops/sparse_attention.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

const auto f64 = torch::kFloat64;
const double kInf = std::numeric_limits<double>::infinity();

// Lengths in [1, L] on the GPU, different per sequence: the last sequence uses the whole cache
// and (B > 1) the first holds one key.
Tensor random_lengths(int64_t B, int64_t L) {
  auto lens = torch::randint(1, L + 1, {B}, torch::kInt64);
  if (B > 1) lens[0] = 1;
  lens[B - 1] = L;
  return lens.cuda();
}

// [B, L] bool: j < lens[b].
Tensor valid_mask(const Tensor& lens, int64_t L) {
  return torch::arange(L, lens.options()).unsqueeze(0) < lens.unsqueeze(1);
}

// The indexer inputs of one decode step: q [B, H, D], w [B, H] fp32, keys [B, L, D] with NaN in
// every slot at or past each length (a kernel that reads one poisons its sequence's scores). With
// `strided`, q and keys are views whose batch, head and row strides are not the packed ones.
struct IndexInputs {
  Tensor q, w, keys, lens;
};
IndexInputs index_inputs(int64_t B, int64_t H, int64_t D, int64_t L, torch::ScalarType dt, bool strided) {
  IndexInputs in;
  in.lens = random_lengths(B, L);
  in.q = strided ? torch::randn({B, H, D + 16}, gpu(dt)).narrow(2, 0, D) : torch::randn({B, H, D}, gpu(dt));
  in.w = torch::randn({B, H}, gpu(torch::kFloat32)) / std::sqrt(static_cast<double>(H * D));  // mixed signs
  auto keys = strided ? torch::randn({B, L + 5, 2 * D}, gpu(dt)).narrow(1, 2, L).narrow(2, 0, D)
                      : torch::randn({B, L, D}, gpu(dt));
  auto tail = ~valid_mask(in.lens, L).unsqueeze(2);  // [B, L, 1]
  keys.masked_fill_(tail, std::nan(""));
  in.keys = keys;
  return in;
}

// float64 on the CPU from the same (upcast) inputs: [B, L].
Tensor reference_scores(const IndexInputs& in) {
  auto q = in.q.to(torch::kCPU, f64).unsqueeze(1), w = in.w.to(torch::kCPU, f64).unsqueeze(1);
  return lightning_indexer_scores(q, w, in.keys.to(torch::kCPU, f64)).squeeze(1);
}

// Row b of a and b hold the same indices (in any order).
void expect_same_sets(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = std::get<0>(got.cpu().sort(-1)), w = std::get<0>(want.cpu().sort(-1));
  for (int64_t b = 0; b < got.size(0); ++b)
    EXPECT_TRUE(torch::equal(g[b], w[b])) << what << ", row " << b;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// dsa_index_scores == lightning_indexer_scores (float64), -inf past the lengths.

TEST(FusedDsa, IndexScoresMatchReference) {
  REQUIRE_FUSED_DECODE();
  struct Shape {
    int64_t B, H, D, L;
    bool strided;
  };
  // The 1.3B indexer (64 x 128) at short and long caches (40000: several key tiles per block),
  // H 16 and 128, D 64 and 256; D 80 (a 16-wide last k-step), H 24 / D 72 (bf16 on the FMA
  // kernel); L 1 and lengths off every tile size.
  const std::vector<Shape> shapes{{1, 64, 128, 100, false},  {3, 64, 128, 5000, true}, {8, 16, 64, 300, false},
                                  {3, 16, 128, 4500, true},  {8, 64, 64, 1000, false}, {3, 64, 128, 40000, false},
                                  {2, 128, 256, 700, true},  {2, 32, 80, 333, false},  {3, 24, 72, 200, true},
                                  {1, 64, 128, 1, false},    {3, 16, 128, 77, false}};
  for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (const auto& s : shapes) {
      SCOPED_TRACE(::testing::Message() << name(dt) << " B" << s.B << " H" << s.H << " D" << s.D << " L" << s.L
                                      << (s.strided ? " strided" : ""));
      torch::manual_seed(s.B * 1000 + s.H + s.D + s.L);
      const auto in = index_inputs(s.B, s.H, s.D, s.L, dt, s.strided);
      auto out = torch::full({s.B, s.L}, std::nan(""), gpu(torch::kFloat32));  // every element must be written
      auto scores = ops::dsa_index_scores(in.q, in.w, in.keys, in.lens, out);
      EXPECT_EQ(scores.data_ptr(), out.data_ptr());
      const auto valid = valid_mask(in.lens, s.L).cpu();
      const auto got = scores.cpu().to(f64), ref = reference_scores(in);
      EXPECT_FALSE(torch::isnan(got).any().item<bool>()) << "an element is unwritten or read a key past its length";
      // The head weights have mixed signs, so a score can be a near-cancelling sum; its rounding
      // error scales with the sum of the terms' magnitudes, which is what the error is measured
      // against (sum_h |w_h| ReLU(q_h . k), float64).
      auto magnitude_in = in;
      magnitude_in.w = in.w.abs();
      const auto magnitude = reference_scores(magnitude_in).masked_select(valid);
      const auto err = (got.masked_select(valid) - ref.masked_select(valid)).norm().item<double>() /
                       std::max(magnitude.norm().item<double>(), 1e-300);
      EXPECT_LT(err, tolerance(dt));
      EXPECT_TRUE((got.masked_select(~valid) == -kInf).all().item<bool>()) << "entries past the length";
    }
}

// ---------------------------------------------------------------------------------------------
// topk_select == topk_indices as sets, exactly.

namespace {

// [6, L] fp32 rows of the kinds top-k gets wrong: distinct scores, heavy ties (rounded scores),
// all equal, many exact zeros (with -0 among them), mostly -inf, all -inf.
Tensor tie_heavy_rows(int64_t L) {
  auto opts = gpu(torch::kFloat32);
  auto distinct = torch::randn({L}, opts);
  auto rounded = torch::round(torch::randn({L}, opts) * 3);
  auto equal = torch::full({L}, 0.5, opts);
  auto zeros = torch::relu(torch::randn({L}, opts));
  zeros = torch::where(torch::rand({L}, opts) < 0.3, torch::full({L}, -0.0, opts), zeros);
  auto mostly_inf = torch::randn({L}, opts).masked_fill(torch::rand({L}, opts) < 0.9, -kInf);
  auto all_inf = torch::full({L}, -kInf, opts);
  return torch::stack({distinct, rounded, equal, zeros, mostly_inf, all_inf});
}

std::vector<int64_t> ks_for(int64_t L) {
  std::vector<int64_t> ks{1, std::min<int64_t>(3, L), std::min<int64_t>(2048, L), L / 2 + 1, L};
  return ks;
}

}  // namespace

TEST(FusedDsa, TopkSelectMatchesTopkIndices) {
  REQUIRE_FUSED_DECODE();
  // One block (L <= 4096), clusters of 2, 5 and 8 blocks; 131072: 8 slices of 16384 entries, all
  // cached in shared memory; 200000: the rest of every slice re-read from global memory.
  for (int64_t L : {1, 7, 100, 4096, 5000, 20000, 40000, 131072, 200000}) {
    torch::manual_seed(L);
    const auto scores = tie_heavy_rows(L);
    const auto all = torch::ones_like(scores, torch::kBool);
    for (int64_t k : ks_for(L)) {
      SCOPED_TRACE(::testing::Message() << "L" << L << " k" << k);
      auto out = torch::full({scores.size(0), k}, -1, gpu(torch::kInt64));
      auto idx = ops::topk_select(scores, k, Tensor(), out);
      EXPECT_EQ(idx.data_ptr(), out.data_ptr());
      expect_same_sets(idx, topk_indices(scores, all, k), "no lengths");
    }
  }
}

// With seq_lens, entries past a length are never read (NaN and +inf there) and rank as -inf.
TEST(FusedDsa, TopkSelectWithLengths) {
  REQUIRE_FUSED_DECODE();
  for (int64_t L : {100, 5000, 40000, 200000}) {
    torch::manual_seed(L + 1);
    auto scores = tie_heavy_rows(L);
    const int64_t B = scores.size(0);
    auto lens = random_lengths(B, L);
    lens[1] = std::min<int64_t>(L, 30);  // shorter than most k
    const auto valid = valid_mask(lens, L);
    auto garbage = torch::where(torch::rand({B, L}, gpu(torch::kFloat32)) < 0.5,
                                torch::full({B, L}, std::nan(""), gpu(torch::kFloat32)),
                                torch::full({B, L}, kInf, gpu(torch::kFloat32)));
    scores = torch::where(valid, scores, garbage);
    const auto lens_cpu = lens.cpu();
    for (int64_t k : ks_for(L)) {
      SCOPED_TRACE(::testing::Message() << "L" << L << " k" << k);
      auto idx = ops::topk_select(scores, k, lens);
      expect_same_sets(idx, topk_indices(scores, valid, k), "with lengths");
      const auto idx_cpu = idx.cpu();
      for (int64_t b = 0; b < B; ++b) {  // the valid entries first
        const int64_t len = lens_cpu[b].item<int64_t>(), n = std::min(len, k);
        EXPECT_TRUE((idx_cpu[b].narrow(0, 0, n) < len).all().item<bool>()) << "row " << b;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dsa_index_topk == topk_select(dsa_index_scores) == topk_indices of those scores.

TEST(FusedDsa, IndexTopkMatchesSelectionOfScores) {
  REQUIRE_FUSED_DECODE();
  struct Shape {
    int64_t B, H, D, L, k;
  };
  const std::vector<Shape> shapes{{8, 64, 128, 5000, 2048}, {3, 16, 64, 300, 64}, {2, 64, 128, 33000, 2048},
                                  {3, 64, 128, 100, 100}};
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (const auto& s : shapes) {
      SCOPED_TRACE(::testing::Message() << name(dt) << " B" << s.B << " H" << s.H << " D" << s.D << " L" << s.L
                                      << " k" << s.k);
      torch::manual_seed(s.B + s.L + s.k);
      auto in = index_inputs(s.B, s.H, s.D, s.L, dt, false);
      ASSERT_TRUE(ops::dsa_index_topk_supported(in.q, in.keys, s.k));
      auto idx = ops::dsa_index_topk(in.q, in.w, in.keys, in.lens, s.k);
      auto scores = ops::dsa_index_scores(in.q, in.w, in.keys, in.lens);
      EXPECT_TRUE(torch::equal(idx, ops::topk_select(scores, s.k, in.lens)));
      expect_same_sets(idx, topk_indices(scores, valid_mask(in.lens, s.L), s.k), "against topk_indices");
    }
}

TEST(FusedDsa, RejectsBadInputs) {
  REQUIRE_FUSED_DECODE();
  auto in = index_inputs(2, 16, 64, 50, torch::kBFloat16, false);
  EXPECT_THROW(ops::dsa_index_scores(in.q, in.w, in.keys.to(torch::kFloat32), in.lens), Error);  // dtypes differ
  EXPECT_THROW(ops::dsa_index_scores(in.q, in.w, in.keys, in.lens.to(torch::kInt32)), Error);
  EXPECT_THROW(ops::dsa_index_scores(in.q.cpu(), in.w, in.keys, in.lens), Error);
  EXPECT_THROW(ops::dsa_index_scores(torch::randn({2, 200, 64}, gpu(torch::kBFloat16)), torch::randn({2, 200}, gpu(torch::kFloat32)),
                                     in.keys, in.lens),
               Error);  // more heads than the kernels take
  auto scores = torch::randn({2, 50}, gpu(torch::kFloat32));
  EXPECT_THROW(ops::topk_select(scores, 51), Error);
  EXPECT_THROW(ops::topk_select(scores, 0), Error);
  EXPECT_THROW(ops::topk_select(scores.to(torch::kBFloat16), 5), Error);
  EXPECT_FALSE(ops::dsa_index_topk_supported(in.q, in.keys, 51));
}

#ifdef LT2_WITH_CUDA

// Captured once, replayed with new lengths and queries: equals the eager calls.
TEST(FusedDsa, GraphReplayWithNewLengths) {
  REQUIRE_FUSED_DECODE();
  const int64_t B = 4, H = 64, D = 128, L = 6000, k = 2048;
  torch::manual_seed(7);
  auto in = index_inputs(B, H, D, L, torch::kBFloat16, false);
  in.keys = torch::randn({B, L, D}, gpu(torch::kBFloat16));  // no poison: every length is replayed
  // Warm-up, capture, replays and eager calls all on one side stream (capture needs a non-default one).
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  auto call = [&] {
    auto scores = ops::dsa_index_scores(in.q, in.w, in.keys, in.lens);
    return std::make_pair(scores, ops::topk_select(scores, k, in.lens));
  };
  call();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto [scores, idx] = call();
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    in.lens.copy_(random_lengths(B, L).flip(0));  // new lengths, the full-cache one first
    in.q.copy_(torch::randn({B, H, D}, gpu(torch::kBFloat16)));
    graph.replay();
    auto [eager_scores, eager_idx] = call();
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(scores, eager_scores)) << "replay " << replay;
    EXPECT_TRUE(torch::equal(idx, eager_idx)) << "replay " << replay;
    EXPECT_TRUE(torch::equal(idx, ops::dsa_index_topk(in.q, in.w, in.keys, in.lens, k))) << "replay " << replay;
  }
}

#endif
