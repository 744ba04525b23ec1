// Shared test helpers: tiny configs, relative errors, and a float64 finite-difference gradient check.
#pragma once
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "common/errors.h"
#include "lt2/config/model_config.h"
#include "lt2/model/looped_lm.h"

namespace lt2::testing {

inline torch::TensorOptions f64() { return torch::TensorOptions().dtype(torch::kFloat64); }

// A tiny config for fast CPU tests.
inline ModelConfig tiny_config(const std::string& pattern = "full", ModelForm form = ModelForm::LT2) {
  ModelConfig c;
  c.name = "test-tiny";
  c.form = form;
  c.vocab_size = 61;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.n_loops = 3;
  c.ffn_hidden = 48;
  c.layer_pattern = pattern;
  c.max_seq_len = 64;
  if (form == ModelForm::Ouro) {
    c.loop_gate = false;
    c.exit_gate = true;
    c.attn_output_gate = false;
    c.rope_style = RopeStyle::Half;
    c.rope_theta = 1e6;
  }
  return c;
}

// Checks d(loss)/d(inputs) of a scalar function against central finite differences along
// `n_dirs` random directions (float64). Returns the largest relative error found.
inline double gradcheck_directional(const std::function<torch::Tensor()>& loss,
                                    const std::vector<torch::Tensor>& inputs, int n_dirs = 3,
                                    double eps = 1e-6) {
  for (auto& p : inputs)
    if (p.grad().defined()) p.grad().zero_();
  loss().backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : inputs) grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  double worst = 0;
  torch::NoGradGuard ng;
  for (int d = 0; d < n_dirs; ++d) {
    std::vector<torch::Tensor> dirs;
    double analytic = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      dirs.push_back(torch::randn_like(inputs[i]));
      analytic += (grads[i] * dirs[i]).sum().item<double>();
    }
    for (size_t i = 0; i < inputs.size(); ++i) inputs[i].add_(dirs[i], eps);
    double up = loss().item<double>();
    for (size_t i = 0; i < inputs.size(); ++i) inputs[i].add_(dirs[i], -2 * eps);
    double down = loss().item<double>();
    for (size_t i = 0; i < inputs.size(); ++i) inputs[i].add_(dirs[i], eps);
    double numeric = (up - down) / (2 * eps);
    worst = std::max(worst, std::abs(numeric - analytic) / std::max(std::abs(analytic), 1e-8));
  }
  return worst;
}

// A model of `cfg` in `dtype` whose zero-initialised gates (rho, the SDPA output gate, NSA's
// position terms) get random values, so the invariant tests exercise every path.
inline LoopedLM make_test_model(const ModelConfig& cfg, uint64_t seed = 1,
                                torch::ScalarType dtype = torch::kFloat64) {
  torch::manual_seed(seed);
  LoopedLM m(cfg);
  m->to(dtype);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())
    if (p.key() == "rho" || p.key().find("wgate") != std::string::npos || p.key().find("pos_") != std::string::npos)
      p.value().normal_(0, 0.3);
  return m;
}

inline torch::Tensor random_tokens(int64_t B, int64_t T, int64_t V, uint64_t seed = 7) {
  torch::manual_seed(seed);
  return torch::randint(V, {B, T}, torch::kLong);
}

// Model invariant: decoding `tokens` ([B, T]) one at a time from an empty state gives the logits
// of one full forward pass, for every loop's exit.
inline void expect_decode_matches_forward(LoopedLMImpl& m, const torch::Tensor& tokens, double tol = 1e-10) {
  torch::NoGradGuard ng;
  ForwardOptions all;
  all.loop_logits = true;
  auto full = m.forward(tokens, nullptr, all);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  auto state = m.make_state(B, T + 3, torch::TensorOptions().dtype(m.parameters().front().scalar_type()));
  for (int64_t t = 0; t < T; ++t) {
    auto o = m.forward(tokens.narrow(1, t, 1), state.get(), all);
    for (size_t l = 0; l < full.loop_logits.size(); ++l)
      EXPECT_LT(rel_err(o.loop_logits[l], full.loop_logits[l].narrow(1, t, 1)), tol)
          << "token " << t << " loop " << l;
    EXPECT_LT(rel_err(o.logits, full.logits.narrow(1, t, 1)), tol) << "token " << t;
  }
  EXPECT_EQ(state->length, T);
}

// Model invariant: a prefill split at each point of `splits` gives the logits of the whole one.
inline void expect_split_prefill_matches_whole(LoopedLMImpl& m, const torch::Tensor& tokens,
                                               const std::vector<int64_t>& splits, double tol = 1e-10) {
  torch::NoGradGuard ng;
  const int64_t B = tokens.size(0), T = tokens.size(1);
  auto full = m.forward(tokens).logits;
  for (int64_t a : splits) {
    auto state = m.make_state(B, T + 3, torch::TensorOptions().dtype(m.parameters().front().scalar_type()));
    auto first = m.forward(tokens.narrow(1, 0, a), state.get()).logits;
    auto second = m.forward(tokens.narrow(1, a, T - a), state.get()).logits;
    EXPECT_LT(rel_err(torch::cat({first, second}, 1), full), tol) << "split at " << a;
    state->reset();  // after a reset the state behaves as new
    EXPECT_LT(rel_err(m.forward(tokens, state.get()).logits, full), tol) << "after reset";
  }
}

// bf16 autocast on the CPU for a scope (the CUDA training regime's casts, testable here).
struct CpuAutocast {
  CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;
};

}  // namespace lt2::testing
