// The mixer contract's invariants (docs/architecture.md, "The mixer contract"), run over every registered
// mixer: registering a mixer is enough to put it under this suite. Float64 on the CPU, tiny shapes:
//   - the parallel (chunked) forward == the one-token recurrence `step`, token by token from an
//     empty state (for the linear mixers this is chunked form == naive recurrence);
//   - split prefill: forward(x[:a]) + forward(x[a:], state) (+ a decode step) == forward(x), with
//     splits inside and on the boundary of chunks;
//   - gradients of the reference path (x and every parameter the forward trains) match central
//     finite differences;
//   - capabilities agree with what the mixer does (kind, aux loss, per-loop states);
//   - model invariant: a tiny LoopedLM of that mixer decodes token by token to the logits of one
//     forward, and a split prefill gives the whole one's;
//   - engine invariant: mixed-length batches in the Engine decode like each sequence alone
//     (mixers with per-sequence positions).
// Settings a mixer needs for tiny shapes come from `tiny_options` (a registered mixer without an
// entry runs with its defaults).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "common/engine_testing.h"
#include "common/testing.h"
#include "lt2/mixers/registry.h"
#include "ops/numeric_check.h"

namespace {

using namespace lt2;
using lt2::testing::rel_err;

// Mixer options for tiny shapes (d_model 32, 4 heads, sequences of ~12 tokens), by name: chunks,
// top-k, windows and blocks small enough that the sequences cross them.
json tiny_options(const std::string& name) {
  static const std::map<std::string, json> table = {
      {"gdn", {{"chunk_size", 4}}},
      {"kda", {{"chunk_size", 4}}},
      {"mamba2", {{"chunk_size", 4}, {"state_size", 8}}},
      {"retnet", {{"chunk_size", 4}}},
      {"deltanet", {{"chunk_size", 4}}},
      {"gla", {{"chunk_size", 4}}},
      {"hgrn2", {{"chunk_size", 4}, {"num_heads", 2}}},
      {"linear", {{"chunk_size", 4}}},
      {"dsa", {{"topk", 4}, {"index_heads", 2}, {"index_head_dim", 8}}},
      {"window", {{"window", 3}, {"windows", {2, 4, 0}}}},  // per loop; 0 = full
      {"nsa", {{"form", "paper"}, {"compress_block", 4}, {"compress_stride", 2}, {"select_block", 4},
               {"select_count", 2}, {"local_blocks", 1}, {"window", 3}, {"compress_hidden", 8}}},
  };
  const auto it = table.find(name);
  return it == table.end() ? json::object() : it->second;
}

ModelConfig tiny_mixer_config(const std::string& name) {
  auto cfg = lt2::testing::tiny_config(name);  // every layer this mixer
  cfg.mixer_options = json::object();
  cfg.mixer_options[name] = tiny_options(name);
  return cfg;
}

torch::TensorOptions f64() { return torch::TensorOptions().dtype(torch::kFloat64); }

torch::Tensor random_x(int64_t B, int64_t T, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return torch::randn({B, T, 32}, f64());
}

// The mixer of layer 0 in float64, its zero-initialised gates (SDPA output gate, NSA's position
// terms) given random values so every path counts.
Mixer make_f64(const std::string& name) {
  torch::manual_seed(0);
  auto m = make_mixer(name, tiny_mixer_config(name), 0);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())
    if (p.key().find("wgate") != std::string::npos || p.key().find("pos_") != std::string::npos)
      p.value().normal_(0, 0.3);
  return m;
}

// The loops to test: every loop of the tiny model for mixers with per-loop settings, else loop 0.
std::vector<int64_t> loops_of(const MixerImpl& m) {
  if (!m.caps().per_loop) return {0};
  std::vector<int64_t> loops(tiny_mixer_config(m.kind()).n_loops);
  for (size_t i = 0; i < loops.size(); ++i) loops[i] = static_cast<int64_t>(i);
  return loops;
}

std::vector<std::string> registered_names() {
  std::vector<std::string> names;
  for (const auto& m : mixer_registry()) names.push_back(m.name);
  return names;
}

class MixerInvariants : public ::testing::TestWithParam<std::string> {
 protected:
  // Tiny shapes: one intra-op thread (OpenMP's spinning threads slow tiny ops down under ctest -j).
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(MixerInvariants, ForwardEqualsStepByStep) {
  auto m = make_f64(GetParam());
  torch::NoGradGuard ng;
  const int64_t B = 2, T = 11;
  auto x = random_x(B, T);
  for (int64_t loop : loops_of(*m)) {
    auto whole = m->forward(x, {0, loop});
    auto state = m->make_state(B, T + 3, f64(), {loop});
    std::vector<torch::Tensor> ys;
    for (int64_t t = 0; t < T; ++t) ys.push_back(m->step(x.narrow(1, t, 1), {t, loop}, *state));
    EXPECT_LT(rel_err(torch::cat(ys, 1), whole), 1e-10) << "loop " << loop;
    EXPECT_EQ(state->length, T) << "loop " << loop;
  }
}

TEST_P(MixerInvariants, SplitPrefillEqualsWhole) {
  auto m = make_f64(GetParam());
  torch::NoGradGuard ng;
  const int64_t B = 2, T = 12;
  auto x = random_x(B, T, 2);
  for (int64_t loop : loops_of(*m)) {
    auto whole = m->forward(x, {0, loop});
    auto state = m->make_state(B, T + 2, f64(), {loop});
    for (int64_t a : {1, 3, 4, 6, 9}) {  // chunks of 4: inside a chunk and on its boundary
      state->reset();
      auto first = m->forward(x.narrow(1, 0, a), {0, loop}, state.get());
      auto second = m->forward(x.narrow(1, a, T - 1 - a), {a, loop}, state.get());
      auto last = m->step(x.narrow(1, T - 1, 1), {T - 1, loop}, *state);  // decode after the prefill
      EXPECT_LT(rel_err(torch::cat({first, second, last}, 1), whole), 1e-10) << "loop " << loop << " split " << a;
    }
  }
}

TEST_P(MixerInvariants, InputGradientsMatchFiniteDifferences) {
  auto m = make_f64(GetParam());
  for (int64_t loop : loops_of(*m)) {
    SCOPED_TRACE("loop " + std::to_string(loop));
    lt2::testing::expect_gradients_match(
        [&](const std::vector<torch::Tensor>& xs) { return m->forward(xs[0], {0, loop}); }, {random_x(1, 9, 3)});
  }
}

TEST_P(MixerInvariants, ParameterGradientsMatchFiniteDifferences) {
  auto m = make_f64(GetParam());
  // Parameters an auxiliary loss trains get no gradient from the forward (by design), so they are
  // left out; every other parameter is checked.
  std::set<const void*> aux;
  if (auto* a = m->aux_loss())
    for (auto& p : a->parameters()) aux.insert(p.unsafeGetTensorImpl());
  std::vector<torch::Tensor> params;
  for (auto& p : m->parameters())
    if (!aux.count(p.unsafeGetTensorImpl())) params.push_back(p);
  auto x = random_x(1, 9, 4);
  torch::manual_seed(5);
  auto R = torch::randn({1, 9, 32}, f64());
  for (int64_t loop : loops_of(*m)) {
    auto loss = [&] { return (m->forward(x, {0, loop}) * R).sum(); };
    // eps 1e-7: a step along a direction over every parameter is large in norm, and the central
    // difference's truncation error is quadratic in eps (see test_linear_mixers.cpp).
    EXPECT_LT(lt2::testing::gradcheck_directional(loss, params, 3, /*eps=*/1e-7), 1e-6) << "loop " << loop;
  }
}

TEST_P(MixerInvariants, CapabilitiesMatchTheMixer) {
  auto m = make_f64(GetParam());
  EXPECT_EQ(m->kind(), GetParam());
  EXPECT_EQ(m->caps().aux_loss, m->aux_loss() != nullptr);
  EXPECT_GE(m->prefill_workspace_bytes(1, 8, 16), 0);
  for (int64_t loop : loops_of(*m)) {
    auto state = m->make_state(2, 16, f64(), {loop});
    EXPECT_GT(state->bytes(), 0);
    EXPECT_EQ(state->length, 0);
    auto half = state->slice(1, 1);
    EXPECT_EQ(half->length, 0);
  }
  if (auto* aux = m->aux_loss()) {
    // Stage Off records nothing; a recording stage records one loss per parallel forward.
    torch::NoGradGuard ng;
    m->forward(random_x(1, 6), {0, 0});
    EXPECT_TRUE(aux->take().empty());
    aux->set_stage(AuxLossStage::Joint);
    m->forward(random_x(1, 6), {0, 0});
    EXPECT_EQ(aux->take().size(), 1u);
    EXPECT_TRUE(aux->take().empty());
    aux->set_stage(AuxLossStage::Off);
    EXPECT_FALSE(aux->parameters().empty());
  }
}

TEST_P(MixerInvariants, ModelDecodeEqualsForward) {
  auto cfg = tiny_mixer_config(GetParam());
  auto m = lt2::testing::make_test_model(cfg, 11);
  lt2::testing::expect_decode_matches_forward(*m, lt2::testing::random_tokens(2, 9, cfg.vocab_size, 3));
  lt2::testing::expect_split_prefill_matches_whole(*m, lt2::testing::random_tokens(2, 11, cfg.vocab_size, 4),
                                                   {3, 6});
}

TEST_P(MixerInvariants, EngineMatchesPerSequenceForward) {
  auto cfg = tiny_mixer_config(GetParam());
  auto m = lt2::testing::make_test_model(cfg, 11);
  if (!m->mixers()[0]->caps().seq_pos) GTEST_SKIP() << GetParam() << " has no per-sequence positions";
  EngineOptions eo;
  eo.max_batch = 3;
  eo.max_len = 16;
  eo.prefill_chunk = 3;
  lt2::testing::expect_engine_matches_per_sequence(m, eo, {2, 7, 5}, 4, 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Registered, MixerInvariants, ::testing::ValuesIn(registered_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
