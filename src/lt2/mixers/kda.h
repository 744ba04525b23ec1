// Kimi Delta Attention (Kimi Linear; fla KimiDeltaAttention; LT2: head dim d/H, expand_v 1):
//   q, k = L2norm(SiLU(ShortConv(x W_q|k)))                      [B, T, H, K]
//   v    = SiLU(ShortConv(x W_v))                                 [B, T, HV, V]
//   g    = -exp(A_log[h]) * softplus(f_proj(x) + dt_bias[h, :])   [B, T, HV, K] per-channel log-decay,
//          f_proj low rank d -> V -> HV*K
//   beta = sigmoid(x W_b)  (x2 with allow_neg_eigval)             [B, T, HV]
//   o    = gated delta rule with per-key-channel decay (scale K^-1/2)
//   out  = W_o( RMSNorm_head(o) * w * sigmoid(g_proj(x)) ),  g_proj low rank d -> V -> HV*V (+bias)
// Options (cfg.mixer_options.kda): num_heads (cfg.n_heads), head_dim (d / H), num_v_heads
// (num_heads), expand_v (1), conv_size (4), chunk_size (64), allow_neg_eigval (false).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class KimiDeltaAttentionImpl : public RecurrentMixerImpl {
 public:
  explicit KimiDeltaAttentionImpl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "kda"; }
  std::vector<torch::nn::Linear> input_projections() const override;  // q, k, v, f's and g's first layers, b

  int64_t num_heads, num_v_heads, head_k_dim, head_v_dim;
  bool allow_neg_eigval;
  double norm_eps;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, b_proj{nullptr}, o_proj{nullptr};
  torch::nn::Sequential f_proj{nullptr}, g_proj{nullptr};  // low rank: d -> V -> ...
  ShortConv q_conv1d{nullptr}, k_conv1d{nullptr}, v_conv1d{nullptr};
  Tensor A_log;    // [HV]
  Tensor dt_bias;  // [HV * K]
  RMSNorm o_norm{nullptr};
};

}  // namespace lt2
