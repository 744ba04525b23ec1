// What the linear-time (recurrent) mixers share beyond the mixer contract, over every registered
// recurrent mixer and its option variants (mixer_testing.h; the contract's invariants run in
// test_mixer_invariants.cpp): the state's start must match the call's position, gate ranges, state
// size and reset, long fp32 sequences, bf16 models with fp32 states, unknown options rejected;
// the default head shapes of the spec.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/mixers/registry.h"
#include "mixers/mixer_testing.h"

namespace {

using namespace lt2;
using lt2::testing::MixerVariant;
using lt2::testing::f64;
using lt2::testing::rel_err;

ModelConfig mixer_config(const MixerVariant& c) {
  ModelConfig cfg;
  cfg.d_model = 32;
  cfg.n_heads = 4;
  cfg.mixer_options = json::object();
  cfg.mixer_options[c.name] = c.options;
  return cfg;
}

std::shared_ptr<RecurrentMixerImpl> make(const MixerVariant& c, torch::ScalarType dt, uint64_t seed = 0) {
  torch::manual_seed(seed);
  auto m = std::dynamic_pointer_cast<RecurrentMixerImpl>(make_mixer(c.name, mixer_config(c), 0));
  EXPECT_TRUE(m) << c.name << " is not a recurrent mixer";
  m->to(dt);
  return m;
}

torch::Tensor random_x_in(int64_t B, int64_t T, torch::ScalarType dt, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return torch::randn({B, T, 32}, torch::TensorOptions().dtype(dt));
}

class LinearMixer : public ::testing::TestWithParam<MixerVariant> {
 protected:
  // Tiny shapes: one intra-op thread. Under `ctest -j` on 2 cores, OpenMP's spinning threads
  // slow these tests down ~20x.
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(LinearMixer, StateStartMustMatchPosition) {
  auto m = make(GetParam(), torch::kFloat64);
  auto state = m->make_state(1, 16, f64());
  EXPECT_THROW(m->forward(random_x_in(1, 3, torch::kFloat64), {2, 0}, state.get()), lt2::Error);
}

TEST_P(LinearMixer, GateRanges) {
  auto m = make(GetParam(), torch::kFloat64);
  torch::NoGradGuard ng;
  auto in = m->project(3.0 * random_x_in(2, 30, torch::kFloat64), nullptr, 0);
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
  m->forward(random_x_in(3, 5, torch::kFloat32), {0, 0}, state.get());
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
  auto x = random_x_in(1, 4096, torch::kFloat32);
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
  auto x = random_x_in(2, T, torch::kFloat32);
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

INSTANTIATE_TEST_SUITE_P(Registered, LinearMixer, ::testing::ValuesIn(lt2::testing::recurrent_variants()),
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
