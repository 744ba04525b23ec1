// Mamba2 / SSD (Dao and Gu 2024; state-spaces/mamba Mamba2; LT2: expand 2, state 64, conv 4,
// head dim 2d/H):
//   [z | xBC | dt] = x W_in                            z, x: d_inner = expand * d; B, C: G * N
//   x, B, C = split(SiLU(Conv1d(xBC) + conv bias))     x [B, T, H, P]; B, C [B, T, G, N]
//   dt = softplus(dt + dt_bias), A = -exp(A_log)       per head
//   h_t = exp(dt A) h_{t-1} + dt x_t B_t^T,  y_t = h_t C_t + D x_t
//       = the additive recurrence with q = C, k = B, v = dt x, g = dt A, scale 1 (heads of a
//         group share B and C); state stored as [B, H, N, P] (o = S^T q)
//   out = W_out( RMSNorm_group(y * silu(z)) * w )      norm over d_inner / G channels per group
// Options (cfg.mixer_options.mamba2): num_heads (cfg.n_heads), head_dim (expand * d / num_heads),
// expand (2), state_size (64), n_groups (1), conv_size (4), chunk_size (64).
#pragma once
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class Mamba2Impl : public RecurrentMixerImpl {
 public:
  explicit Mamba2Impl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  std::string kind() const override { return "mamba2"; }

  int64_t num_heads, head_dim, d_inner, state_size, n_groups;
  double norm_eps;
  torch::nn::Linear in_proj{nullptr}, out_proj{nullptr};
  ShortConv conv1d{nullptr};
  Tensor A_log, dt_bias, D;  // [H] each
  RMSNorm norm{nullptr};     // weight [d_inner]
};

}  // namespace lt2
