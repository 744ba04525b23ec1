#include "lt2/train/optimizer.h"

#include <ATen/ATen.h>

#include <cmath>

#include "lt2/util/error.h"

namespace lt2 {

bool takes_weight_decay(const std::string& name, const Tensor& p) {
  return p.dim() >= 2 && name != "rho";
}

AdamW::AdamW(const std::vector<std::pair<std::string, Tensor>>& named_params, AdamWOptions opts)
    : opts_(opts) {
  // One group per (weight decay, learning-rate scale), in order of first appearance.
  auto group_of = [this](double decay, double scale) -> Group& {
    for (auto& g : groups_)
      if (g.weight_decay == decay && g.lr_scale == scale) return g;
    groups_.push_back(Group{decay, scale, {}, {}, {}, {}, {}});
    return groups_.back();
  };
  for (const auto& [name, p] : named_params) {
    if (!p.requires_grad()) continue;
    const double scale = opts.lr_scale ? opts.lr_scale(name) : 1.0;
    LT2_CHECK(scale >= 0 && std::isfinite(scale), "AdamW: learning-rate scale of '", name,
              "' must be finite and >= 0, found ", scale);
    Group& g = group_of(takes_weight_decay(name, p) ? opts.weight_decay : 0.0, scale);
    g.names.push_back(name);
    g.params.push_back(p);
    g.exp_avg.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    g.exp_avg_sq.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    g.steps.push_back(torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(p.device())));
  }
}

void AdamW::step(double lr) {
  torch::NoGradGuard ng;
  for (auto& g : groups_) {
    std::vector<Tensor> params, grads, m, v, steps;
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (!g.params[i].grad().defined()) continue;  // unused this step (e.g. a frozen branch)
      params.push_back(g.params[i]);
      grads.push_back(g.params[i].grad());
      m.push_back(g.exp_avg[i]);
      v.push_back(g.exp_avg_sq[i]);
      steps.push_back(g.steps[i]);
    }
    if (params.empty()) continue;
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(params, grads, m, v, {}, steps, lr * g.lr_scale, opts_.beta1, opts_.beta2, g.weight_decay,
                      opts_.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
}

void AdamW::zero_grad() {
  for (auto& g : groups_)
    for (auto& p : g.params)
      if (p.grad().defined()) p.mutable_grad() = Tensor();
}

std::map<std::string, Tensor> AdamW::state_dict() const {
  std::map<std::string, Tensor> s;
  for (const auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      s["exp_avg/" + g.names[i]] = g.exp_avg[i];
      s["exp_avg_sq/" + g.names[i]] = g.exp_avg_sq[i];
      s["step/" + g.names[i]] = g.steps[i];
    }
  return s;
}

void AdamW::load_state_dict(const std::map<std::string, Tensor>& state) {
  torch::NoGradGuard ng;
  auto load = [&](const std::string& key, Tensor& dst) {
    auto it = state.find(key);
    LT2_CHECK(it != state.end(), "optimizer state: missing '", key, "'");
    LT2_CHECK(it->second.sizes() == dst.sizes(), "optimizer state: '", key, "' has shape ",
              it->second.sizes(), ", expected ", dst.sizes());
    dst.copy_(it->second);
  };
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      load("exp_avg/" + g.names[i], g.exp_avg[i]);
      load("exp_avg_sq/" + g.names[i], g.exp_avg_sq[i]);
      load("step/" + g.names[i], g.steps[i]);
    }
}

double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio) {
  if (warmup > 0 && step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = std::max<int64_t>(1, total - warmup);
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  std::vector<Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  auto norms = at::_foreach_norm(grads, 2);
  auto total = torch::stack(norms).to(torch::kFloat32).norm();
  const double norm = total.item<double>();
  if (max_norm > 0 && norm > max_norm) {
    torch::NoGradGuard ng;
    at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  }
  return norm;
}

}  // namespace lt2
