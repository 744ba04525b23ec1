// Native Sparse Attention (mixers/nsa.h): the paper's block-importance sum, forced blocks and top-n
// selection, a per-query reference of all three branches, the all-selected degenerate case, and
// the invariants of docs/architecture.md for the paper and simplified forms.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <set>

#include "lt2/mixers/nsa.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "mixers/sparse_testing.h"

namespace {

using namespace lt2;
using namespace lt2::sparse_testing;

// Small blocks so ~20 tokens hold several compression and selection blocks.
json paper_options(int64_t select_count = 4, int64_t window = 5) {
  return json{{"form", "paper"}, {"compress_block", 4}, {"compress_stride", 2}, {"select_block", 4},
              {"select_count", select_count}, {"window", window}, {"compress_hidden", 16}};
}
json simplified_options(int64_t select_count = 4, int64_t window = 5) {
  return json{{"form", "simplified"}, {"compress_block", 4}, {"compress_stride", 4}, {"select_block", 4},
              {"select_count", select_count}, {"window", window}};
}
json options_for(const std::string& form) { return form == "paper" ? paper_options() : simplified_options(); }

std::shared_ptr<NSAImpl> make_nsa(const json& options, uint64_t seed = 5) {
  return std::dynamic_pointer_cast<NSAImpl>(make_f64("nsa", attention_config("nsa", options), seed));
}

// Softmax attention of one query [D] over keys/values [n, D].
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     torch::Tensor* probs = nullptr) {
  auto p = torch::softmax(k.matmul(q) / std::sqrt(static_cast<double>(q.size(0))), 0);
  if (probs) *probs = p;
  return p.matmul(v);
}

// Per-query reference of the three branches from the paper's definitions (spec §7.1), one query
// and one group at a time. Returns [3, B, T, H, D] (cmp, slc, win).
torch::Tensor naive_branches(NSAImpl& m, const torch::Tensor& x) {
  torch::NoGradGuard ng;
  const int64_t B = x.size(0), T = x.size(1), H = m.n_heads, G = H / m.n_kv_heads, D = m.head_dim;
  const int64_t l = m.compress_block, d = m.compress_stride, ls = m.select_block;
  const auto proj = m.project(x, 0);
  const auto& q = proj.q;             // [B, T, H, D]
  std::vector<torch::Tensor> ks, vs;  // per branch [B, T, H_kv, D]
  for (auto b : {NSAImpl::kCmp, NSAImpl::kSlc, NSAImpl::kWin}) {
    ks.push_back(proj.k[m.kv_set(b)]);
    vs.push_back(proj.v[m.kv_set(b)]);
  }
  // Compressed blocks, one block at a time: block i = tokens [i d, i d + l).
  std::vector<torch::Tensor> kc, vc;  // [B, H_kv, D]
  for (int64_t i = 0; i * d + l <= T; ++i) {
    auto [a, c] = m.compress(ks[0].narrow(1, i * d, l), vs[0].narrow(1, i * d, l));
    kc.push_back(a.select(1, 0));
    vc.push_back(c.select(1, 0));
  }
  auto out = torch::zeros({3, B, T, H, D}, f64());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t n_vis = 0;  // complete blocks: i d + l - 1 <= t
      while (n_vis < static_cast<int64_t>(kc.size()) && n_vis * d + l - 1 <= t) ++n_vis;
      const int64_t own = t / ls;
      for (int64_t g = 0; g < m.n_kv_heads; ++g) {
        std::vector<double> importance(own + 1, 0.0);
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          if (n_vis == 0) continue;
          std::vector<torch::Tensor> kk, vv;
          for (int64_t i = 0; i < n_vis; ++i) {
            kk.push_back(kc[i][b][g]);
            vv.push_back(vc[i][b][g]);
          }
          torch::Tensor p;
          out[0][b][t][h].copy_(attend(q[b][t][h], torch::stack(kk), torch::stack(vv), &p));
          // p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n]  (0-based blocks)
          for (int64_t j = 0; j <= own; ++j)
            for (int64_t mm = 0; mm < ls / d; ++mm)
              for (int64_t nn = 0; nn < l / d; ++nn) {
                const int64_t i = (ls / d) * j + mm - nn;
                if (i >= 0 && i < n_vis) importance[j] += p[i].item<double>();
              }
        }
        // Forced: block 0 and the local blocks ending at the query's block; then by importance,
        // ties to the lower block, up to select_count blocks.
        std::set<int64_t> chosen = {0};
        for (int64_t j = std::max<int64_t>(0, own - m.local_blocks + 1); j <= own; ++j) chosen.insert(j);
        std::vector<std::pair<double, int64_t>> rest;
        for (int64_t j = 0; j <= own; ++j)
          if (!chosen.count(j)) rest.push_back({-importance[j], j});
        std::sort(rest.begin(), rest.end());
        for (auto& r : rest)
          if (static_cast<int64_t>(chosen.size()) < m.select_count) chosen.insert(r.second);
        std::vector<int64_t> sel, win;
        for (int64_t s = 0; s <= t; ++s) {
          if (chosen.count(s / ls)) sel.push_back(s);
          if (t - s < m.window) win.push_back(s);
        }
        auto si = torch::tensor(sel), wi = torch::tensor(win);
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          out[1][b][t][h].copy_(attend(q[b][t][h], ks[1][b].index_select(0, si).select(1, g),
                                       vs[1][b].index_select(0, si).select(1, g)));
          out[2][b][t][h].copy_(attend(q[b][t][h], ks[2][b].index_select(0, wi).select(1, g),
                                       vs[2][b].index_select(0, wi).select(1, g)));
        }
      }
    }
  return out;
}

torch::Tensor combine(NSAImpl& m, const torch::Tensor& branches, const torch::Tensor& x) {
  auto g = torch::sigmoid(m.project(x, 0).gate_logits);  // [B, T, H, 3]
  auto o = g.select(-1, 0).unsqueeze(-1) * branches[0] + g.select(-1, 1).unsqueeze(-1) * branches[1] +
           g.select(-1, 2).unsqueeze(-1) * branches[2];
  return m.wo(o.flatten(2));
}

TEST(NSASelection, OverlapMatrixIsThePaperSum) {
  for (auto [l, d, ls] : {std::tuple<int64_t, int64_t, int64_t>{32, 16, 64}, {64, 64, 64}, {8, 2, 4}, {4, 4, 8}}) {
    const int64_t NC = 11, NS = 7;
    auto p = torch::rand({NC}, f64());
    auto fast = torch::matmul(p, nsa_overlap_matrix(NC, NS, l, d, ls, f64()));
    for (int64_t j = 0; j < NS; ++j) {
      double expect = 0;
      for (int64_t mm = 0; mm < ls / d; ++mm)
        for (int64_t nn = 0; nn < l / d; ++nn) {
          const int64_t i = (ls / d) * j + mm - nn;
          if (i >= 0 && i < NC) expect += p[i].item<double>();
        }
      EXPECT_NEAR(fast[j].item<double>(), expect, 1e-14) << l << " " << d << " " << ls << " block " << j;
    }
  }
  EXPECT_THROW(nsa_overlap_matrix(3, 3, 32, 12, 64, f64()), Error);
}

TEST(NSASelection, ForcedBlocksThenTopByImportanceWithTies) {
  // One row per query position; selection block 4 tokens; 3 blocks in all, 1 local block.
  auto pos = torch::tensor({0L, 5L, 9L, 11L});
  auto importance = torch::tensor({{0.0, 0.0, 0.0}, {0.1, 0.5, 0.0}, {0.2, 0.2, 0.9}, {0.3, 0.3, 0.3}},
                                  f64()).view({1, 1, 4, 3});
  auto sel = nsa_select_blocks(importance, pos, 4, /*n_select=*/2, /*n_local=*/1).view({4, 3});
  auto expect = torch::tensor({{true, false, false},    // only block 0 visible
                               {true, true, false},     // block 0 forced, block 1 own
                               {true, false, true},     // 0 forced, 2 own (local) -> 2 blocks
                               {true, false, true}});   // same, ties irrelevant
  EXPECT_TRUE(torch::equal(sel, expect)) << sel;
  auto wide = nsa_select_blocks(importance, pos, 4, 3, 0).view({4, 3});
  // No local blocks: block 0 forced, then by importance; the tie at position 11 goes to block 1.
  EXPECT_TRUE(torch::equal(wide.select(0, 3), torch::tensor({true, true, true})));
  auto two = nsa_select_blocks(importance, pos, 4, 2, 0).view({4, 3});
  EXPECT_TRUE(torch::equal(two.select(0, 3), torch::tensor({true, true, false})));
  EXPECT_TRUE(torch::equal(two.select(0, 2), torch::tensor({true, false, true})));
}

class NSAForms : public ::testing::TestWithParam<std::string> {};

TEST_P(NSAForms, MatchesPerQueryReference) {
  auto m = make_nsa(options_for(GetParam()));
  auto x = random_x(2, 21, 32, 3);
  torch::NoGradGuard ng;
  EXPECT_LT(rel_err(m->forward(x, {0, 0}), combine(*m, naive_branches(*m, x), x)), 1e-12);
}

TEST_P(NSAForms, AllBlocksSelectedReducesToItsBranches) {
  // Every block selected and a window covering the sequence: the selection and window branches are
  // plain causal attention over their own K/V; the gates are fixed (zero weight, chosen bias).
  auto opts = options_for(GetParam());
  opts["select_count"] = 100;
  opts["window"] = 100;
  auto m = make_nsa(opts);
  torch::NoGradGuard ng;
  m->wg->weight.zero_();
  m->wg->bias.copy_(torch::linspace(-1.5, 1.5, m->wg->bias.size(0), f64()));
  auto x = random_x(2, 18, 32, 4);
  const auto proj = m->project(x, 0);
  auto q = proj.q.transpose(1, 2);
  auto causal = [&](NSAImpl::Branch b) {
    const auto &k = proj.k[m->kv_set(b)], &v = proj.v[m->kv_set(b)];
    return at::scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), {}, 0.0, true, {}, true)
        .transpose(1, 2);
  };
  auto naive = naive_branches(*m, x);
  auto branches = torch::stack({naive[0], causal(NSAImpl::kSlc), causal(NSAImpl::kWin)});
  EXPECT_LT(rel_err(m->forward(x, {0, 0}), combine(*m, branches, x)), 1e-12);
  // With gates fixed, the output is affine in the gate values: a pure window gate is the window branch.
  m->wg->bias.view({-1, 3}).copy_(torch::tensor({-1e4, -1e4, 1e4}, f64()));
  EXPECT_LT(rel_err(m->forward(x, {0, 0}), m->wo(causal(NSAImpl::kWin).flatten(2))), 1e-12);
}

TEST_P(NSAForms, ForwardEqualsSteps) {
  auto m = make_nsa(options_for(GetParam()));
  expect_forward_equals_steps(*m, random_x(2, 19, 32, 5));
}

TEST_P(NSAForms, SplitPrefillEqualsWhole) {
  auto m = make_nsa(options_for(GetParam()));
  // Splits inside and at the edge of compression and selection blocks.
  expect_split_prefill(*m, random_x(2, 19, 32, 6), {1, 3, 4, 9, 17});
}

TEST_P(NSAForms, GradientsMatchFiniteDifferences) {
  auto m = make_nsa(options_for(GetParam()));
  EXPECT_LT(gradcheck_mixer(*m, random_x(1, 13, 32, 7)), 1e-6);
}

TEST_P(NSAForms, DecodeAppendsCompressedBlocks) {
  // After each step the compressed cache holds the compression of every complete block of the
  // cached keys, and nothing past them.
  auto m = make_nsa(options_for(GetParam()));
  auto state = m->make_state(1, 30, f64());
  auto& s = dynamic_cast<NSAState&>(*state);
  auto x = random_x(1, 19, 32, 8);
  torch::NoGradGuard ng;
  const int64_t cs = m->kv_set(NSAImpl::kCmp);
  for (int64_t t = 0; t < 19; ++t) {
    m->step(x.narrow(1, t, 1), {t, 0}, *state);
    const int64_t NC = nsa_num_blocks(t + 1, m->compress_block, m->compress_stride);
    auto [kc, vc] = m->compress(s.k[cs].narrow(2, 0, t + 1).transpose(1, 2), s.v[cs].narrow(2, 0, t + 1).transpose(1, 2));
    EXPECT_EQ(kc.size(1), NC);
    if (NC > 0) {
      EXPECT_LT(rel_err(s.k_cmp.narrow(2, 0, NC), kc.transpose(1, 2)), 1e-12) << "token " << t;
    }
    EXPECT_EQ(s.v_cmp.narrow(2, NC, s.v_cmp.size(2) - NC).abs().max().item<double>(), 0.0) << "token " << t;
  }
  EXPECT_EQ(s.k.size(), GetParam() == "paper" ? 3u : 1u);  // separate or shared K/V
}

TEST_P(NSAForms, PerSequenceStepsEqualEachSequenceForward) {
  // Sequences prefilled to lengths 2, 9 and 5, then decoded together with per-sequence positions
  // (Positions::seq_pos) past compression- and selection-block edges and past the window (5):
  // each output equals the forward over that sequence alone. Mean and MLP compression; with no
  // local blocks the query's own block may go unselected.
  for (const auto& [compression, local] : {std::pair{"mean", 2}, std::pair{"mlp", 2}, std::pair{"mean", 0}}) {
    SCOPED_TRACE(std::string(compression) + " local " + std::to_string(local));
    auto opts = options_for(GetParam());
    opts["compression"] = compression;
    opts["local_blocks"] = local;
    auto m = make_nsa(opts);
    const std::vector<int64_t> prompt{2, 9, 5};
    const int64_t B = 3, steps = 11, T = 9 + steps;
    auto x = random_x(B, T, 32, 11);
    torch::NoGradGuard ng;
    auto state = m->make_state(B, T + 1, f64());
    for (int64_t b = 0; b < B; ++b) {
      auto view = state->slice(b, 1);
      m->forward(x.narrow(0, b, 1).narrow(1, 0, prompt[b]), {0, 0}, view.get());
    }
    auto pos = torch::tensor(prompt, torch::kLong);  // [B]
    for (int64_t step = 0; step < steps; ++step) {
      auto xt = x.index({torch::arange(B), pos}).unsqueeze(1);  // [B, 1, d] each sequence's next token
      auto o = m->step(xt, Positions(0, 0, pos), *state);      // [B, 1, d]
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = pos[b].item<int64_t>() + 1;
        auto want = m->forward(x.narrow(0, b, 1).narrow(1, 0, n), {0, 0}).select(1, n - 1);
        EXPECT_LT(rel_err(o.narrow(0, b, 1).select(1, 0), want), 1e-10) << "sequence " << b << ", length " << n;
      }
      pos = pos + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, NSAForms, ::testing::Values("paper", "simplified"));

TEST(NSA, DefaultsFollowTheSpec) {
  auto cfg = lt2::testing::tiny_config();
  auto fla = std::dynamic_pointer_cast<NSAImpl>(make_mixer("nsa", cfg, 0));
  EXPECT_EQ(fla->compress_block, 64);
  EXPECT_EQ(fla->compress_stride, 64);
  EXPECT_EQ(fla->select_block, 64);
  EXPECT_EQ(fla->select_count, 16);
  EXPECT_EQ(fla->window, 512);
  EXPECT_TRUE(fla->shared_kv);
  EXPECT_FALSE(fla->mlp_compression);
  cfg.mixer_options["nsa"] = json{{"form", "paper"}};
  auto paper = std::dynamic_pointer_cast<NSAImpl>(make_mixer("nsa", cfg, 0));
  EXPECT_EQ(paper->compress_block, 32);
  EXPECT_EQ(paper->compress_stride, 16);
  EXPECT_EQ(paper->select_block, 64);
  EXPECT_FALSE(paper->shared_kv);
  EXPECT_TRUE(paper->mlp_compression);
  // Gates start on the window branch.
  auto g = torch::sigmoid(paper->wg->bias.view({-1, 3})[0]);
  EXPECT_LT(g[0].item<double>(), 0.2);
  EXPECT_GT(g[2].item<double>(), 0.8);
  cfg.mixer_options["nsa"] = json{{"compress_stride", 24}};
  EXPECT_THROW(make_mixer("nsa", cfg, 0), Error);
  cfg.mixer_options["nsa"] = json{{"blocks", 3}};
  EXPECT_THROW(make_mixer("nsa", cfg, 0), Error);
}

}  // namespace
