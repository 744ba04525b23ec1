// Gated Linear Attention (fla GatedLinearAttention defaults):
//   q = x W_q, k = x W_k  [B, T, H, K] (K = expand_k d / H),  v = x W_v  [B, T, H, V]
//   g = logsigmoid(gk_proj(x)) / gate_logit_normalizer          [B, T, H, K] per-channel log-decay,
//       gk_proj low rank d -> gate_low_rank_dim -> H*K (+bias)
//   S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t K^-1/2
//   out = W_o( RMSNorm_head(o) * w * swish(x W_g) )
// Options (cfg.mixer_options.gla): num_heads (cfg.n_heads), expand_k (0.5), expand_v (1),
// gate_low_rank_dim (16), gate_logit_normalizer (16), use_short_conv (false), conv_size (4),
// chunk_size (64).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class GatedLinearAttentionImpl : public RecurrentMixerImpl {
 public:
  explicit GatedLinearAttentionImpl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "gla"; }
  std::vector<torch::nn::Linear> input_projections() const override;  // q, k, v, g, gk's first layer

  int64_t num_heads, head_k_dim, head_v_dim;
  double gate_logit_normalizer, norm_eps;
  bool use_short_conv;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, g_proj{nullptr}, o_proj{nullptr};
  torch::nn::Sequential gk_proj{nullptr};
  ShortConv q_conv1d{nullptr}, k_conv1d{nullptr}, v_conv1d{nullptr};
  RMSNorm g_norm_swish_gate{nullptr};
};

}  // namespace lt2
