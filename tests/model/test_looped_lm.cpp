// Model invariants (docs/architecture.md): decode == full forward, split prefill == whole, rho = 0 gives the
// plain loop, Ouro exit distribution sums to 1, float64 gradients match finite differences.
#include <gtest/gtest.h>

#include <thread>

#include "common/testing.h"
#include "lt2/mixers/registry.h"
#include "lt2/model/checkpointing.h"
#include "lt2/model/pattern.h"
#include "lt2/model/looped_lm.h"
#include "lt2/ops/decode_options.h"

using namespace lt2;
using lt2::testing::rel_err;
using lt2::testing::tiny_config;

using lt2::testing::random_tokens;

namespace {
LoopedLM make_model(const ModelConfig& cfg, uint64_t seed = 1) { return lt2::testing::make_test_model(cfg, seed); }
}  // namespace

class ModelInvariants : public ::testing::TestWithParam<std::pair<std::string, ModelForm>> {};

TEST_P(ModelInvariants, DecodeEqualsForward) {
  auto [pattern, form] = GetParam();
  auto cfg = tiny_config(pattern, form);
  auto m = make_model(cfg);
  lt2::testing::expect_decode_matches_forward(*m, random_tokens(2, 11, cfg.vocab_size));
}

TEST_P(ModelInvariants, SplitPrefillEqualsWhole) {
  auto [pattern, form] = GetParam();
  auto cfg = tiny_config(pattern, form);
  auto m = make_model(cfg);
  lt2::testing::expect_split_prefill_matches_whole(*m, random_tokens(2, 13, cfg.vocab_size), {1, 5, 12});
}

TEST_P(ModelInvariants, GradientsMatchFiniteDifferences) {
  auto [pattern, form] = GetParam();
  auto cfg = tiny_config(pattern, form);
  cfg.n_loops = 2;
  auto m = make_model(cfg);
  auto tok = random_tokens(1, 6, cfg.vocab_size);
  std::vector<torch::Tensor> params;
  for (auto& p : m->parameters()) params.push_back(p);
  auto loss = [&] {
    auto logits = m->forward(tok).logits;
    return torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), tok.reshape({-1}));
  };
  EXPECT_LT(lt2::testing::gradcheck_directional(loss, params), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Patterns, ModelInvariants,
                         ::testing::Values(std::make_pair(std::string("full"), ModelForm::LT2),
                                           std::make_pair(std::string("full"), ModelForm::Ouro)),
                         [](const auto& info) {
                           return info.param.second == ModelForm::LT2 ? std::string("lt2_full")
                                                                      : std::string("ouro_full");
                         });

TEST(LoopedLM, ZeroRhoIsThePlainLoop) {
  auto cfg = tiny_config();
  torch::manual_seed(3);
  LoopedLM m(cfg);
  m->to(torch::kFloat64);
  ASSERT_TRUE(m->rho.defined());
  EXPECT_EQ(m->rho.abs().sum().item<double>(), 0.0);  // zero at init
  torch::NoGradGuard ng;
  auto tok = random_tokens(2, 9, cfg.vocab_size);
  // Plain loop: apply the stack T times, then the final norm and head.
  auto h = m->tok_embeddings(tok);
  for (int64_t loop = 0; loop < cfg.n_loops; ++loop) h = m->run_stack(h, loop, 0, nullptr);
  auto plain = m->head(m->norm(h));
  EXPECT_LT(rel_err(m->forward(tok).logits, plain), 1e-12);
  // A non-zero rho changes the result.
  m->rho.normal_();
  EXPECT_GT(rel_err(m->forward(tok).logits, plain), 1e-3);
}

TEST(LoopedLM, OuroExitDistribution) {
  auto cfg = tiny_config("full", ModelForm::Ouro);
  cfg.n_loops = 4;
  auto m = make_model(cfg);
  torch::NoGradGuard ng;
  auto tok = random_tokens(2, 7, cfg.vocab_size);
  ForwardOptions o;
  o.loop_logits = true;
  auto out = m->forward(tok, nullptr, o);
  ASSERT_EQ(out.exit_probs.sizes(), (std::vector<int64_t>{2, 7, 4}));
  EXPECT_LT((out.exit_probs.sum(-1) - 1).abs().max().item<double>(), 1e-6);
  EXPECT_GE(out.exit_probs.min().item<double>(), 0.0);
  // Threshold 1.0 always exits at the last loop; exit_at_loop picks that loop's logits.
  EXPECT_TRUE((out.exit_loop == 4).all().item<bool>());
  o.exit_at_loop = 2;
  EXPECT_LT(rel_err(m->forward(tok, nullptr, o).logits, out.loop_logits[1]), 1e-12);
  // A low threshold exits early where the cumulative probability crosses it.
  ForwardOptions early;
  early.exit_threshold = 0.3;
  auto e = m->forward(tok, nullptr, early);
  auto cdf = torch::cumsum(out.exit_probs, -1);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 7; ++t) {
      int64_t k = e.exit_loop[b][t].item<int64_t>();
      EXPECT_TRUE(k == 4 || cdf[b][t][k - 1].item<double>() >= 0.3);
      if (k > 1) {
        EXPECT_LT(cdf[b][t][k - 2].item<double>(), 0.3);
      }
      EXPECT_LT(rel_err(e.logits[b][t], out.loop_logits[k - 1][b][t]), 1e-12);
    }
}

TEST(LoopedLM, ExitDistributionFormula) {
  auto logits = torch::randn({5, 4}, torch::kFloat64);
  auto p = exit_distribution(logits).to(torch::kFloat64);
  auto lam = torch::sigmoid(logits);
  for (int64_t i = 0; i < 5; ++i) {
    double survive = 1;
    for (int64_t t = 0; t < 4; ++t) {
      double expect = t < 3 ? lam[i][t].item<double>() * survive : survive;
      EXPECT_NEAR(p[i][t].item<double>(), expect, 1e-6);
      survive *= 1 - lam[i][t].item<double>();
    }
  }
}

TEST(LoopedLM, CheckpointedLoopsGiveSameGradients) {
  auto cfg = tiny_config();
  auto m = make_model(cfg);
  auto tok = random_tokens(2, 8, cfg.vocab_size);
  auto grads = [&](bool ckpt) {
    m->zero_grad();
    ForwardOptions o;
    o.checkpoint_loops = ckpt;
    auto logits = m->forward(tok, nullptr, o).logits;
    torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), tok.reshape({-1})).backward();
    std::vector<torch::Tensor> g;
    for (auto& p : m->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto plain = grads(false), ckpt = grads(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_LT(rel_err(ckpt[i], plain[i]), 1e-12);
}

// Checkpointing recomputes every loop but the last stored_loops (1 by default), the last recomputed
// loop only in its layers before the last partial_loop_layers, and the gradients equal those of
// stored activations whatever those counts.
TEST(LoopedLM, CheckpointingRecomputesEveryLoopButTheLast) {
  auto cfg = tiny_config();  // 2 layers, 3 loops
  auto m = make_model(cfg);
  auto tok = random_tokens(2, 8, cfg.vocab_size);
  auto grads = [&](bool checkpoint, int64_t stored_loops, int64_t partial_layers, std::vector<int64_t>& calls_per_layer) {
    calls_per_layer.assign(cfg.n_loops * cfg.n_layers, 0);
    ForwardOptions o;
    o.checkpoint_loops = checkpoint;
    o.stored_loops = stored_loops;
    o.partial_loop_layers = partial_layers;
    o.mixer_tap = [&](int64_t layer, int64_t loop, const torch::Tensor&, const torch::Tensor&) {
      ++calls_per_layer[loop * cfg.n_layers + layer];
    };
    m->zero_grad();
    m->forward(tok, nullptr, o).logits.square().mean().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : m->parameters())
      if (p.grad().defined()) g.push_back(p.grad().clone());
    return g;
  };
  std::vector<int64_t> calls;
  const auto stored = grads(false, 1, 0, calls);
  for (int64_t stored_loops = 1; stored_loops <= cfg.n_loops; ++stored_loops)
    for (int64_t partial = 0; partial < cfg.n_layers; ++partial) {
      const auto g = grads(true, stored_loops, partial, calls);
      // Forward: each layer application once; backward: the recompute of every loop but the last
      // stored_loops, but for the last `partial` layers of the last recomputed loop.
      for (int64_t loop = 0; loop < cfg.n_loops; ++loop)
        for (int64_t layer = 0; layer < cfg.n_layers; ++layer) {
          const bool recomputed = loop + stored_loops < cfg.n_loops &&
                                  !(loop + stored_loops + 1 == cfg.n_loops && layer >= cfg.n_layers - partial);
          EXPECT_EQ(calls[loop * cfg.n_layers + layer], recomputed ? 2 : 1)
              << "loop " << loop << " layer " << layer << ", " << stored_loops << " stored, " << partial << " partial";
        }
      ASSERT_EQ(g.size(), stored.size());
      for (size_t i = 0; i < g.size(); ++i)
        EXPECT_LT(rel_err(g[i], stored[i]), 1e-12)
            << "parameter " << i << ", " << stored_loops << " stored, " << partial << " partial";
    }
  ForwardOptions bad;
  bad.checkpoint_loops = true;
  bad.stored_loops = 0;
  EXPECT_THROW(m->forward(tok, nullptr, bad), Error);
  bad.stored_loops = 1;
  bad.partial_loop_layers = cfg.n_layers;  // a whole loop: that is stored_loops + 1
  EXPECT_THROW(m->forward(tok, nullptr, bad), Error);
}

// The recompute of a checkpointed function runs under the kernel switches that were in force at its
// forward, also where the backward runs on another thread (autograd runs a GPU's on its own), where
// the thread-local switches are not the forward's by themselves.
TEST(LoopedLM, CheckpointRecomputeKeepsTheForwardsKernelSwitches) {
  DecodeOptions off;
  off.residual_norm = false;
  std::vector<bool> seen;  // residual_norm at each call: the forward, then the recompute
  auto fn = [&seen](const torch::Tensor& x) {
    seen.push_back(decode_options().residual_norm);
    return x * x;
  };
  const auto x = torch::randn({4}, torch::kFloat64).requires_grad_(true);
  torch::Tensor y;
  {
    DecodeOptionsGuard guard(off);
    y = checkpointed(fn, x);
  }
  std::thread([&y] { y.sum().backward(); }).join();
  EXPECT_EQ(seen, (std::vector<bool>{false, false}));
  EXPECT_TRUE(torch::allclose(x.grad(), 2 * x.detach()));
}

TEST(Config, ValidationNamesField) {
  auto cfg = tiny_config();
  cfg.n_kv_heads = 3;
  try {
    cfg.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_heads"), std::string::npos) << e.what();
  }
  // Mixer names are the registry's (above config/): resolving the pattern names the unknown one.
  cfg = tiny_config("interleaved:4:1:nosuch:full");
  try {
    resolve_pattern(cfg);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nosuch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("full"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ModelConfig::from_json(json::parse(R"({"form": "gpt"})")), Error);
  EXPECT_THROW(ModelConfig::from_json(json::parse(R"({"d_modle": 3})")), Error);
  EXPECT_THROW(ModelConfig::from_json(json::parse(R"({"d_model": "big"})")), Error);
  // Shapes no model has are refused before anything is sized from them (found by fuzzing: 3e16
  // layers made the pattern allocate a name per layer).
  for (const char* text : {R"({"n_layers": 33333333333333334})", R"({"vocab_size": 4294967296})",
                           R"({"ffn_mult": 1e300})", R"({"n_loops": 5000})"}) {
    try {
      ModelConfig::from_json(json::parse(text));
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("must be"), std::string::npos) << e.what();
    }
  }
}

TEST(Config, JsonRoundTrip) {
  auto cfg = tiny_config("full", ModelForm::Ouro);
  auto back = ModelConfig::from_json(cfg.to_json());
  EXPECT_EQ(back.to_json(), cfg.to_json());
}

TEST(Pattern, Forms) {
  auto cfg = tiny_config();
  cfg.n_layers = 10;
  cfg.layer_pattern = "interleaved:4:1:full:full";
  EXPECT_EQ(resolve_pattern(cfg).size(), 10u);
  cfg.layer_pattern = "full,";
  EXPECT_THROW(resolve_pattern(cfg), Error);
  cfg.layer_pattern = "bookend:x:full:full";
  EXPECT_THROW(resolve_pattern(cfg), Error);
}
