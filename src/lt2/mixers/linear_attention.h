// Plain linear attention (Katharopoulos et al.; fla LinearAttention without normalisation):
//   q, k = phi(x W_q|k)  [B, T, H, K],  v = x W_v  [B, T, H, V],  phi(x) = elu(x) + 1
//   S_t = S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t K^-1/2      (no decay, no denominator)
//   out = W_o( RMSNorm_head(o) * w )
// fla's layer defaults to a learned Hadamard feature map; lt2 takes the original elu + 1, the
// feature map the "linear attention" name refers to.
// Options (cfg.mixer_options.linear): num_heads (cfg.n_heads), expand_k (1), expand_v (1),
// chunk_size (64).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class LinearAttentionImpl : public RecurrentMixerImpl {
 public:
  explicit LinearAttentionImpl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "linear"; }
  std::vector<torch::nn::Linear> input_projections() const override { return {q_proj, k_proj, v_proj}; }

  int64_t num_heads, head_k_dim, head_v_dim;
  double norm_eps;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm norm{nullptr};
};

}  // namespace lt2
