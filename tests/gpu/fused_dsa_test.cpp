// GPU (CTest label `gpu`): the fused DSA decode-selection kernels (ops/sparse_attention/dsa_decode.h). Index scores
// against a float64 CPU reference (lightning_indexer_scores on the same, upcast inputs) at several
// shapes and dtypes, relative RMS error < 1e-5 in fp32 and < 5e-3 in bf16/fp16 over the valid
// entries, exactly -inf past each length, every element written; topk_select's set == topk_indices'
// set exactly on fp32 scores, tie-heavy rows included; dsa_index_topk == topk_select of the scores;
// a captured CUDA graph replayed with new lengths == eager. dsa_latent_prep against its float64
// reference (ops::dsa_latent_prep_reference) at several shapes, dtypes and RoPE styles, eagerly and
// replayed from a graph with new positions, with the q absorption folded in (against the reference
// and the prep + gemv_batched path); the latent DSA mixer's fused decode step (step and
// step_residual) as accurate as its libtorch path, folded == unfolded. Skips where no CUDA GPU (or no CUDA kernels)
// is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "lt2/mixers/dsa.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/projections/gemv.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/util/error.h"

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
  // One block (L <= 4096), clusters of 2, 5 and 8 blocks; with the portable cap, 131072: 8 slices
  // of 16384 entries, all cached in shared memory; 200000: the rest of every slice re-read from
  // global memory. Uncapped (where the device places 16-block clusters): 10 and 16 blocks.
  for (int cap : {8, 16}) {
    FusedDecode capped(true);
    capped.options.topk_max_blocks = cap;
    for (int64_t L : {1, 7, 100, 4096, 5000, 20000, 40000, 131072, 200000}) {
      torch::manual_seed(L);
      const auto scores = tie_heavy_rows(L);
      const auto all = torch::ones_like(scores, torch::kBool);
      for (int64_t k : ks_for(L)) {
        SCOPED_TRACE(::testing::Message() << "cap " << cap << " L" << L << " k" << k);
        auto out = torch::full({scores.size(0), k}, -1, gpu(torch::kInt64));
        auto idx = ops::topk_select(scores, k, Tensor(), out);
        EXPECT_EQ(idx.data_ptr(), out.data_ptr());
        expect_same_sets(idx, topk_indices(scores, all, k), "no lengths");
      }
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

// ---------------------------------------------------------------------------------------------
// dsa_latent_prep == dsa_latent_prep_reference (float64).

namespace {

struct PrepShape {
  int64_t B, H, D, dc, dr, HI, dI, r, L;
  RopeStyle style;
  double theta;
  int64_t topk = 4;
};

std::string describe(const PrepShape& s) {
  return cat("B", s.B, " H", s.H, " D", s.D, " dc", s.dc, " dr", s.dr, " HI", s.HI, " dI", s.dI, " r", s.r, " L", s.L,
             s.style == RopeStyle::Half ? " half" : " interleaved", " theta ", s.theta);
}

// Positions in [0, L) (B <= L), the last slot among them.
Tensor random_positions(int64_t B, int64_t L) {
  auto pos = torch::randperm(L, torch::kInt64).narrow(0, 0, B).clone();
  pos[0] = L - 1;
  return pos.cuda();
}

// The inputs as views of one packed projection output with padded rows (batch strides not the
// packed ones), the outputs NaN (q, index_q, index_w: an unwritten element shows) and the caches
// random strided views (rows the kernel must leave alone).
ops::DsaLatentPrepArgs prep_inputs(const PrepShape& s, torch::ScalarType dt) {
  const int64_t nq = s.H * (s.D + s.dr), nkv = s.dc + s.dr, niq = s.HI * s.dI;
  const auto proj = torch::randn({s.B, nq + nkv + niq + s.dI + s.HI + 8}, gpu(dt));
  ops::DsaLatentPrepArgs a;
  a.q_raw = proj.narrow(1, 0, nq).view({s.B, s.H, s.D + s.dr});
  a.kv_raw = proj.narrow(1, nq, nkv);
  a.index_q_raw = proj.narrow(1, nq + nkv, niq).view({s.B, s.HI, s.dI});
  a.index_k_raw = proj.narrow(1, nq + nkv + niq, s.dI);
  a.index_w_raw = proj.narrow(1, nq + nkv + niq + s.dI, s.HI);
  a.seq_pos = random_positions(s.B, s.L);
  a.kv_norm_weight = 1 + 0.2 * torch::randn({s.dc}, gpu(dt));
  a.index_norm_weight = 1 + 0.2 * torch::randn({s.dI}, gpu(dt));
  a.index_norm_bias = 0.2 * torch::randn({s.dI}, gpu(dt));
  a.kv_norm_eps = 1e-6, a.index_norm_eps = 1e-6;
  a.rope_theta = s.theta, a.rope_style = s.style, a.index_rope_dim = s.r;
  a.index_weight_scale = 1.0 / std::sqrt(static_cast<double>(s.HI * s.dI)), a.topk = s.topk;
  a.seq_lens = torch::full({s.B}, -1, gpu(torch::kInt64)), a.counts = torch::full({s.B}, -1, gpu(torch::kInt64));
  a.q = torch::full({s.B, s.H, s.dc + s.dr}, std::nan(""), gpu(dt));
  a.index_q = torch::full({s.B, s.HI, s.dI}, std::nan(""), gpu(dt));
  a.index_w = torch::full({s.B, s.HI}, std::nan(""), gpu(torch::kFloat32));
  a.k_cache = torch::randn({s.B, 1, s.L + 3, s.dc + s.dr + 8}, gpu(dt)).narrow(2, 1, s.L).narrow(3, 0, s.dc + s.dr);
  a.index_keys = torch::randn({s.B, s.L + 2, s.dI + 8}, gpu(dt)).narrow(1, 2, s.L).narrow(2, 0, s.dI);
  return a;
}

// The same inputs with fresh copies of the outputs and the caches (the reference writes them).
ops::DsaLatentPrepArgs with_output_copies(ops::DsaLatentPrepArgs a) {
  a.q = a.q.clone(), a.index_q = a.index_q.clone(), a.index_w = a.index_w.clone();
  a.seq_lens = a.seq_lens.clone(), a.counts = a.counts.clone();
  a.k_cache = a.k_cache.clone(), a.index_keys = a.index_keys.clone();
  return a;
}

// got (the kernel's outputs) against want (the reference's): the written values within tol, the
// latent part of q the absorbed q_nope W_uk with `absorb`, else unwritten, and every cache row but
// the one at each position unchanged.
void expect_prep_matches(const ops::DsaLatentPrepArgs& got, const ops::DsaLatentPrepArgs& want, double tol) {
  const int64_t dc = got.kv_norm_weight.size(0), dr = got.q.size(2) - dc, B = got.q.size(0);
  EXPECT_LT(rel_err(got.q.narrow(-1, dc, dr).cpu(), want.q.narrow(-1, dc, dr).cpu()), tol) << "q";
  if (got.absorb.defined())
    EXPECT_LT(rel_err(got.q.narrow(-1, 0, dc).cpu(), want.q.narrow(-1, 0, dc).cpu()), tol) << "q's latent part";
  else
    EXPECT_TRUE(torch::isnan(got.q.narrow(-1, 0, dc)).all().item<bool>()) << "q's latent part was written";
  EXPECT_LT(rel_err(got.index_q.cpu(), want.index_q.cpu()), tol) << "index_q";
  EXPECT_LT(rel_err(got.index_w.cpu(), want.index_w.cpu()), tol) << "index_w";
  EXPECT_TRUE(torch::equal(got.seq_lens.cpu(), want.seq_lens.cpu())) << "seq_lens";
  EXPECT_TRUE(torch::equal(got.counts.cpu(), want.counts.cpu())) << "counts";
  auto k_got = got.k_cache.cpu().to(f64).clone(), k_want = want.k_cache.cpu().to(f64).clone();
  auto i_got = got.index_keys.cpu().to(f64).clone(), i_want = want.index_keys.cpu().to(f64).clone();
  const auto pos = got.seq_pos.cpu();
  std::vector<Tensor> k_rows_got, k_rows_want, i_rows_got, i_rows_want;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = pos[b].item<int64_t>();
    k_rows_got.push_back(k_got[b][0][t].clone()), k_rows_want.push_back(k_want[b][0][t].clone());
    i_rows_got.push_back(i_got[b][t].clone()), i_rows_want.push_back(i_want[b][t].clone());
    k_got[b][0][t].zero_(), k_want[b][0][t].zero_(), i_got[b][t].zero_(), i_want[b][t].zero_();
  }
  EXPECT_LT(rel_err(torch::stack(k_rows_got), torch::stack(k_rows_want)), tol) << "latent key rows";
  EXPECT_LT(rel_err(torch::stack(i_rows_got), torch::stack(i_rows_want)), tol) << "index key rows";
  EXPECT_TRUE(torch::equal(k_got, k_want)) << "a latent cache row off the positions changed";
  EXPECT_TRUE(torch::equal(i_got, i_want)) << "an index cache row off the positions changed";
}

const std::vector<PrepShape>& prep_shapes() {
  static const std::vector<PrepShape> shapes{
      {8, 16, 128, 512, 64, 64, 128, 64, 300, RopeStyle::Interleaved, 10000.0, 100},  // lt2-gdn-dsa-1.3b
      {8, 16, 128, 512, 64, 64, 128, 64, 40000, RopeStyle::Half, 500000.0, 2048},     // long positions
      {3, 2, 64, 32, 8, 2, 16, 8, 40, RopeStyle::Half, 10000.0},                 // the engine tests' small DSA
      {1, 5, 24, 40, 6, 3, 200, 10, 17, RopeStyle::Interleaved, 10000.0},        // odd dims, d_I > 128 threads
      {2, 3, 16, 8, 2, 1, 8, 0, 5, RopeStyle::Half, 10000.0}};                   // no index RoPE
  return shapes;
}

}  // namespace

TEST(FusedDsa, LatentPrepMatchesReference) {
  REQUIRE_FUSED_DECODE();
  for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (const auto& s : prep_shapes()) {
      SCOPED_TRACE(cat(name(dt), " ", describe(s)));
      torch::manual_seed(s.B + s.H + s.dI + s.L);
      const auto got = prep_inputs(s, dt);
      const auto want = with_output_copies(got);
      ops::dsa_latent_prep(got);
      ops::dsa_latent_prep_reference(want);
      expect_prep_matches(got, want, tolerance(dt));
    }
}

// The q absorption folded into the prep (absorb = W_uk transposed, [H, d_c, D]) against the
// float64 reference and against the unfolded path (the prep, then gemv_batched where it applies).
TEST(FusedDsa, LatentPrepFoldsQAbsorption) {
  REQUIRE_FUSED_DECODE();
  const auto& one_three_b = prep_shapes()[0];
  auto at_batch = [&](int64_t B) {
    auto s = one_three_b;
    s.B = B;
    return s;
  };
  const std::vector<PrepShape> shapes{
      at_batch(1), at_batch(8),  // lt2-gdn-dsa-1.3b: 128 units of 64 columns
      at_batch(32),              // four passes of 8 sequences
      {3, 5, 24, 40, 6, 3, 200, 10, 17, RopeStyle::Interleaved, 10000.0},  // odd: a 40-column unit, D = 24
      {2, 3, 16, 8, 2, 1, 8, 0, 5, RopeStyle::Half, 10000.0}};              // 8 columns, one chunk a half (fp32: two)
  for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (const auto& s : shapes) {
      SCOPED_TRACE(cat(name(dt), " ", describe(s)));
      torch::manual_seed(3 * s.B + s.H + s.dc);
      auto got = prep_inputs(s, dt);
      got.absorb = (torch::randn({s.H, s.dc, s.D}, gpu(torch::kFloat32)) / std::sqrt(static_cast<double>(s.D))).to(dt);
      ASSERT_TRUE(ops::dsa_latent_prep_absorb_supported(got.q_raw, got.q, got.absorb));
      const auto want = with_output_copies(got);
      auto unfolded = with_output_copies(got);
      unfolded.absorb = Tensor();
      ops::dsa_latent_prep(got);
      ops::dsa_latent_prep_reference(want);
      expect_prep_matches(got, want, tolerance(dt));
      const auto q_nope = got.q_raw.narrow(-1, 0, s.D), latent = unfolded.q.narrow(-1, 0, s.dc);
      if (ops::gemv_batched_applies(q_nope, got.absorb)) {
        ops::dsa_latent_prep(unfolded);
        ops::gemv_batched(q_nope, got.absorb, latent);
        EXPECT_LT(rel_err(got.q.cpu(), unfolded.q.cpu()), tolerance(dt)) << "against the unfolded path";
      }
    }
}

TEST(FusedDsa, LatentPrepRejectsBadInputs) {
  REQUIRE_FUSED_DECODE();
  const PrepShape s{2, 2, 64, 32, 8, 2, 16, 8, 10, RopeStyle::Half, 10000.0};
  auto a = prep_inputs(s, torch::kBFloat16);
  auto bad = a;
  bad.index_w = a.index_w.to(torch::kBFloat16);  // index_w must be fp32
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  bad = a;
  bad.k_cache = a.k_cache.to(torch::kFloat32);  // the caches in the activation dtype
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  bad = a;
  bad.seq_pos = a.seq_pos.to(torch::kInt32);
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  bad = a;
  bad.index_rope_dim = 7;
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  bad = a;
  bad.q = torch::empty({2, 2, 41}, gpu(torch::kBFloat16));  // d_c + d_r is 40
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  bad = a;
  bad.absorb = torch::randn({2, 32, 63}, gpu(torch::kBFloat16));  // D is 64
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  bad.absorb = torch::randn({2, 64, 32}, gpu(torch::kBFloat16)).transpose(1, 2);  // not contiguous
  EXPECT_FALSE(ops::dsa_latent_prep_absorb_supported(bad.q_raw, bad.q, bad.absorb));
  EXPECT_THROW(ops::dsa_latent_prep(bad), Error);
  auto wide = prep_inputs({33, 2, 64, 32, 8, 2, 16, 8, 40, RopeStyle::Half, 10000.0}, torch::kBFloat16);
  EXPECT_FALSE(ops::dsa_latent_prep_absorb_supported(wide.q_raw, wide.q, torch::randn({2, 32, 64}, gpu(torch::kBFloat16))))
      << "33 sequences";
}

#ifdef LT2_WITH_CUDA

// Captured once (the q absorption folded in), replayed with new positions and projections: equals
// the reference each time.
TEST(FusedDsa, LatentPrepGraphReplayWithNewPositions) {
  REQUIRE_FUSED_DECODE();
  const auto& s = prep_shapes()[0];
  torch::manual_seed(11);
  auto a = prep_inputs(s, torch::kBFloat16);
  a.absorb = torch::randn({s.H, s.dc, s.D}, gpu(torch::kBFloat16)) / std::sqrt(static_cast<double>(s.D));
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  ops::dsa_latent_prep(a);  // warm-up
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  ops::dsa_latent_prep(a);
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(cat("replay ", replay));
    a.seq_pos.copy_(random_positions(s.B, s.L));
    for (const auto& t : {a.q_raw, a.kv_raw, a.index_q_raw, a.index_k_raw, a.index_w_raw}) t.copy_(torch::randn_like(t));
    a.q.fill_(std::nan("")), a.index_q.fill_(std::nan("")), a.index_w.fill_(std::nan(""));
    a.seq_lens.fill_(-1), a.counts.fill_(-1);
    const auto want = with_output_copies(a);  // the caches before this replay
    graph.replay();
    ops::dsa_latent_prep_reference(want);
    torch::cuda::synchronize();
    expect_prep_matches(a, want, tolerance(torch::kBFloat16));
  }
}

#endif

// ---------------------------------------------------------------------------------------------
// The latent DSA mixer's fused decode step (packed input GEMV, dsa_latent_prep, absorptions, index
// top-k, sparse attention, gate, wo) against its libtorch path, both measured against a float64
// CPU copy of the same weights, and with the absorptions folded (DecodeOptions::dsa_fold_{q,o}_max_rows 32)
// against unfolded (0). The top-k (32) covers every valid key, so bf16 rounding cannot
// flip the selection between the paths.

namespace {

std::shared_ptr<DSAImpl> make_latent_dsa(RopeStyle style, torch::ScalarType dt, torch::Device device) {
  auto cfg = lt2::testing::tiny_config("dsa");
  cfg.d_model = 256, cfg.n_heads = 4, cfg.head_dim = 64, cfg.n_kv_heads = 4;
  cfg.rope_style = style;
  cfg.attn_output_gate = true;
  cfg.mixer_options["dsa"] = json{{"topk", 32}, {"index_heads", 16}, {"index_head_dim", 64}, {"attention", "latent"},
                                  {"latent_dim", 512}, {"latent_rope_dim", 64}};
  torch::manual_seed(21);  // the same weights for every dtype and device
  auto m = std::dynamic_pointer_cast<DSAImpl>(make_mixer("dsa", cfg, 0));
  torch::NoGradGuard ng;
  m->wgate->weight.normal_(0, 0.3);  // zero-initialised: the gate would be a constant 1/2
  m->to(device, dt);
  m->pack_for_inference();
  return m;
}

}  // namespace

TEST(FusedDsa, LatentDecodeStepAsAccurateAsReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  FusedDecode options(true);
  torch::NoGradGuard ng;
  const int64_t B = 3, L = 48;
  for (auto style : {RopeStyle::Interleaved, RopeStyle::Half})
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(cat(name(dt), style == RopeStyle::Half ? " half" : " interleaved"));
      auto m = make_latent_dsa(style, dt, torch::kCUDA);
      auto exact = make_latent_dsa(style, torch::kFloat64, torch::kCPU);
      torch::manual_seed(5);
      auto state = m->make_state(B, L, gpu(dt));
      auto& s = dynamic_cast<DSAState&>(*state);
      s.k.normal_(), s.index_keys.normal_();
      auto x = torch::randn({B, 1, 256}, gpu(dt));
      auto norm_weight = 1 + 0.2 * torch::randn({256}, gpu(dt));
      const Positions pos(0, 0, torch::tensor({5L, 31L, 0L}).cuda());  // lengths <= top-k
      const auto run = [&](MixerImpl& mixer, DSAState& st, const Tensor& in, bool fused, bool residual) {
        options.options.fused = fused;
        const Positions p(0, 0, pos.seq_pos.to(in.device()));
        if (!residual) return mixer.step(in, p, st);
        const double eps = 1e-5;
        auto h = fused ? mixer.step_residual(in, norm_weight.to(in.device(), in.scalar_type()), eps, p, st) : Tensor();
        EXPECT_EQ(h.defined(), fused) << "step_residual takes the fused path exactly when it is on";
        return h.defined() ? h : in + mixer.step(rms_norm(in, norm_weight.to(in.device(), in.scalar_type()), eps), p, st);
      };
      for (bool residual : {false, true}) {
        SCOPED_TRACE(residual ? "step_residual" : "step");
        auto copy = [](const DSAState& from, torch::Device d, torch::ScalarType t) {
          auto c = std::make_unique<DSAState>();
          c->k = from.k.to(d, t).clone(), c->index_keys = from.index_keys.to(d, t).clone(), c->topk = from.topk;
          return c;
        };
        auto s_fused = copy(s, torch::kCUDA, dt), s_ref = copy(s, torch::kCUDA, dt);
        auto s_exact = copy(s, torch::kCPU, torch::kFloat64);
        const auto set_folds = [&](int64_t rows) {
          options.options.dsa_fold_q_max_rows = options.options.dsa_fold_o_max_rows = rows;
        };
        set_folds(32);  // the absorptions folded
        auto y_fused = run(*m, *s_fused, x, true, residual).cpu();
        set_folds(0);  // the absorptions as batched GEMVs
        auto s_unfolded = copy(s, torch::kCUDA, dt);
        auto y_unfolded = run(*m, *s_unfolded, x, true, residual).cpu();
        set_folds(1);
        EXPECT_LT(rel_err(y_fused, y_unfolded), tolerance(dt)) << "folded against unfolded absorptions";
        auto y_ref = run(*m, *s_ref, x, false, residual).cpu();
        auto y_exact = run(*exact, *s_exact, x.cpu().to(f64), false, residual);
        const double ref_err = rel_err(y_ref, y_exact), fused_err = rel_err(y_fused, y_exact);
        EXPECT_LT(fused_err, 2 * ref_err + tolerance(dt)) << "libtorch path error " << ref_err;
        for (auto [got, want] : {std::pair{s_fused->k, s_exact->k}, std::pair{s_fused->index_keys, s_exact->index_keys}})
          EXPECT_LT(rel_err(got.cpu(), want), tolerance(dt)) << "cache";
      }
    }
}
