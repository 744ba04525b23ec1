// Finite-difference gradient check of a function of tensors, shared by the op and mixer tests
// (libtorch's C++ API has no gradcheck). Relative errors: common/testing.h.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "common/testing.h"

namespace lt2::testing {

using torch::Tensor;

// Compares autograd's gradient of a float64 function with central differences (eps 1e-6).
// The function's output is reduced to a scalar by a fixed random projection R:
// L(x) = sum(f(x) * R). Checks (1) the directional derivative along `n_directions` random
// directions over all inputs together and (2) `n_coords` random coordinates of every input.
// Every input must be float64; they are taken as they are and given requires_grad.
inline void expect_gradients_match(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                   std::vector<Tensor> inputs, double tol = 1e-6,
                                   int n_directions = 3, int n_coords = 4, double eps = 1e-6) {
  torch::manual_seed(1234);
  for (auto& x : inputs) x = x.detach().clone().set_requires_grad(true);
  auto out = f(inputs);
  auto R = torch::randn_like(out);
  auto loss = [&](const std::vector<Tensor>& xs) {
    torch::NoGradGuard ng;
    return (f(xs) * R).sum().item<double>();
  };
  auto grads = torch::autograd::grad({(out * R).sum()}, inputs, {}, false, false, true);
  std::vector<Tensor> base;
  for (auto& x : inputs) base.push_back(x.detach());
  for (size_t i = 0; i < grads.size(); ++i)
    if (!grads[i].defined()) grads[i] = torch::zeros_like(base[i]);

  for (int d = 0; d < n_directions; ++d) {
    std::vector<Tensor> dirs, plus, minus;
    double analytic = 0;
    for (size_t i = 0; i < base.size(); ++i) {
      dirs.push_back(torch::randn_like(base[i]));
      analytic += (grads[i] * dirs[i]).sum().item<double>();
      plus.push_back(base[i] + eps * dirs[i]);
      minus.push_back(base[i] - eps * dirs[i]);
    }
    const double numeric = (loss(plus) - loss(minus)) / (2 * eps);
    EXPECT_NEAR(analytic, numeric, tol * std::max(1.0, std::abs(numeric)))
        << "directional derivative " << d;
  }
  for (size_t i = 0; i < base.size(); ++i) {
    const double gmax = grads[i].abs().max().item<double>();
    for (int c = 0; c < n_coords; ++c) {
      const int64_t idx = torch::randint(base[i].numel(), {1}).item<int64_t>();
      auto plus = base, minus = base;
      plus[i] = base[i].clone();
      minus[i] = base[i].clone();
      plus[i].view(-1)[idx] += eps;
      minus[i].view(-1)[idx] -= eps;
      const double numeric = (loss(plus) - loss(minus)) / (2 * eps);
      const double analytic = grads[i].reshape(-1)[idx].item<double>();
      EXPECT_NEAR(analytic, numeric, tol * std::max(1.0, gmax))
          << "input " << i << " coordinate " << idx;
    }
  }
}

}  // namespace lt2::testing
