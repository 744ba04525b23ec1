// AdamW with decoupled weight decay (none on norms, gains, biases, rho and SSM scalars), on
// PyTorch's fused multi-tensor kernel, plus the warm-up + cosine learning-rate schedule.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace lt2 {

using torch::Tensor;

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  // Each parameter's learning rate as a multiple of the step's (by parameter name); unset: 1 for all.
  std::function<double(const std::string& name)> lr_scale;
};

// True for parameters that take weight decay: matrices (dim >= 2) except the loop gate rho.
bool takes_weight_decay(const std::string& name, const Tensor& p);

class AdamW {
 public:
  AdamW(const std::vector<std::pair<std::string, Tensor>>& named_params, AdamWOptions opts);
  // One update with learning rate lr (times each parameter's lr_scale) from the parameters' current .grad.
  void step(double lr);
  void zero_grad();
  // Moments and step counts by parameter name ("exp_avg/<name>", "exp_avg_sq/<name>", "step/<name>").
  std::map<std::string, Tensor> state_dict() const;
  // Throws lt2::Error naming the missing or mismatched entry.
  void load_state_dict(const std::map<std::string, Tensor>& state);

 private:
  struct Group {
    double weight_decay, lr_scale;
    std::vector<std::string> names;
    std::vector<Tensor> params, exp_avg, exp_avg_sq, steps;
  };
  AdamWOptions opts_;
  std::vector<Group> groups_;
};

// Linear warm-up to lr over `warmup` steps, then cosine decay to lr * min_ratio at `total`.
double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio);

// Scales all gradients so their global L2 norm is at most max_norm (no-op when max_norm <= 0).
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);

}  // namespace lt2
