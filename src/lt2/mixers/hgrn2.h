// HGRN2 (fla HGRN2Attention defaults): gated linear attention whose key is tied to the forget gate,
//   q = swish(x W_q), f = x W_f   [B, T, H, F] (F = expand_ratio),   i = x W_i   [B, T, H, d/H]
//   g = logsigmoid(f) (per-channel log-decay),  k = 1 - exp(g)
//   S_t = Diag(exp(g_t)) S_{t-1} + k_t i_t^T,  o_t = S_t^T q_t F^-1/2
//   out = W_o( RMSNorm(o over all d channels) * w )
// Options (cfg.mixer_options.hgrn2): num_heads (d / 128, at least 1), chunk_size (64);
// expand_ratio = d / num_heads (fla's default expand_ratio 128).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class HGRN2Impl : public RecurrentMixerImpl {
 public:
  explicit HGRN2Impl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "hgrn2"; }
  std::vector<torch::nn::Linear> input_projections() const override { return {q_proj, f_proj, i_proj}; }

  int64_t num_heads, expand_ratio, head_i_dim;
  double norm_eps;
  torch::nn::Linear q_proj{nullptr}, f_proj{nullptr}, i_proj{nullptr}, o_proj{nullptr};
  RMSNorm g_norm{nullptr};
};

}  // namespace lt2
