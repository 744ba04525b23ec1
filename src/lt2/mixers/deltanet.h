// DeltaNet (fla DeltaNet; LT2: expand_k = expand_v = 1): the delta rule without decay,
//   q, k = L2norm(SiLU(ShortConv(x W_q|k))),  v = SiLU(ShortConv(x W_v))     [B, T, H, K|V]
//   beta = sigmoid(x W_b)  (x2 with allow_neg_eigval)                          [B, T, H]
//   S_t  = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t K^-1/2
//   out  = W_o( RMSNorm_head(o) * w )   (* swish(x W_g) with use_gate)
// Options (cfg.mixer_options.deltanet): num_heads (cfg.n_heads), expand_k (1), expand_v (1),
// conv_size (4), chunk_size (64), use_gate (false), allow_neg_eigval (false).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class DeltaNetImpl : public RecurrentMixerImpl {
 public:
  explicit DeltaNetImpl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "deltanet"; }
  std::vector<torch::nn::Linear> input_projections() const override;  // q, k, v, b(, g)

  int64_t num_heads, head_k_dim, head_v_dim;
  bool use_gate, allow_neg_eigval;
  double norm_eps;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, b_proj{nullptr},
      g_proj{nullptr}, o_proj{nullptr};
  ShortConv q_conv1d{nullptr}, k_conv1d{nullptr}, v_conv1d{nullptr};
  RMSNorm o_norm{nullptr};
};

}  // namespace lt2
