// GPU (CTest label `gpu`): the fused DSA decode-selection kernels (ops/sparse_attention/dsa_decode.h)
// beyond their kernel-case rows (tests/gpu/kernel_cases_test.cpp): what they refuse; index scores
// and top-k, and dsa_latent_prep with the q absorption folded in, captured in a CUDA graph and
// replayed with new lengths or positions == eager (the prep: == its float64 reference); the latent
// DSA mixer's fused decode step (step, and its decode descriptor with a block's norm and residual
// around it) as accurate as its libtorch path, folded == unfolded; whole-sequence selection
// (indexer_select) on the decode kernels. Skips where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <cmath>
#include <tuple>
#include <vector>

#ifdef LT2_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "lt2/kernels/dsa_decode.h"
#endif

#include "common/testing.h"
#include "lt2/mixers/dsa.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;
using lt2::kernel_cases::dsa_1p3b_prep_shape;
using lt2::kernel_cases::index_inputs;
using lt2::kernel_cases::index_lengths;
using lt2::kernel_cases::prep_checks;
using lt2::kernel_cases::prep_inputs;
using lt2::kernel_cases::PrepShape;
using lt2::kernel_cases::random_positions;
using lt2::kernel_cases::with_output_copies;

namespace {

const auto f64 = torch::kFloat64;

}  // namespace

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
  const auto head_scores = torch::randn({2, 4, 5, 50}, gpu(torch::kBFloat16));
  const auto support = torch::ones({2, 5, 50}, gpu(torch::kBool));
  EXPECT_THROW(ops::dsa_head_probs(head_scores, support.to(torch::kInt8)), Error);    // not a bool support
  EXPECT_THROW(ops::dsa_head_probs(head_scores, support.narrow(2, 0, 49)), Error);    // keys differ
  EXPECT_THROW(ops::dsa_head_probs(head_scores.transpose(2, 3), support), Error);     // keys not contiguous
  EXPECT_THROW(ops::dsa_head_probs(head_scores.cpu(), support.cpu()), Error);
}

#ifdef LT2_WITH_CUDA

// indexer_select of whole-sequence calls on the decode kernels (a sequence's query rows share its
// keys): the scores of the visible keys against the float64 formula on the same rounded inputs,
// -inf elsewhere; the selection exactly topk_mask of those fp32 scores; the support equal to the
// libtorch path's where every visible key is selected. Queries at positions 30..99 of 100 keys, in
// tensor-core shapes (bf16) and the plain-FMA kernel's (fp32).
TEST(FusedDsa, IndexerSelectOnTheKernels) {
  REQUIRE_FUSED_DECODE();
  if (at::cuda::getDeviceProperties(0)->major < 9) GTEST_SKIP() << "topk_select needs sm_90";
  torch::manual_seed(31);
  const int64_t B = 2, n = 70, L = 100, H = 16, d = 64, start = L - n;
  for (auto dt : {torch::kBFloat16, torch::kFloat32}) {
    const auto iq = torch::randn({B, n, H, d}, gpu(dt)), keys = torch::randn({B, L, d}, gpu(dt));
    const auto iw = torch::randn({B, n, H}, gpu(dt));  // one dtype with iq, as the indexer's linears give
    auto k_pos = torch::arange(L, torch::kLong), q_pos = torch::arange(start, L, torch::kLong);
    const auto visible = window_mask(q_pos, k_pos, 0).expand({B, n, L});
    const auto want = lightning_indexer_scores(iq.cpu().to(f64), iw.cpu().to(f64), keys.cpu().to(f64));
    for (int64_t topk : {int64_t{0}, int64_t{16}, L}) {
      DecodeOptions options;
      DecodeOptionsGuard guard(options);
      const auto sel = indexer_select(iq, iw, keys, start, topk);
      const auto scores = sel.scores.cpu();
      ASSERT_EQ(scores.scalar_type(), torch::kFloat32) << "the kernels' fp32 scores";
      EXPECT_LT(rel_err(scores.masked_select(visible).to(f64), want.masked_select(visible)), tolerance(dt))
          << name(dt) << " topk " << topk;
      EXPECT_TRUE(torch::isneginf(scores.masked_select(~visible)).all().item<bool>()) << name(dt);
      const auto expect = topk == 0 ? visible : topk_mask(scores, visible, topk);
      EXPECT_TRUE(torch::equal(sel.support.cpu(), expect)) << name(dt) << " topk " << topk;
      if (topk != 16) {
        options.dsa_index_kernels = false;
        EXPECT_TRUE(torch::equal(indexer_select(iq, iw, keys, start, topk).support.cpu(), expect)) << name(dt);
      }
    }
  }
}

// DSA's prefill attention on the decode kernels (indexer_topk_attention) against masked attention in
// float64, from the same rounded inputs, over the keys the same kernels select (indexer_select): the
// GQA form's shapes (4 query heads on 2 kv heads of dim 64) and the latent form's (one kv head of
// 576, values its first 512), rows at positions 30..99 of 100 keys, top-16, blocks of 32 rows.
TEST(FusedDsa, TopkAttentionOnTheKernels) {
  REQUIRE_FUSED_DECODE();
  if (at::cuda::getDeviceProperties(0)->major < 9) GTEST_SKIP() << "topk_select needs sm_90";
  torch::NoGradGuard no_grad;
  DecodeOptions options;
  options.dsa_sparse_prefill = true;
  DecodeOptionsGuard guard(options);
  torch::manual_seed(43);
  const int64_t B = 2, n = 70, L = 100, start = L - n, topk = 16;
  const auto bf16 = gpu(torch::kBFloat16);
  const auto iq = torch::randn({B, n, 16, 64}, bf16), keys = torch::randn({B, L, 64}, bf16);
  const auto iw = torch::randn({B, n, 16}, gpu(torch::kFloat32));
  const auto support = indexer_select(iq, iw, keys, start, topk).support.cpu();  // [B, n, L]
  for (auto [H, H_kv, D, D_v] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{4, 2, 64, 64}, {4, 1, 576, 512}}) {
    const auto q = torch::randn({B, n, H, D}, bf16).transpose(1, 2), k = torch::randn({B, H_kv, L, D}, bf16);
    const auto v = D_v == D ? torch::randn({B, H_kv, L, D_v}, bf16) : k.narrow(-1, 0, D_v);
    const auto got = indexer_topk_attention(iq, iw, keys, q, k, v, start, topk, 0.1, 32);
    ASSERT_TRUE(got.defined()) << "kernels refused q " << q.sizes() << ", k " << k.sizes();
    const auto want = masked_attention(q.cpu().to(f64), k.cpu().to(f64), v.cpu().to(f64), support.unsqueeze(1), 0.1);
    EXPECT_LT(rel_err(got.cpu().to(f64), want), tolerance(torch::kBFloat16)) << "head dims " << D << "/" << D_v;
  }
}

// dsa_index_backward against float64 autograd of the scores' formula on the same bf16-rounded
// inputs: dq, dw and d_keys within the bf16 tolerance, for rows at positions 0..69 of 70 keys and
// 30..99 of 100, 16 heads of dim 64 and 64 of dim 128. d_scores is NaN past each row's visible
// keys (the reference: 0), so reading one would show.
// dsa_index_scores_grouped (a group's rows share its keys, one launch) equal to dsa_index_scores of
// each group's rows against its keys, bit for bit: the same kernel arithmetic. Query rows from a
// strided view (rows 5..n + 4 of n + 10), groups of 70 rows and of 1, in tensor-core shapes (bf16)
// and the plain-FMA kernel's (fp32).
TEST(FusedDsa, GroupedScoresEqualScoresPerRow) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(33);
  const int64_t G = 3, L = 90, H = 16, d = 64;
  for (int64_t n : {int64_t{70}, int64_t{1}})
    for (auto dt : {torch::kBFloat16, torch::kFloat32}) {
      const auto iq = torch::randn({G, n + 10, H, d}, gpu(dt)).narrow(1, 5, n);
      const auto iw = torch::randn({G, n, H}, gpu(torch::kFloat32)), keys = torch::randn({G, L, d}, gpu(dt));
      const auto lens = torch::randint(1, L + 1, {G * n}, gpu(torch::kLong));
      const auto got = ops::dsa_index_scores_grouped(iq, iw, keys, lens);
      ASSERT_EQ(got.sizes(), torch::IntArrayRef({G, n, L}));
      for (int64_t g = 0; g < G; ++g) {
        const auto want = ops::dsa_index_scores(iq[g], iw[g], keys[g].expand({n, L, d}), lens.narrow(0, g * n, n));
        EXPECT_TRUE(torch::equal(got[g], want)) << name(dt) << " group " << g << " of " << n << " rows";
      }
    }
  EXPECT_THROW(ops::dsa_index_scores_grouped(torch::randn({2, 40000, 16, 64}, gpu(torch::kBFloat16)),
                                             torch::randn({2, 40000, 16}, gpu(torch::kFloat32)),
                                             torch::randn({2, 10, 64}, gpu(torch::kBFloat16)),
                                             torch::ones({80000}, gpu(torch::kLong))),
               Error);  // more than 65535 rows
}

// The indexer's backward kernels against float64 autograd. 20 rows take one block a key tile, 70
// rows three (kernels::dsa_index_backward_row_splits on a small grid), the tiles' parts uneven.
TEST(FusedDsa, IndexBackwardMatchesAutograd) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(37);
  const int64_t B = 2;
#ifdef LT2_WITH_CUDA
  EXPECT_EQ(kernels::dsa_index_backward_row_splits(2, 20, 50), 1);
  EXPECT_EQ(kernels::dsa_index_backward_row_splits(2, 70, 100), 3);
#endif
  for (int64_t n : {int64_t{20}, int64_t{70}})
  for (auto [H, D] : {std::pair<int64_t, int64_t>{16, 64}, {64, 128}})
    for (int64_t start : {int64_t{0}, int64_t{30}}) {
      const int64_t L = start + n;
      const auto q = torch::randn({B, n, H, D}, gpu(torch::kBFloat16));
      const auto keys = torch::randn({B, L, D}, gpu(torch::kBFloat16));
      const auto w = torch::randn({B, n, H}, gpu(torch::kFloat32));
      const auto visible =
          window_mask(torch::arange(start, L, torch::kLong), torch::arange(L, torch::kLong), 0).expand({B, n, L});
      const auto d = torch::randn({B, n, L}, torch::kFloat64).masked_fill(~visible, 0.0);
      ASSERT_TRUE(ops::dsa_index_backward_supported(q, keys));
      const auto got = ops::dsa_index_backward(q, w, keys, d.masked_fill(~visible, NAN).to(gpu(torch::kFloat32)), start);
      std::vector<Tensor> leaves{q.cpu().to(f64).requires_grad_(true), w.cpu().to(f64).requires_grad_(true),
                                 keys.cpu().to(f64).requires_grad_(true)};
      const auto want = torch::autograd::grad({lightning_indexer_scores(leaves[0], leaves[1], leaves[2])}, leaves, {d});
      const std::string where = cat(n, " rows, ", H, " heads of dim ", D, ", start ", start);
      EXPECT_LT(rel_err(got.dq.cpu().to(f64), want[0]), tolerance(torch::kBFloat16)) << where;
      EXPECT_LT(rel_err(got.dw.cpu().to(f64), want[1]), tolerance(torch::kBFloat16)) << where;
      EXPECT_LT(rel_err(got.d_keys.cpu().to(f64), want[2]), tolerance(torch::kBFloat16)) << where;
      // dq written into rows of a larger buffer (dq_out): the same values, the rows around untouched.
      const auto buffer = torch::full({B, n + 3, H, D}, 7.0, gpu(torch::kBFloat16));
      const auto into = ops::dsa_index_backward(q, w, keys, d.masked_fill(~visible, NAN).to(gpu(torch::kFloat32)),
                                                start, buffer.narrow(1, 2, n));
      EXPECT_TRUE(torch::equal(buffer.narrow(1, 2, n), got.dq)) << where;
      EXPECT_TRUE((buffer.narrow(1, 0, 2) == 7.0).all().item<bool>() && (buffer.narrow(1, n + 2, 1) == 7.0).all().item<bool>())
          << where;
      EXPECT_EQ(into.dq.data_ptr(), buffer.narrow(1, 2, n).data_ptr()) << where;
    }
}

// indexer_loss_blocked on CUDA in bf16 with the kernels (selection, backward, and the target with
// dsa_head_probs on and off), in blocks of 16 rows over every visible key, against the same in
// float64 on the CPU from the same rounded inputs: the loss and its gradients within the bf16
// tolerance.
TEST(FusedDsa, IndexerLossOnTheKernelsMatchesFloat64) {
  REQUIRE_FUSED_DECODE();
  if (at::cuda::getDeviceProperties(0)->major < 9) GTEST_SKIP() << "topk_select needs sm_90";
  torch::manual_seed(41);
  const int64_t B = 2, T = 70, H_I = 64, d_I = 64, H = 4, H_kv = 2, D = 32;
  const auto bf16 = gpu(torch::kBFloat16);
  const std::vector<Tensor> inputs{torch::randn({B, T, H_I, d_I}, bf16), torch::randn({B, T, H_I}, bf16) * 0.1,
                                   torch::randn({B, T, d_I}, bf16), torch::randn({B, H, T, D}, bf16),
                                   torch::randn({B, H_kv, T, D}, bf16)};
  auto run = [&](bool on_cpu) {
    std::vector<Tensor> in;
    for (const auto& x : inputs) in.push_back(on_cpu ? x.cpu().to(f64) : x.clone());
    std::vector<Tensor> leaves{in[0].requires_grad_(true), in[1].requires_grad_(true), in[2].requires_grad_(true)};
    auto queries = [&](const Tensor& x) { return std::pair{leaves[0] * x, leaves[1] * x}; };
    const int64_t row_bytes = indexer_loss_row_bytes(B, H, H_I, T, /*kernels=*/!on_cpu);  // blocks of 16 rows
    auto r = indexer_loss_blocked(queries, torch::ones({}, in[0].options()), leaves[2], in[3], in[4], 0, 0, 0.2,
                                  16 * row_bytes);
    r.loss.backward();
    std::vector<Tensor> g{r.loss};
    for (const auto& leaf : leaves) g.push_back(leaf.grad());
    return g;
  };
  ASSERT_TRUE(ops::dsa_index_backward_supported(inputs[0], inputs[2]));
  const auto want = run(true);
  for (bool head_probs : {true, false}) {
    DecodeOptions options;
    options.dsa_head_probs = head_probs;
    DecodeOptionsGuard guard(options);
    const auto got = run(false);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LT(rel_err(got[i].cpu().to(f64), want[i]), tolerance(torch::kBFloat16))
          << "output " << i << ", dsa_head_probs " << head_probs;
  }
}

// The indexer loss's target on its kernel against the float64 formula on the same rounded scores:
// each head's softmax over the row's support, the mean over the heads, 0 off the support and on a
// row with an empty support. bf16 and fp32 scores, 12 heads, 70 keys (not a multiple of 8), rows of
// a strided view, random supports with an empty and a full row, one per sequence or one shared by
// the batch (a zero batch stride).
TEST(FusedDsa, HeadProbsMatchTheFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(43);
  const int64_t B = 3, H = 12, n = 9, L = 70;
  for (auto dt : {torch::kBFloat16, torch::kFloat32})
    for (bool shared : {false, true}) {
      const auto scores = (torch::randn({B, H, n, L + 5}, gpu(torch::kFloat32)) * 3).to(dt).narrow(3, 2, L);
      auto support = torch::rand({shared ? 1 : B, n, L}, gpu(torch::kFloat32)) < 0.6;
      support[0][1].fill_(false);
      support[0][2].fill_(true);
      support = support.expand({B, n, L});
      ASSERT_TRUE(ops::dsa_head_probs_supported(scores, support));
      const auto got = ops::dsa_head_probs(scores, support);
      const auto s = scores.cpu().to(f64);
      const auto m = support.cpu();
      const auto want = torch::softmax(s.masked_fill(~m.unsqueeze(1), -INFINITY), -1).nan_to_num(0.0).mean(1);
      const std::string where = cat(dt, shared ? ", shared support" : ", a support per sequence");
      EXPECT_EQ(got.scalar_type(), torch::kFloat32) << where;
      EXPECT_LT(rel_err(got.cpu().to(f64), want.masked_fill(~m, 0.0)), tolerance(torch::kFloat32)) << where;
      EXPECT_TRUE(got[0][1].eq(0).all().item<bool>()) << where << ": the empty row";
    }
}

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
    in.lens.copy_(index_lengths(B, L).flip(0));  // new lengths, the full-cache one first
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
// dsa_latent_prep.

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
  const auto s = dsa_1p3b_prep_shape();
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
    for (const auto& check : prep_checks(a, want, tolerance(torch::kBFloat16)))
      EXPECT_TRUE(check.passed) << check.what << ": " << check.detail;
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
        const auto nw = norm_weight.to(in.device(), in.scalar_type());
        const auto d = fused ? mixer.decode_descriptor(st, in.size(0)) : std::optional<DecodeDescriptor>();
        EXPECT_EQ(d.has_value(), fused) << "the descriptor exists exactly when the fused path is on";
        if (!d) return in + mixer.step(rms_norm(in, nw, eps), p, st);
        // What a decode plan runs: the normed input GEMV, the core, wo with the residual.
        const auto x2 = in.reshape({in.size(0), -1});
        const auto parts = ops::normed_linear(x2, d->input_weight, nw, eps).split_with_sizes(d->part_sizes, -1);
        return PendingProjection{d->core(parts, p), d->output, {}, x2}.run().view(in.sizes());
      };
      for (bool residual : {false, true}) {
        SCOPED_TRACE(residual ? "descriptor with residual" : "step");
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
