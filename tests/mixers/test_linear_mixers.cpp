// Every linear-time mixer (gdn, kda, mamba2, retnet, deltanet, gla, hgrn2, linear, plus GVA and
// short-conv variants) against the mixer contract: forward (chunked) == step token by token
// (recurrence) in float64, split prefill == whole prefill at any split, float64 gradients of the
// chunked path match finite differences, gate ranges, state size, long fp32 sequences.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/mixers/registry.h"
#include "ops/numeric_check.h"

namespace {

using namespace lt2;
using lt2::testing::expect_gradients_match;
using lt2::testing::gradcheck_directional;
using lt2::testing::rel_err;

struct MixerCase {
  std::string label, name;
  json options;  // mixer_options[name]
};

ModelConfig mixer_config(const MixerCase& c) {
  ModelConfig cfg;
  cfg.d_model = 32;
  cfg.n_heads = 4;
  cfg.mixer_options = json::object();
  cfg.mixer_options[c.name] = c.options;
  return cfg;
}

std::shared_ptr<RecurrentMixerImpl> make(const MixerCase& c, torch::ScalarType dt, uint64_t seed = 0) {
  torch::manual_seed(seed);
  auto m = std::dynamic_pointer_cast<RecurrentMixerImpl>(make_mixer(c.name, mixer_config(c), 0));
  EXPECT_TRUE(m) << c.name << " is not a recurrent mixer";
  m->to(dt);
  return m;
}

torch::Tensor random_x(int64_t B, int64_t T, torch::ScalarType dt, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return torch::randn({B, T, 32}, torch::TensorOptions().dtype(dt));
}

torch::TensorOptions f64() { return torch::TensorOptions().dtype(torch::kFloat64); }

class LinearMixer : public ::testing::TestWithParam<MixerCase> {
 protected:
  // Tiny shapes: one intra-op thread. Under `ctest -j` on 2 cores, OpenMP's spinning threads
  // slow these tests down ~20x.
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(LinearMixer, ForwardMatchesStepByStep) {
  auto m = make(GetParam(), torch::kFloat64);
  torch::NoGradGuard ng;
  const int64_t B = 2, T = 21;
  auto x = random_x(B, T, torch::kFloat64);
  auto whole = m->forward(x, {0, 0});
  auto state = m->make_state(B, 64, f64());
  std::vector<torch::Tensor> ys;
  for (int64_t t = 0; t < T; ++t) ys.push_back(m->step(x.narrow(1, t, 1), {t, 0}, *state));
  EXPECT_LT(rel_err(torch::cat(ys, 1), whole), 1e-10);
  EXPECT_EQ(state->length, T);
}

TEST_P(LinearMixer, SplitPrefillMatchesWhole) {
  auto m = make(GetParam(), torch::kFloat64);
  torch::NoGradGuard ng;
  const int64_t B = 2, T = 22;
  auto x = random_x(B, T, torch::kFloat64);
  auto whole = m->forward(x, {0, 0});
  auto state = m->make_state(B, 64, f64());
  for (int64_t a : {1, 3, 8, 13, 20}) {  // chunk size 8: mid-chunk and on the boundary
    state->reset();
    auto first = m->forward(x.narrow(1, 0, a), {0, 0}, state.get());
    auto second = m->forward(x.narrow(1, a, T - 1 - a), {a, 0}, state.get());
    auto last = m->step(x.narrow(1, T - 1, 1), {T - 1, 0}, *state);  // decode after the prefill
    EXPECT_LT(rel_err(torch::cat({first, second, last}, 1), whole), 1e-10) << "split at " << a;
  }
}

TEST_P(LinearMixer, StateStartMustMatchPosition) {
  auto m = make(GetParam(), torch::kFloat64);
  auto state = m->make_state(1, 16, f64());
  EXPECT_THROW(m->forward(random_x(1, 3, torch::kFloat64), {2, 0}, state.get()), lt2::Error);
}

TEST_P(LinearMixer, InputGradientsMatchFiniteDifferences) {
  auto m = make(GetParam(), torch::kFloat64);
  auto x = random_x(1, 11, torch::kFloat64);
  expect_gradients_match([&](const std::vector<torch::Tensor>& xs) { return m->forward(xs[0], {0, 0}); },
                         {x});
}

TEST_P(LinearMixer, ParameterGradientsMatchFiniteDifferences) {
  auto m = make(GetParam(), torch::kFloat64);
  auto x = random_x(1, 11, torch::kFloat64);
  torch::manual_seed(5);
  auto R = torch::randn({1, 11, 32}, f64());
  std::vector<torch::Tensor> params;
  for (auto& p : m->parameters()) params.push_back(p);
  auto loss = [&] { return (m->forward(x, {0, 0}) * R).sum(); };
  // The random direction spans every parameter (|d| ~ 100), so the central difference's O(eps^2)
  // truncation error is large at eps 1e-6 for RetNet (q, k, v enter trilinearly, no q/k norm):
  // measured, the error falls exactly 100x per 10x smaller eps down to 1e-7, where every mixer is
  // below 1.1e-7.
  EXPECT_LT(gradcheck_directional(loss, params, 3, /*eps=*/1e-7), 1e-6);
}

TEST_P(LinearMixer, GateRanges) {
  auto m = make(GetParam(), torch::kFloat64);
  torch::NoGradGuard ng;
  auto in = m->project(3.0 * random_x(2, 30, torch::kFloat64), nullptr, 0);
  if (in.g.defined()) {
    auto decay = in.g.exp();
    EXPECT_TRUE((decay > 0).all().item<bool>()) << "decay must be > 0";
    EXPECT_TRUE((decay <= 1).all().item<bool>()) << "decay must be <= 1";
  }
  if (in.beta.defined()) {
    EXPECT_TRUE((in.beta > 0).all().item<bool>() && (in.beta < 1).all().item<bool>())
        << "beta must lie in (0, 1)";
  }
  EXPECT_EQ(m->delta_rule, in.beta.defined());
}

TEST_P(LinearMixer, StateBytesAndReset) {
  auto m = make(GetParam(), torch::kFloat32);
  auto state = m->make_state(3, 128, torch::TensorOptions().dtype(torch::kFloat32));
  auto& st = dynamic_cast<RecurrentState&>(*state);
  int64_t expected = 3 * m->state_heads * m->state_k * m->state_v * 4;
  for (int64_t c : m->conv_channels) expected += 3 * (m->conv_kernel - 1) * c * 4;
  EXPECT_EQ(state->bytes(), expected);
  EXPECT_EQ(st.S.scalar_type(), torch::kFloat32);
  torch::NoGradGuard ng;
  m->forward(random_x(3, 5, torch::kFloat32), {0, 0}, state.get());
  EXPECT_EQ(state->length, 5);
  EXPECT_GT(st.S.abs().sum().item<double>(), 0);
  state->reset();
  EXPECT_EQ(state->length, 0);
  EXPECT_EQ(st.S.abs().sum().item<double>(), 0);
}

TEST_P(LinearMixer, LongFp32SequenceStaysFinite) {
  auto c = GetParam();
  c.options["chunk_size"] = 64;
  auto m = make(c, torch::kFloat32);
  torch::NoGradGuard ng;
  auto x = random_x(1, 4096, torch::kFloat32);
  auto y = m->forward(x, {0, 0});
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  // The fp32 chunked path stays close to the float64 one over the whole sequence.
  auto m64 = make(c, torch::kFloat64);
  auto y64 = m64->forward(x.to(torch::kFloat64), {0, 0});
  EXPECT_LT(rel_err(y, y64), 1e-4);
}

TEST_P(LinearMixer, Bfloat16ModelKeepsAnFp32State) {
  // bf16 weights and activations (the GPU training dtype): gates, solves and the state stay fp32,
  // so forward, decode and the fp32 model agree to bf16 accuracy.
  auto m32 = make(GetParam(), torch::kFloat32);
  auto m16 = make(GetParam(), torch::kBFloat16);
  torch::NoGradGuard ng;
  const int64_t T = 12;
  auto x = random_x(2, T, torch::kFloat32);
  auto y32 = m32->forward(x, {0, 0});
  auto y16 = m16->forward(x.to(torch::kBFloat16), {0, 0});
  EXPECT_EQ(y16.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(y16, y32), 5e-2);
  auto state = m16->make_state(2, 16, torch::TensorOptions().dtype(torch::kBFloat16));
  EXPECT_EQ(dynamic_cast<RecurrentState&>(*state).S.scalar_type(), torch::kFloat32);
  std::vector<torch::Tensor> ys;
  for (int64_t t = 0; t < T; ++t) ys.push_back(m16->step(x.narrow(1, t, 1).to(torch::kBFloat16), {t, 0}, *state));
  EXPECT_LT(rel_err(torch::cat(ys, 1), y32), 5e-2);
}

TEST_P(LinearMixer, UnknownOptionIsRejected) {
  auto c = GetParam();
  c.options["no_such_option"] = 1;
  EXPECT_THROW(make_mixer(c.name, mixer_config(c), 0), lt2::Error);
}

INSTANTIATE_TEST_SUITE_P(
    Mixers, LinearMixer,
    ::testing::Values(
        MixerCase{"gdn", "gdn", {{"chunk_size", 8}}},
        MixerCase{"gdn_gva", "gdn", {{"chunk_size", 8}, {"num_heads", 2}, {"num_v_heads", 4}, {"head_dim", 8}}},
        MixerCase{"gdn_no_gate", "gdn", {{"chunk_size", 8}, {"use_gate", false}}},
        MixerCase{"kda", "kda", {{"chunk_size", 8}}},
        MixerCase{"kda_gva", "kda", {{"chunk_size", 8}, {"num_heads", 2}, {"num_v_heads", 4}}},
        MixerCase{"mamba2", "mamba2", {{"chunk_size", 8}, {"state_size", 8}}},
        MixerCase{"mamba2_groups", "mamba2", {{"chunk_size", 8}, {"state_size", 4}, {"n_groups", 2}}},
        MixerCase{"retnet", "retnet", {{"chunk_size", 8}}},
        MixerCase{"deltanet", "deltanet", {{"chunk_size", 8}}},
        MixerCase{"gla", "gla", {{"chunk_size", 8}}},
        MixerCase{"gla_conv", "gla", {{"chunk_size", 8}, {"use_short_conv", true}}},
        MixerCase{"hgrn2", "hgrn2", {{"chunk_size", 8}, {"num_heads", 2}}},
        MixerCase{"linear", "linear", {{"chunk_size", 8}}}),
    [](const auto& info) { return info.param.label; });

TEST(LinearMixers, AllRegistered) {
  for (const char* name : {"gdn", "kda", "mamba2", "retnet", "deltanet", "gla", "hgrn2", "linear"})
    EXPECT_TRUE(find_mixer(name)) << name;
}

TEST(LinearMixers, DefaultShapesFollowTheSpec) {
  ModelConfig cfg;
  cfg.d_model = 64;
  cfg.n_heads = 4;
  auto gdn = std::dynamic_pointer_cast<RecurrentMixerImpl>(make_mixer("gdn", cfg, 0));
  EXPECT_EQ(gdn->state_k, 12);  // 0.75 d / H
  EXPECT_EQ(gdn->state_v, 24);  // expand_v 2
  auto kda = std::dynamic_pointer_cast<RecurrentMixerImpl>(make_mixer("kda", cfg, 0));
  EXPECT_EQ(kda->state_k, 16);  // d / H
  EXPECT_EQ(kda->state_v, 16);  // expand_v 1
  auto mamba = std::dynamic_pointer_cast<RecurrentMixerImpl>(make_mixer("mamba2", cfg, 0));
  EXPECT_EQ(mamba->state_heads, 4);
  EXPECT_EQ(mamba->state_k, 64);  // state size
  EXPECT_EQ(mamba->state_v, 32);  // head dim 2 d / H
  auto names = gdn->named_parameters();
  for (const char* p : {"q_proj.weight", "A_log", "dt_bias", "q_conv1d.weight", "o_norm.weight", "g_proj.weight"})
    EXPECT_TRUE(names.contains(p)) << p;
}

}  // namespace
