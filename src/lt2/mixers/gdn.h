// Gated DeltaNet (Yang et al. 2024; fla GatedDeltaNet; the LT2 paper's settings):
//   q, k = L2norm(SiLU(ShortConv(x W_q|k)))             [B, T, H, K]
//   v    = SiLU(ShortConv(x W_v))                        [B, T, HV, V], V = K * expand_v
//   g    = -exp(A_log) * softplus(x W_a + dt_bias)       [B, T, HV] log-decay
//   beta = sigmoid(x W_b)  (x2 with allow_neg_eigval)    [B, T, HV]
//   o    = gated delta rule (scale K^-1/2), value head i reads q/k head i / (HV/H)
//   out  = W_o( RMSNorm_head(o) * w * swish(x W_g) )      (plain RMSNorm when use_gate is off)
// Options (cfg.mixer_options.gdn): num_heads (cfg.n_heads), head_dim (0.75 d / H), num_v_heads
// (num_heads), expand_v (2), conv_size (4), chunk_size (64), use_gate (true), allow_neg_eigval (false).
#pragma once
#include <cmath>

#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

class GatedDeltaNetImpl : public RecurrentMixerImpl {
 public:
  explicit GatedDeltaNetImpl(const ModelConfig& cfg);
  RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) override;
  Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) override;
  // On CUDA with the fused decode switch on and one value head per q/k head: the projections,
  // then the whole recurrent step in one kernel (ops::gdn_decode_fused), then o_proj. Otherwise
  // the reference step.
  Tensor step(const Tensor& x, const Positions& pos, MixerState& state) override;
  // The same fused step as a descriptor once packed: w_in, then the one-kernel step, then o_proj.
  std::optional<DecodeDescriptor> decode_descriptor(MixerState& state, int64_t batch) override;
  std::string kind() const override { return "gdn"; }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(head_k_dim)); }  // K^-1/2

  int64_t num_heads, num_v_heads, head_k_dim, head_v_dim;
  bool use_gate, allow_neg_eigval;
  double norm_eps;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, a_proj{nullptr},
      b_proj{nullptr}, g_proj{nullptr}, o_proj{nullptr};
  ShortConv q_conv1d{nullptr}, k_conv1d{nullptr}, v_conv1d{nullptr};
  Tensor A_log, dt_bias;  // [HV] each
  RMSNorm o_norm{nullptr};

 private:
  std::vector<torch::nn::Linear> input_projections() const override;  // q, k, v(, g), a, b
  size_t a_part_index() const { return use_gate ? 4 : 3; }  // a's index among them; b's is the next
  // The state when the fused step (one kernel after the projections) takes x, else nullptr.
  RecurrentState* fused_state(const Tensor& x, MixerState& state) const;
  // The fused step on x's projections (q, k, v(, g), a, b, each [B, channels], in
  // input_projections() order); returns y, the gated-normed output [B, H*V] ready for o_proj.
  Tensor fused_core(const std::vector<Tensor>& projections, const Positions& pos, RecurrentState& st);
};

}  // namespace lt2
