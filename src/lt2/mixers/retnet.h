// RetNet multi-scale retention (Sun et al. 2023; fla MultiScaleRetention defaults):
//   q, k = RoPE(x W_q|k)  (rotate-half, theta 1e4, over the key head dim)   [B, T, H, K]
//   v    = x W_v                                                           [B, T, H, V]
//   S_t  = gamma_h S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t K^-1/2,  gamma_h = 1 - 2^(-5-h)
//   out  = W_o( RMSNorm_head(o) * w * swish(x W_g) )
// Options (cfg.mixer_options.retnet): num_heads (cfg.n_heads), expand_k (1), expand_v (2),
// chunk_size (64).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class RetNetImpl : public RecurrentMixerImpl {
 public:
  explicit RetNetImpl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "retnet"; }
  std::vector<torch::nn::Linear> input_projections() const override { return {q_proj, k_proj, v_proj, g_proj}; }

  int64_t num_heads, head_k_dim, head_v_dim;
  double norm_eps;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, g_proj{nullptr}, o_proj{nullptr};
  RMSNorm g_norm_swish_gate{nullptr};
};

// gamma_h = 1 - 2^(-5-h) as the log-decay log(gamma_h), h = 0..H-1: [H] in dtype `dt`.
Tensor retention_log_decay(int64_t num_heads, torch::ScalarType dt, const torch::Device& device);

}  // namespace lt2
