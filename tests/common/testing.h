// Shared test helpers: tiny configs, relative errors, and a float64 finite-difference gradient check.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "lt2/config/model_config.h"

namespace lt2::testing {

// ||a - b|| / max(||b||, tiny), in float64.
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return (a64 - b64).norm().item<double>() / std::max(b64.norm().item<double>(), 1e-300);
}

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

}  // namespace lt2::testing
