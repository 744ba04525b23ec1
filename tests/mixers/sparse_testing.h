// Helpers shared by the sparse-attention mixer tests (window, dsa, nsa, patterns).
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/mixers/registry.h"

namespace lt2::sparse_testing {

using lt2::testing::rel_err;

using lt2::testing::f64;

// A tiny attention config: d 32, 4 query heads over 2 KV heads (GQA), head dim 8, 3 loops.
inline ModelConfig attention_config(const std::string& mixer, const json& options) {
  auto cfg = lt2::testing::tiny_config(mixer);
  cfg.mixer_options[mixer] = options;
  return cfg;
}

// A float64 mixer whose zero-initialised gates (SDPA output gate, NSA branch gates, position
// embeddings) are given random values so every path is exercised.
inline Mixer make_f64(const std::string& name, const ModelConfig& cfg, uint64_t seed = 5) {
  torch::manual_seed(seed);
  auto m = make_mixer(name, cfg, 0);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters()) {
    const auto& k = p.key();
    if (k.find("wgate") != std::string::npos || k.find("wg.") != std::string::npos ||
        k.find("pos_") != std::string::npos)
      p.value().normal_(0, 0.5);
  }
  return m;
}

inline torch::Tensor random_x(int64_t B, int64_t T, int64_t d, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return torch::randn({B, T, d}, f64());
}

// forward over x == step token by token from an empty state (loop `loop`).
inline void expect_forward_equals_steps(MixerImpl& m, const torch::Tensor& x, int64_t loop = 0,
                                        double tol = 1e-10) {
  torch::NoGradGuard ng;
  auto whole = m.forward(x, {0, loop});
  auto state = m.make_state(x.size(0), x.size(1) + 3, f64(), {loop});
  for (int64_t t = 0; t < x.size(1); ++t) {
    auto o = m.step(x.narrow(1, t, 1), {t, loop}, *state);
    EXPECT_LT(rel_err(o, whole.narrow(1, t, 1)), tol) << "token " << t << " loop " << loop;
  }
  EXPECT_EQ(state->length, x.size(1));
}

// forward(x[:a]) then forward(x[a:]) with a state == forward(x), for every split in `splits`; also
// three chunks [0, a), [a, b), [b, T) for consecutive splits.
inline void expect_split_prefill(MixerImpl& m, const torch::Tensor& x, const std::vector<int64_t>& splits,
                                 int64_t loop = 0, double tol = 1e-10) {
  torch::NoGradGuard ng;
  const int64_t T = x.size(1);
  auto whole = m.forward(x, {0, loop});
  for (int64_t a : splits) {
    auto state = m.make_state(x.size(0), T + 2, f64(), {loop});
    auto first = m.forward(x.narrow(1, 0, a), {0, loop}, state.get());
    auto second = m.forward(x.narrow(1, a, T - a), {a, loop}, state.get());
    EXPECT_LT(rel_err(torch::cat({first, second}, 1), whole), tol) << "split at " << a;
    // After reset the state behaves as new.
    state->reset();
    EXPECT_LT(rel_err(m.forward(x, {0, loop}, state.get()), whole), tol) << "after reset";
  }
  for (size_t i = 0; i + 1 < splits.size(); ++i) {
    const int64_t a = splits[i], b = splits[i + 1];
    auto state = m.make_state(x.size(0), T, f64(), {loop});
    std::vector<torch::Tensor> parts = {m.forward(x.narrow(1, 0, a), {0, loop}, state.get()),
                                        m.forward(x.narrow(1, a, b - a), {a, loop}, state.get()),
                                        m.forward(x.narrow(1, b, T - b), {b, loop}, state.get())};
    EXPECT_LT(rel_err(torch::cat(parts, 1), whole), tol) << "chunks at " << a << ", " << b;
  }
}

// Float64 finite-difference check of d/d(x, params) of a random projection of the output.
inline double gradcheck_mixer(MixerImpl& m, const torch::Tensor& x_in, int64_t loop = 0,
                              const std::vector<std::string>& skip_params = {}) {
  auto x = x_in.clone().requires_grad_(true);
  torch::manual_seed(9);
  auto probe = torch::randn_like(m.forward(x.detach(), {0, loop}));
  std::vector<torch::Tensor> inputs = {x};
  for (auto& p : m.named_parameters()) {
    bool skip = false;
    for (auto& s : skip_params) skip = skip || p.key().find(s) != std::string::npos;
    if (!skip) inputs.push_back(p.value());
  }
  return lt2::testing::gradcheck_directional([&] { return (m.forward(x, {0, loop}) * probe).sum(); },
                                             inputs);
}

// Copies every parameter of `from` into the parameter of `to` named prefix + its name.
inline void copy_params(torch::nn::Module& from, torch::nn::Module& to, const std::string& prefix = "") {
  torch::NoGradGuard ng;
  auto dst = to.named_parameters();
  for (auto& p : from.named_parameters()) {
    auto* t = dst.find(prefix + p.key());
    ASSERT_NE(t, nullptr) << "no parameter " << prefix + p.key();
    t->copy_(p.value());
  }
}

}  // namespace lt2::sparse_testing
