// One transformer block = token mixer + SwiGLU FFN.
//   pre-norm (LT2):       h = x + Mixer(mixer_norm(x));  out = h + FFN(ffn_norm(h))
//   sandwich (Ouro):      h = x + mixer_post_norm(Mixer(mixer_norm(x)));
//                         out = h + ffn_post_norm(FFN(ffn_norm(h)))
#pragma once
#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"
#include "lt2/model/layers.h"

namespace lt2 {

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& cfg, int64_t layer, const std::string& mixer_name);
  // x: [B, T, d]. With a state, runs the mixer's step (T == 1) or continues its forward.
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr);
  // The decode step (x [B, 1, d]): forward's result and, with `next` (the block after this one,
  // whose state is `next_state`), next's mixer input projections on it, computed in this block's
  // last chained kernel where both blocks have such forms (else undefined): pass them to next's
  // decode as `projections`, which its mixer then reads instead of running its own input projection.
  std::pair<Tensor, Tensor> decode(const Tensor& x, const Positions& pos, MixerState& state,
                                   const Tensor& projections = {}, const BlockImpl* next = nullptr,
                                   const MixerState* next_state = nullptr);

  Mixer mixer;
  SwiGLU ffn{nullptr};
  RMSNorm mixer_norm{nullptr}, ffn_norm{nullptr};
  RMSNorm mixer_post_norm{nullptr}, ffn_post_norm{nullptr};  // sandwich norm only

 private:
  Tensor forward_unfused(const Tensor& x, const Positions& pos, MixerState* state);
  // What the block before this one may compute for it (x: that block's input, shaped like its
  // output): its mixer's input projection (none for the sandwich norm, which Ouro's blocks decode
  // unfused).
  NextProjection input_projection(const Tensor& x, const Positions& pos, const MixerState& state) const;
};
TORCH_MODULE(Block);

}  // namespace lt2
