// DeepSeek Sparse Attention (mixers/dsa.h): lightning indexer, deterministic top-k, sparse
// attention in GQA and latent forms, the indexer KL signal and its stages; the invariants of docs/architecture.md.
#include <gtest/gtest.h>

#include "lt2/mixers/dsa.h"
#include "lt2/model/looped_lm.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "mixers/sparse_testing.h"

namespace {

using namespace lt2;
using namespace lt2::sparse_testing;

json dsa_options(int64_t topk, const std::string& form = "gqa") {
  return json{{"topk", topk}, {"index_heads", 3}, {"index_head_dim", 8}, {"index_rope_dim", 4},
              {"attention", form}, {"latent_dim", 12}, {"latent_rope_dim", 4}};
}

std::shared_ptr<DSAImpl> make_dsa(int64_t topk, const std::string& form = "gqa", uint64_t seed = 5) {
  return std::dynamic_pointer_cast<DSAImpl>(make_f64("dsa", attention_config("dsa", dsa_options(topk, form)), seed));
}

TEST(TopK, TiesGoToTheLowerIndex) {
  auto s = torch::tensor({1.0, 3.0, 3.0, 0.0, 3.0, 3.0});
  auto all = torch::ones({6}, torch::kBool);
  EXPECT_TRUE(torch::equal(topk_indices(s, all, 2), torch::tensor({1L, 2L})));
  EXPECT_TRUE(torch::equal(topk_indices(s, all, 3), torch::tensor({1L, 2L, 4L})));
  EXPECT_TRUE(torch::equal(topk_mask(s, all, 5), torch::tensor({true, true, true, false, true, true})));
  // Invisible entries are never chosen; fewer visible than k selects all visible ones.
  auto vis = torch::tensor({true, false, true, true, false, false});
  EXPECT_TRUE(torch::equal(topk_mask(s, vis, 2), torch::tensor({true, false, true, false, false, false})));
  EXPECT_TRUE(torch::equal(topk_mask(s, vis, 5), vis));
  // Many exact ties (e.g. all-zero ReLU scores) on a long row: still the lowest indices.
  auto zeros = torch::zeros({2, 100});
  auto idx = topk_indices(zeros, torch::ones({2, 100}, torch::kBool), 7);
  EXPECT_TRUE(torch::equal(idx, torch::arange(7).expand({2, 7})));
}

TEST(TopK, LowPrecisionKeysEqualTheStableSort) {
  // fp32 / bf16 scores take one top-k over (score, lower index) keys; float64 takes the stable
  // sort. Same selection and order, on rows full of ties, negatives, +-0 and masked entries.
  torch::manual_seed(4);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto s = (torch::randint(-4, 5, {3, 257}) * 0.5).to(dtype);  // few distinct values: many ties
    s.index_put_({0, torch::indexing::Slice(0, 20)}, -0.0);
    s.index_put_({1, torch::indexing::Slice(5, 9)}, std::numeric_limits<float>::lowest());
    auto vis = torch::rand({3, 257}) > 0.3;
    for (int64_t k : {1, 7, 64, 200, 300}) {
      auto want = topk_indices(s.to(torch::kFloat64), vis, k);
      EXPECT_TRUE(torch::equal(topk_indices(s, vis, k), want)) << "k " << k << " dtype " << dtype;
    }
  }
}

TEST(Indexer, ScoresMatchTheFormula) {
  auto m = make_dsa(4);
  auto x = random_x(2, 6, 32);
  torch::NoGradGuard ng;
  auto [q, w] = m->indexer_queries(x, Positions{});  // [B, T, H_I, d_I], [B, T, H_I]
  auto k = m->indexer_keys(x, Positions{});          // [B, T, d_I]
  auto scores = lightning_indexer_scores(q, w, k);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 6; ++t)
      for (int64_t s = 0; s < 6; ++s) {
        double expect = 0;
        for (int64_t j = 0; j < 3; ++j)
          expect += w[b][t][j].item<double>() * std::max(0.0, q[b][t][j].dot(k[b][s]).item<double>());
        EXPECT_NEAR(scores[b][t][s].item<double>(), expect, 1e-12);
      }
  // The weights carry H_I^-1/2 d_I^-1/2; the key has a LayerNorm (mean 0 before RoPE on its tail).
  auto w_raw = m->index_ww(x);
  EXPECT_LT(rel_err(w, w_raw / std::sqrt(3.0 * 8.0)), 1e-14);
  auto k_norm = m->index_k_norm(m->index_wk(x));
  EXPECT_LT(rel_err(k.narrow(-1, 4, 4), k_norm.narrow(-1, 4, 4)), 1e-14);  // un-rotated dims
}

TEST(DSA, TopkCoveringTheSequenceEqualsFullAttention) {
  auto cfg = attention_config("dsa", dsa_options(12));
  auto dsa = make_dsa(12);
  auto full = std::make_shared<FullAttentionImpl>(cfg);
  full->to(torch::kFloat64);
  copy_params(*full, *dsa, "attn.");
  auto x = random_x(2, 12, cfg.d_model);
  torch::NoGradGuard ng;
  EXPECT_LT(rel_err(dsa->forward(x, {0, 0}), full->forward(x, {0, 0})), 1e-12);
  auto sparse = make_dsa(3);
  copy_params(*full, *sparse, "attn.");
  EXPECT_GT(rel_err(sparse->forward(x, {0, 0}), full->forward(x, {0, 0})), 1e-3);
}

TEST(DSA, MatchesNaiveTopkAttention) {
  const int64_t topk = 3, T = 9;
  auto m = make_dsa(topk);
  auto x = random_x(2, T, 32, 6);
  torch::NoGradGuard ng;
  auto [q, w] = m->indexer_queries(x, 0);
  auto scores = lightning_indexer_scores(q, w, m->indexer_keys(x, 0));  // [B, T, T]
  auto p = m->attn->project(x, 0);
  auto o = torch::zeros_like(p.q);
  const int64_t H = m->n_heads, G = H / m->n_kv_heads;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < T; ++t) {
      // Top-k of keys 0..t by score, ties to the lower index: a plain sort of (-score, index).
      std::vector<std::pair<double, int64_t>> order;
      for (int64_t s = 0; s <= t; ++s) order.push_back({-scores[b][t][s].item<double>(), s});
      std::sort(order.begin(), order.end());
      std::vector<int64_t> sel;
      for (int64_t i = 0; i < std::min<int64_t>(topk, t + 1); ++i) sel.push_back(order[i].second);
      auto idx = torch::tensor(sel);
      for (int64_t h = 0; h < H; ++h) {
        auto keys = p.k[b].index_select(0, idx).select(1, h / G);  // [k, D]
        auto vals = p.v[b].index_select(0, idx).select(1, h / G);
        auto a = torch::softmax(keys.matmul(p.q[b][t][h]) / std::sqrt(8.0), 0);
        o[b][t][h].copy_(a.matmul(vals));
      }
    }
  EXPECT_LT(rel_err(m->forward(x, {0, 0}), m->attn->output(o, x)), 1e-12);
}

class DSAForms : public ::testing::TestWithParam<std::string> {};

TEST_P(DSAForms, ForwardEqualsSteps) {
  auto x = random_x(2, 13, 32, 7);
  for (int64_t topk : {1, 4, 20}) {
    auto m = make_dsa(topk, GetParam());
    expect_forward_equals_steps(*m, x);
  }
}

TEST_P(DSAForms, SplitPrefillEqualsWhole) {
  auto m = make_dsa(4, GetParam());
  expect_split_prefill(*m, random_x(2, 13, 32, 8), {1, 3, 6, 12});
}

// Inference runs the query rows in blocks bounded by query_block_bytes: one row
// per block, a few rows, and one block give the same output, without a state and when
// prefilling one (a block then scores and attends over the cached keys too).
TEST_P(DSAForms, QueryBlocksEqualOneBlock) {
  torch::NoGradGuard ng;
  auto m = make_dsa(4, GetParam());
  auto x = random_x(2, 13, 32, 9);
  auto prefill = [&] {
    auto state = m->make_state(2, 13, f64(), {0});
    auto first = m->forward(x.narrow(1, 0, 5), {0, 0}, state.get());
    return torch::cat({first, m->forward(x.narrow(1, 5, 8), {5, 0}, state.get())}, 1);
  };
  const auto whole = m->forward(x, {0, 0}), whole_prefill = prefill();
  for (int64_t budget : {int64_t{1}, int64_t{3} * 2 * 13 * (2 * 3 + 4) * 4}) {  // 1 row; 3 rows (indexer) of 13 keys
    m->query_block_bytes = budget;
    EXPECT_LT(rel_err(m->forward(x, {0, 0}), whole), 1e-12) << "budget " << budget;
    EXPECT_LT(rel_err(prefill(), whole_prefill), 1e-12) << "budget " << budget;
  }
}

TEST_P(DSAForms, DenseWarmupIsDenseInForwardAndDecode) {
  auto sparse = make_dsa(2, GetParam());
  auto dense = make_dsa(100, GetParam());  // same weights (same seed), k >= sequence
  dense->stage = IndexerStage::DenseWarmup;
  auto x = random_x(2, 9, 32, 9);
  {
    torch::NoGradGuard ng;
    auto reference = dense->forward(x, {0, 0});
    sparse->stage = IndexerStage::DenseWarmup;
    EXPECT_LT(rel_err(sparse->forward(x, {0, 0}), reference), 1e-12);
  }
  expect_forward_equals_steps(*sparse, x);
  sparse->indexer_losses.clear();
}

TEST_P(DSAForms, GradientsMatchFiniteDifferences) {
  auto m = make_dsa(3, GetParam());
  // The selection carries no gradient and the indexer gets none from the output: check x and the
  // attention weights.
  EXPECT_LT(gradcheck_mixer(*m, random_x(1, 7, 32, 10), 0, {"index_"}), 1e-6);
}

TEST_P(DSAForms, IndexerLossGradientsMatchFiniteDifferences) {
  auto m = make_dsa(3, GetParam());
  auto x = random_x(2, 7, 32, 11);
  for (auto stage : {IndexerStage::DenseWarmup, IndexerStage::Sparse}) {
    m->stage = stage;
    auto loss = [&] {
      m->forward(x, {0, 0});
      auto l = m->indexer_losses.back();
      m->indexer_losses.clear();
      return l;
    };
    EXPECT_LT(lt2::testing::gradcheck_directional(loss, m->indexer_parameters()), 1e-6) << to_string(stage);
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, DSAForms, ::testing::Values("gqa", "latent"));

TEST(DSA, LatentStateHoldsOneSharedKvHead) {
  auto m = make_dsa(4, "latent");
  auto s = m->make_state(2, 50, f64());
  // [c | k_r] (12 + 4) per token plus the indexer key (8), float64.
  EXPECT_EQ(s->bytes(), 2 * 50 * (12 + 4 + 8) * 8);
  auto g = make_dsa(4, "gqa");
  EXPECT_EQ(g->make_state(2, 50, f64())->bytes(), 2 * 50 * (2 * 2 * 8 + 8) * 8);
}

TEST(IndexerLoss, QueriesWithoutKeysGiveTheSameLossWithoutTheirRowsZeroed) {
  // attention_probs leaves the rows of queries that see no key NaN when asked not to zero them
  // (the indexer loss's one pass fewer); the KL's target masks them by their empty support, so the
  // loss is the same finite value as with the rows zeroed.
  torch::manual_seed(13);
  const int64_t B = 2, H = 4, T = 7, L = 9, D = 8;
  auto q = torch::randn({B, H, T, D}, f64()), k = torch::randn({B, 2, L, D}, f64());
  auto support = torch::rand({B, T, L}) < 0.5;
  support.select(1, 2).fill_(false);  // query 2 of each row sees no key
  auto scores = torch::randn({B, T, L}, f64());
  const auto nan_rows = attention_probs(q, k, support.unsqueeze(1), 0, /*zero_rows_without_keys=*/false);
  EXPECT_TRUE(nan_rows.select(2, 2).isnan().all().item<bool>());
  const auto zeroed = attention_probs(q, k, support.unsqueeze(1));
  EXPECT_EQ(zeroed.select(2, 2).abs().max().item<double>(), 0.0);
  const auto want = indexer_kl_loss(zeroed, scores, support).item<double>();
  EXPECT_TRUE(std::isfinite(want));
  EXPECT_NEAR(indexer_kl_loss(nan_rows, scores, support).item<double>(), want, 1e-12);
}

TEST(IndexerLoss, ZeroWhenTheIndexerReproducesTheAttention) {
  torch::manual_seed(12);
  const int64_t B = 2, H = 3, T = 6;
  auto causal = torch::ones({T, T}, torch::kBool).tril();
  auto logits = torch::randn({B, H, T, T}, f64()).masked_fill(~causal, -INFINITY);
  auto probs = torch::softmax(logits, -1);  // per-head attention
  auto target = probs.sum(1) / H;           // head-summed, L1-normalised
  auto support = causal.expand({B, T, T});
  // Dense: scores = log p (+ any per-query constant) give KL 0.
  auto scores = torch::log(target.clamp_min(1e-300)) + torch::randn({B, T, 1}, f64());
  EXPECT_LT(indexer_kl_loss(probs, scores, support).abs().item<double>(), 1e-12);
  // Sparse: restricted to a selected set, the target renormalises on it.
  auto selected = support & ((torch::rand({B, T, T}) < 0.6) | torch::eye(T, torch::kBool));
  auto sparse_probs = torch::softmax(logits.masked_fill(~selected.unsqueeze(1), -INFINITY), -1);
  auto sparse_target = sparse_probs.sum(1);
  auto sparse_scores = torch::log(sparse_target.clamp_min(1e-300)) - 0.7;
  EXPECT_LT(indexer_kl_loss(sparse_probs, sparse_scores, selected).abs().item<double>(), 1e-12);
  // Any other scores give a positive KL, matching the definition.
  auto other = torch::randn({B, T, T}, f64());
  auto kl = indexer_kl_loss(probs, other, support).item<double>();
  auto log_q = torch::log_softmax(other.masked_fill(~support, -INFINITY), -1).masked_fill(~support, 0);
  auto expect = (torch::xlogy(target, target) - target * log_q).sum(-1).mean().item<double>();
  EXPECT_GT(kl, 1e-3);
  EXPECT_NEAR(kl, expect, 1e-12);
}

// indexer_loss_blocked against the composition it replaces, under autograd: the loss, the selection
// and the gradients of iq, iw and index_k, for blocks of 1, 3 and all rows, dense and top-k (rows
// with more visible keys than k), queries at the last T of L keys, GQA heads.
TEST(IndexerLoss, BlockedEqualsTheDenseComposition) {
  torch::manual_seed(21);
  const int64_t B = 2, H = 4, H_kv = 2, T = 7, L = 9, D = 5, H_I = 3, d_I = 6;
  const auto iq = torch::randn({B, T, H_I, d_I}, f64()), iw = torch::randn({B, T, H_I}, f64());
  const auto keys = torch::randn({B, L, d_I}, f64());
  const auto q = torch::randn({B, H, T, D}, f64()), k = torch::randn({B, H_kv, L, D}, f64());
  const double scale = 0.37;
  auto leaves = [&] {
    return std::vector<Tensor>{iq.clone().requires_grad_(true), iw.clone().requires_grad_(true),
                               keys.clone().requires_grad_(true)};
  };
  {  // attention_probs: the grouped heads' product against keys repeated per query head; a row that
     // sees no key gets zeros, and the gradient stays finite
    auto mask = torch::rand({B, 1, T, L}) < 0.7;
    mask.select(2, 1).fill_(false);
    auto scores = torch::matmul(q, k.repeat_interleave(H / H_kv, 1).transpose(-1, -2)) * scale;
    auto naive = torch::softmax(scores.masked_fill(~mask, -INFINITY), -1).nan_to_num(0.0);
    auto q_leaf = q.clone().requires_grad_(true);
    auto probs = attention_probs(q_leaf, k, mask, scale);
    EXPECT_LT(rel_err(probs, naive), 1e-14);
    EXPECT_EQ(probs.select(2, 1).abs().sum().item<double>(), 0.0);
    (probs * torch::randn_like(probs)).sum().backward();
    EXPECT_TRUE(torch::isfinite(q_leaf.grad()).all().item<bool>());
  }
  for (int64_t topk : {0, 3}) {
    auto ref = leaves();
    auto sel = indexer_select(ref[0], ref[1], ref[2], L - T, topk);
    auto loss = indexer_kl_loss(attention_probs(q, k, sel.support.unsqueeze(1), scale), sel.scores, sel.support);
    ASSERT_GT(loss.item<double>(), 1e-3);
    const auto g_ref = torch::autograd::grad({loss}, ref);
    const int64_t row_bytes = indexer_loss_row_bytes(B, H, H_I, L, /*kernels=*/false);
    for (int64_t rows : {int64_t{1}, int64_t{3}, T}) {
      auto in = leaves();
      int calls = 0;
      auto queries = [&](const Tensor& x) {
        ++calls;
        return std::pair{in[0] * x, in[1] * x};  // a graph to the leaves, as a projection has to its weights
      };
      auto r = indexer_loss_blocked(queries, torch::ones({}, f64()), in[2], q, k, L - T, topk, scale, rows * row_bytes);
      EXPECT_NEAR(r.loss.item<double>(), loss.item<double>(), 1e-12) << "topk " << topk << " rows " << rows;
      EXPECT_TRUE(torch::equal(r.support, sel.support)) << "topk " << topk << " rows " << rows;
      r.loss.backward();
      EXPECT_EQ(calls, 2) << "the forward's queries, then the backward's";
      for (size_t i = 0; i < in.size(); ++i)
        EXPECT_LT(rel_err(in[i].grad(), g_ref[i]), 1e-12) << "topk " << topk << " rows " << rows << " input " << i;
    }
  }
}

// The recorded loss and the output do not depend on the query blocks, and recording leaves the
// output as the stage without the loss computes it.
TEST_P(DSAForms, RecordedLossIndependentOfQueryBlocks) {
  auto m = make_dsa(4, GetParam());
  auto x = random_x(2, 13, 32, 14);
  Tensor plain;
  {
    torch::NoGradGuard ng;
    plain = m->forward(x, {0, 0});  // stage off: the same top-k selection, no loss
  }
  m->stage = IndexerStage::Sparse;
  auto whole = m->forward(x, {0, 0});
  EXPECT_LT(rel_err(whole, plain), 1e-12);
  const double whole_loss = m->indexer_losses.back().item<double>();
  for (int64_t budget : {int64_t{1}, int64_t{3} * 2 * 13 * ((2 * 3 + 4) + 2 * 3 * 3) * 4}) {
    m->query_block_bytes = budget;
    EXPECT_LT(rel_err(m->forward(x, {0, 0}), whole), 1e-12) << "budget " << budget;
    EXPECT_NEAR(m->indexer_losses.back().item<double>(), whole_loss, 1e-12) << "budget " << budget;
  }
  m->indexer_losses.clear();
}

TEST(IndexerLoss, TrainsOnlyTheIndexer) {
  auto m = make_dsa(3);
  m->stage = IndexerStage::Sparse;
  auto x = random_x(2, 8, 32, 13).requires_grad_(true);
  auto y = m->forward(x, {0, 0});
  ASSERT_EQ(m->indexer_losses.size(), 1u);
  auto kl = m->indexer_losses[0];
  m->indexer_losses.clear();
  // The KL reaches the indexer only (its input is detached).
  auto grads = torch::autograd::grad({kl}, {x}, {}, true, false, /*allow_unused=*/true);
  EXPECT_FALSE(grads[0].defined());
  for (auto& p : m->indexer_parameters()) EXPECT_TRUE(p.requires_grad());
  // The output gives the indexer no gradient.
  auto out_grads = torch::autograd::grad({y.sum()}, m->indexer_parameters(), {}, true, false, true);
  for (auto& g : out_grads) EXPECT_FALSE(g.defined() && g.abs().sum().item<double>() > 0);
  // Stage off records nothing; inference paths record nothing.
  m->stage = IndexerStage::Off;
  m->forward(x, {0, 0});
  EXPECT_TRUE(m->indexer_losses.empty());
}

// A tiny float64 looped model of DSA layers (top-3) in `stage`, and a batch of its tokens.
std::pair<LoopedLM, Tensor> tiny_dsa_model(IndexerStage stage) {
  auto cfg = lt2::testing::tiny_config("dsa");
  cfg.mixer_options["dsa"] = dsa_options(3);
  torch::manual_seed(1);
  LoopedLM model(cfg);
  model->to(torch::kFloat64);
  set_indexer_stage(*model, stage);
  torch::manual_seed(2);
  return {model, torch::randint(cfg.vocab_size, {2, 7}, torch::kLong)};
}

TEST(IndexerLoss, OneLossPerLayerAndLoop) {
  auto [model, tok] = tiny_dsa_model(IndexerStage::DenseWarmup);
  const auto& cfg = model->config();
  model->forward(tok);
  auto losses = take_indexer_losses(*model);
  EXPECT_EQ(static_cast<int64_t>(losses.size()), cfg.n_layers * cfg.n_loops);
  for (auto& l : losses) EXPECT_GT(l.item<double>(), 0.0);
  EXPECT_TRUE(take_indexer_losses(*model).empty());
}

// Per-loop checkpointing: every (layer, loop) records its loss once, each with its graph (the
// checkpointed loops' first pass runs without a gradient, their backward runs them again), nothing
// is left recorded after the backward, and the indexer's gradients equal those of stored activations,
// however many of the last loops store theirs.
TEST(IndexerLoss, CheckpointedLoopsTrainTheIndexerAsStoredOnes) {
  auto built = tiny_dsa_model(IndexerStage::Sparse);  // not a structured binding: the lambda below captures them
  auto& model = built.first;
  const auto& tok = built.second;
  const auto& cfg = model->config();
  std::vector<Tensor> indexer;
  for (auto& m : model->modules(false))
    if (auto* d = dynamic_cast<DSAImpl*>(m.get())) for (auto& p : d->indexer_parameters()) indexer.push_back(p);
  auto grads = [&](bool checkpoint, int64_t stored_loops) {
    ForwardOptions fo;
    fo.checkpoint_loops = checkpoint;
    fo.stored_loops = stored_loops;
    auto out = model->forward(tok, nullptr, fo);
    auto losses = take_indexer_losses(*model);
    EXPECT_EQ(static_cast<int64_t>(losses.size()), cfg.n_layers * cfg.n_loops);
    for (auto& l : losses) EXPECT_TRUE(l.requires_grad());
    model->zero_grad();
    (out.logits.sum() * 0.0 + torch::stack(losses).sum()).backward();  // through the checkpoints too
    EXPECT_TRUE(take_indexer_losses(*model).empty()) << "losses recorded by the backward's recompute";
    std::vector<Tensor> g;
    for (auto& p : indexer) g.push_back(p.grad().clone());
    return g;
  };
  const auto stored = grads(false, 1);
  for (int64_t stored_loops = 1; stored_loops < cfg.n_loops; ++stored_loops) {  // some loops recomputed
    const auto recomputed = grads(true, stored_loops);
    for (size_t i = 0; i < stored.size(); ++i)
      EXPECT_LT(rel_err(recomputed[i], stored[i]), 1e-12) << "parameter " << i << ", " << stored_loops << " stored";
  }
}

TEST(DSA, Options) {
  EXPECT_THROW(make_mixer("dsa", attention_config("dsa", json{{"top_k", 3}}), 0), Error);
  EXPECT_THROW(make_mixer("dsa", attention_config("dsa", json{{"attention", "mla"}}), 0), Error);
  EXPECT_THROW(parse_indexer_stage("warmup"), Error);
  EXPECT_EQ(parse_indexer_stage("dense_warmup"), IndexerStage::DenseWarmup);
  auto d = std::dynamic_pointer_cast<DSAImpl>(make_mixer("dsa", lt2::testing::tiny_config(), 0));
  EXPECT_EQ(d->topk, 2048);
  EXPECT_EQ(d->index_heads, 64);
  EXPECT_EQ(d->index_head_dim, 128);
}

// Packing the latent form keeps one copy of the absorption weights: wk_b and wv_b view their
// transposed copies, so values are unchanged and a later update to a parameter shows in the copy
// the fused decode reads.
TEST(DSA, PackedAbsorptionWeightsFollowTheParameters) {
  auto m = make_dsa(4, "latent", 8);
  const auto wk_before = m->wk_b.clone(), wv_before = m->wv_b.clone();
  m->pack_for_inference();
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(m->wk_b, wk_before));
  EXPECT_TRUE(torch::equal(m->wv_b, wv_before));
  ASSERT_TRUE(m->wk_b_t.is_contiguous() && m->wv_b_t.is_contiguous());
  m->wk_b.mul_(2);
  m->wv_b.copy_(torch::randn_like(m->wv_b));
  EXPECT_TRUE(torch::equal(m->wk_b_t, m->wk_b.transpose(1, 2)));
  EXPECT_TRUE(torch::equal(m->wv_b_t, m->wv_b.transpose(1, 2)));
  EXPECT_TRUE(torch::equal(m->wk_b, 2 * wk_before));
}

// ops::dsa_latent_prep_reference (the fused decode kernel's reference) on the packed projection
// equals the unfused decode math: project()'s RoPE'd q, the cache rows step() writes at each
// sequence's position, indexer_queries() and the lengths; both RoPE styles, the output gate packed in.
TEST(DSA, LatentPrepReferenceEqualsTheUnfusedStep) {
  for (auto style : {RopeStyle::Interleaved, RopeStyle::Half}) {
    SCOPED_TRACE(style == RopeStyle::Half ? "half" : "interleaved");
    auto cfg = attention_config("dsa", dsa_options(4, "latent"));
    cfg.rope_style = style;
    cfg.attn_output_gate = true;
    auto m = std::dynamic_pointer_cast<DSAImpl>(make_f64("dsa", cfg, 8));
    m->pack_for_inference();
    ASSERT_TRUE(m->w_in.defined());
    torch::NoGradGuard ng;
    const int64_t B = 3, L = 9, H = m->n_heads, D = m->head_dim, dc = m->latent_dim, dr = m->latent_rope_dim;
    const int64_t HI = m->index_heads, dI = m->index_head_dim;
    auto x = random_x(B, 1, cfg.d_model, 3);
    const Positions pos(0, 0, torch::tensor({0L, 7L, 3L}));
    auto state = m->make_state(B, L, f64());
    auto& s = dynamic_cast<DSAState&>(*state);
    s.k.normal_(), s.index_keys.normal_();  // rows the step must leave alone

    const auto proj = at::linear(x.view({B, -1}), m->w_in);  // [B, N]: what the packed GEMV computes
    const auto parts = unpack_outputs(proj, m->input_projections());
    ASSERT_EQ(parts.size(), 6u);
    ops::DsaLatentPrepArgs a;
    a.q_raw = parts[0].view({B, H, D + dr}), a.kv_raw = parts[1], a.index_q_raw = parts[2].view({B, HI, dI});
    a.index_k_raw = parts[3], a.index_w_raw = parts[4], a.seq_pos = pos.seq_pos;
    a.kv_norm_weight = m->kv_norm->weight, a.kv_norm_eps = m->kv_norm->eps;
    a.index_norm_weight = m->index_k_norm->weight, a.index_norm_bias = m->index_k_norm->bias;
    a.index_norm_eps = m->index_k_norm->options.eps();
    a.rope_theta = cfg.rope_theta, a.rope_style = style, a.index_rope_dim = m->index_rope_dim;
    a.index_weight_scale = 1.0 / std::sqrt(static_cast<double>(HI * dI)), a.topk = m->topk;
    a.q = torch::zeros({B, H, dc + dr}, f64()), a.index_q = torch::zeros({B, HI, dI}, f64());
    a.index_w = torch::zeros({B, HI}, f64());
    a.seq_lens = torch::zeros({B}, torch::kLong), a.counts = torch::zeros({B}, torch::kLong);
    a.k_cache = s.k.clone(), a.index_keys = s.index_keys.clone();
    ops::dsa_latent_prep_reference(a);

    m->step(x, pos, s);  // the unfused decode step (CPU): writes both caches at seq_pos
    EXPECT_LT(rel_err(a.k_cache, s.k), 1e-13);
    EXPECT_LT(rel_err(a.index_keys, s.index_keys), 1e-13);
    auto q = m->project(x, pos).q.squeeze(2);  // [B, H, d_c + d_r]
    EXPECT_LT(rel_err(a.q.narrow(-1, dc, dr), q.narrow(-1, dc, dr)), 1e-13);
    auto [iq, iw] = m->indexer_queries(x, pos);
    EXPECT_LT(rel_err(a.index_q, iq.squeeze(1)), 1e-13);
    EXPECT_LT(rel_err(a.index_w, iw.squeeze(1)), 1e-13);
    EXPECT_TRUE(torch::equal(a.seq_lens, torch::tensor({1L, 8L, 4L})));
    EXPECT_TRUE(torch::equal(a.counts, torch::tensor({1L, 4L, 4L})));  // top-k 4
  }
}

}  // namespace
