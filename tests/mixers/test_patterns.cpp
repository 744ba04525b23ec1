// LT2's attention patterns over (layer, loop) with the sparse mixers: hybrids (GDN+DSA, GDN+NSA,
// GDN+window, Full+window) through the layer pattern, loop-level windows, and random:a:b
// (re-drawn per training forward, K = 5 votes at inference). Model invariant: decode == forward.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <set>

#include "lt2/mixers/dsa.h"
#include "lt2/mixers/window.h"
#include "lt2/model/looped_lm.h"
#include "lt2/model/pattern.h"
#include "mixers/sparse_testing.h"

namespace {

using namespace lt2;
using lt2::testing::rel_err;

ModelConfig hybrid_config(const std::string& pattern, int64_t n_layers = 2, int64_t n_loops = 3) {
  auto cfg = lt2::testing::tiny_config(pattern);
  cfg.n_layers = n_layers;
  cfg.n_loops = n_loops;
  cfg.mixer_options["gdn"] = json{{"chunk_size", 4}};
  cfg.mixer_options["dsa"] = json{{"topk", 3}, {"index_heads", 2}, {"index_head_dim", 8}};
  cfg.mixer_options["nsa"] = json{{"form", "paper"}, {"compress_block", 4}, {"compress_stride", 2},
                                  {"select_block", 4}, {"select_count", 3}, {"window", 3},
                                  {"compress_hidden", 8}};
  std::vector<int64_t> windows = {2, 4, 0, 3};  // loop-level windows, the last loop full when 3 loops
  windows.resize(n_loops);
  cfg.mixer_options["window"] = json{{"window", 3}, {"windows", windows}};
  return cfg;
}

using lt2::testing::make_test_model;
using lt2::testing::random_tokens;

struct HybridCase {
  std::string pattern;
  int64_t n_layers;
};

class HybridModel : public ::testing::TestWithParam<HybridCase> {};

TEST_P(HybridModel, DecodeEqualsForward) {
  auto cfg = hybrid_config(GetParam().pattern, GetParam().n_layers);
  auto m = make_test_model(cfg);
  lt2::testing::expect_decode_matches_forward(*m, random_tokens(2, 11, cfg.vocab_size));
}

TEST_P(HybridModel, SplitPrefillEqualsWhole) {
  auto cfg = hybrid_config(GetParam().pattern, GetParam().n_layers);
  auto m = make_test_model(cfg);
  lt2::testing::expect_split_prefill_matches_whole(*m, random_tokens(2, 13, cfg.vocab_size, 8), {1, 5, 10});
}

INSTANTIATE_TEST_SUITE_P(
    Patterns, HybridModel,
    ::testing::Values(HybridCase{"interleaved:1:1:gdn:dsa", 2}, HybridCase{"gdn,nsa", 2},
                      HybridCase{"gdn,window", 2}, HybridCase{"full,window", 2},
                      HybridCase{"bookend:1:gdn:dsa", 3}, HybridCase{"front:1:gdn:nsa", 3},
                      HybridCase{"back:1:window:full", 3}),
    [](const auto& info) {
      std::string s = info.param.pattern;
      for (auto& c : s)
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      return s;
    });

TEST(HybridModel, GradientsMatchFiniteDifferences) {
  for (std::string pattern : {"gdn,dsa", "gdn,nsa"}) {
    auto cfg = hybrid_config(pattern, 2, /*n_loops=*/2);
    auto m = make_test_model(cfg);
    auto tok = random_tokens(1, 9, cfg.vocab_size, 9);
    std::vector<torch::Tensor> params;
    for (auto& p : m->named_parameters())
      if (p.key().find("index_") == std::string::npos) params.push_back(p.value());  // no gradient there
    auto loss = [&] {
      auto logits = m->forward(tok).logits;
      return torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), tok.reshape({-1}));
    };
    // A step of eps along a random direction over every parameter moves them by eps * sqrt(n)
    // in norm; the central difference's truncation error (measured: quadratic in eps) is ~1e-6 at
    // eps 1e-6 for this model, so take eps 1e-7 (round-off stays ~1e-9).
    EXPECT_LT(lt2::testing::gradcheck_directional(loss, params, 3, 1e-7), 1e-6) << pattern;
  }
}

TEST(Patterns, LoopLevelWindows) {
  auto cfg = hybrid_config("gdn,window");
  LoopedLM m(cfg);
  auto w = std::dynamic_pointer_cast<WindowAttentionImpl>(m->layers[1]->as<BlockImpl>()->mixer);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->window_at(0), 2);
  EXPECT_EQ(w->window_at(1), 4);
  EXPECT_EQ(w->window_at(2), 0);
  // Each (layer, loop) state is sized for its loop: 2, 4 and max_len slots.
  auto state = m->make_state(1, 100);
  const int64_t N = cfg.n_layers;
  const std::vector<int64_t> slots = {2, 4, 100};
  for (int64_t loop = 0; loop < 3; ++loop)
    EXPECT_EQ(dynamic_cast<RingKVCache&>(*state->mixers[loop * N + 1]).slots(), slots[loop]);
}

TEST(Patterns, RandomParsesAndRejects) {
  auto cfg = hybrid_config("random:1:3");
  cfg.n_layers = 3;
  EXPECT_EQ(resolve_pattern(cfg), (std::vector<std::string>{"window", "window", "window"}));
  auto slots = random_slots(cfg);
  ASSERT_TRUE(slots.has_value());
  EXPECT_DOUBLE_EQ(slots->p_full, 0.25);
  EXPECT_EQ(slots->votes, 5);
  EXPECT_FALSE(random_slots(hybrid_config("gdn,window")).has_value());
  for (std::string bad : {"random:1", "random:x:1", "random:0:0", "random:1:2:3"}) {
    cfg.layer_pattern = bad;
    EXPECT_THROW(resolve_pattern(cfg), Error) << bad;
  }
}

std::vector<Mixer> mixers_of(LoopedLM& m) {
  std::vector<Mixer> out;
  for (auto& b : *m->layers) out.push_back(b->as<BlockImpl>()->mixer);
  return out;
}

TEST(Patterns, RandomRedrawsEveryTrainingForward) {
  auto cfg = hybrid_config("random:1:1");
  auto m = make_test_model(cfg);
  m->train();
  auto tok = random_tokens(1, 6, cfg.vocab_size);
  std::set<std::vector<int64_t>> seen;
  int64_t full = 0, window = 0;
  torch::NoGradGuard ng;
  for (int i = 0; i < 8; ++i) {
    m->forward(tok);
    // The window each (layer, loop) slot's mixer used: its window for the slot's draw.
    std::vector<int64_t> slots;
    const auto layers = mixers_of(m);
    for (int64_t l = 0; l < static_cast<int64_t>(layers.size()); ++l)
      for (int64_t loop = 0; loop < cfg.n_loops; ++loop) {
        const int64_t w = std::dynamic_pointer_cast<WindowAttentionImpl>(layers[l])
                              ->window_for({loop, slot_draw(m->last_draw(), loop, l)});
        slots.push_back(w);
        EXPECT_TRUE(w == 0 || w == 3) << w;
        (w == 0 ? full : window)++;
      }
    seen.insert(slots);
  }
  EXPECT_GT(seen.size(), 1u);  // re-drawn
  EXPECT_GT(full, 0);
  EXPECT_GT(window, 0);
}

TEST(Patterns, RandomVotesAtInference) {
  auto cfg = hybrid_config("random:1:1");
  auto m = make_test_model(cfg);
  m->eval();
  torch::NoGradGuard ng;
  auto tok = random_tokens(2, 9, cfg.vocab_size);
  auto voted = m->forward(tok).logits;
  // Reference: the mean of the K draws' distributions, each draw run as a plain loop.
  auto draws = random_slots(cfg)->vote_draws(cfg.n_loops, cfg.n_layers);
  ASSERT_EQ(draws.size(), 5u);
  torch::Tensor mean_p;
  for (auto& d : draws) {
    auto h = m->tok_embeddings(tok);
    for (int64_t loop = 0; loop < cfg.n_loops; ++loop) h = m->run_stack(h, loop, 0, nullptr, {}, d) + m->rho[loop] * h;
    auto p = torch::softmax(m->head(m->norm(h)), -1);
    mean_p = mean_p.defined() ? mean_p + p / 5.0 : p / 5.0;
  }
  EXPECT_LT(rel_err(torch::softmax(voted, -1), mean_p), 1e-12);
  // The same draws every call (and in every process: a fixed seed).
  EXPECT_LT(rel_err(m->forward(tok).logits, voted), 1e-14);
  auto again = random_slots(cfg)->vote_draws(cfg.n_loops, cfg.n_layers);
  for (size_t k = 0; k < draws.size(); ++k) EXPECT_TRUE(torch::equal(draws[k], again[k]));
  // Decode with one state group per draw equals the voted forward.
  auto state = m->make_state(2, 12, torch::TensorOptions().dtype(torch::kFloat64));
  EXPECT_EQ(state->mixers.size(), static_cast<size_t>(5 * cfg.n_loops * cfg.n_layers));
  for (int64_t t = 0; t < tok.size(1); ++t)
    EXPECT_LT(rel_err(m->forward(tok.narrow(1, t, 1), state.get()).logits, voted.narrow(1, t, 1)), 1e-10)
        << "token " << t;
}

}  // namespace

namespace {

// fp32 AdamW on a repeating random pattern; returns {first loss, last loss}.
std::pair<double, double> train_steps(LoopedLM& m, const ModelConfig& cfg, int steps,
                                      const std::function<torch::Tensor(const torch::Tensor&)>& extra_loss) {
  torch::manual_seed(5);
  auto tok = torch::randint(cfg.vocab_size, {1, 8}, torch::kLong).repeat({4, 5});  // [4, 40]
  auto input = tok.narrow(1, 0, 39), target = tok.narrow(1, 1, 39);
  std::vector<torch::Tensor> trainable;
  for (auto& p : m->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    auto logits = m->forward(input).logits;
    auto lm = torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), target.reshape(-1));
    auto loss = extra_loss(lm);
    opt.zero_grad();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

TEST(SparseModels, LearnARepeatingPattern) {
  for (std::string pattern : {"gdn,dsa", "gdn,nsa", "gdn,window", "random:1:1"}) {
    auto cfg = hybrid_config(pattern);
    cfg.mixer_options["gdn"]["chunk_size"] = 16;
    torch::manual_seed(1);
    LoopedLM m(cfg);
    auto [first, last] = train_steps(m, cfg, 30, [](const torch::Tensor& lm) { return lm; });
    std::printf("[ loss     ] %-26s step 0: %.3f   step 29: %.3f\n", pattern.c_str(), first, last);
    EXPECT_LT(last, 0.5 * first) << pattern;
  }
}

TEST(SparseModels, DsaWarmupThenSparseStage) {
  auto cfg = hybrid_config("gdn,dsa");
  cfg.mixer_options["gdn"]["chunk_size"] = 16;
  torch::manual_seed(1);
  LoopedLM m(cfg);
  auto mean_kl = [&m] {
    auto losses = take_indexer_losses(*m);
    EXPECT_EQ(losses.size(), 3u);  // one DSA layer x 3 loops
    return torch::stack(losses).mean();
  };
  // Dense warm-up: only the indexer trains, on its KL alone.
  set_indexer_stage(*m, IndexerStage::DenseWarmup);
  std::vector<torch::Tensor> frozen;
  auto dsa = std::dynamic_pointer_cast<DSAImpl>(m->layers[1]->as<BlockImpl>()->mixer);
  std::set<torch::TensorImpl*> indexer;
  for (auto& p : dsa->indexer_parameters()) indexer.insert(p.unsafeGetTensorImpl());
  for (auto& p : m->parameters())
    if (!indexer.count(p.unsafeGetTensorImpl())) {
      p.set_requires_grad(false);
      frozen.push_back(p);
    }
  auto before = m->tok_embeddings->weight.clone();
  auto [kl_first, kl_last] = train_steps(m, cfg, 30, [&](const torch::Tensor&) { return mean_kl(); });
  std::printf("[ loss     ] dsa dense warm-up KL        step 0: %.4f   step 29: %.4f\n", kl_first, kl_last);
  EXPECT_LT(kl_last, kl_first);
  EXPECT_TRUE(torch::equal(before, m->tok_embeddings->weight));  // the rest stayed frozen
  // Sparse stage: everything trains, LM loss + KL on the selected set.
  set_indexer_stage(*m, IndexerStage::Sparse);
  for (auto& p : frozen) p.set_requires_grad(true);
  auto [first, last] = train_steps(m, cfg, 30, [&](const torch::Tensor& lm) { return lm + mean_kl(); });
  std::printf("[ loss     ] dsa sparse stage LM + KL    step 0: %.3f   step 29: %.3f\n", first, last);
  EXPECT_LT(last, 0.5 * first);
}

}  // namespace
