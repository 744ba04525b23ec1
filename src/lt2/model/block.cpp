#include "lt2/model/block.h"

#include "lt2/mixers/documents.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/norms/norms.h"

namespace lt2 {

BlockImpl::BlockImpl(const ModelConfig& cfg, int64_t layer, const std::string& mixer_name) {
  mixer = register_module("mixer", make_mixer(mixer_name, cfg, layer));
  ffn = register_module("ffn", SwiGLU(cfg.d_model, cfg.ffn_dim(), cfg.init_scale()));
  mixer_norm = register_module("mixer_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  ffn_norm = register_module("ffn_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  if (cfg.form == ModelForm::Ouro) {
    mixer_post_norm = register_module("mixer_post_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
    ffn_post_norm = register_module("ffn_post_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  }
}

Tensor BlockImpl::forward(const Tensor& x, const Positions& pos, MixerState* state, const MixerObserver& observe) {
  const auto out = forward_parts(x, Tensor(), pos, state, observe);
  return out.h + out.f;
}

BlockParts BlockImpl::forward_parts(const Tensor& x, const Tensor& pending, const Positions& pos, MixerState* state,
                                    const MixerObserver& observe) {
  // The norms before products hand their output over in the products' dtype where they can (an
  // observer sees the mixer's input as the block computes it otherwise: fp32 in training).
  const bool mixer_takes_products_dtype = mixer->caps().input_feeds_products && !observe;
  Tensor stream = x, xin;  // stream = x + pending
  if (pending.defined()) {
    auto r = ops::add_rms_norm(x, pending, mixer_norm, mixer_takes_products_dtype);
    stream = r.h, xin = r.y;
  } else {
    xin = mixer_takes_products_dtype ? ops::rms_norm_for_products(x, mixer_norm) : ops::rms_norm(x, mixer_norm);
  }
  Tensor m = (state && x.size(1) == 1) ? mixer->step(xin, pos, *state) : mixer_forward(*mixer, xin, pos, state);
  if (observe) observe(xin, m);
  if (mixer_post_norm) m = ops::rms_norm(m, mixer_post_norm);
  const auto [h, normed] = ops::add_rms_norm(stream, m, ffn_norm, /*for_products=*/true);  // h = stream + m, its norm
  auto f = ops::swiglu(*ffn, normed);
  if (ffn_post_norm) f = ops::rms_norm(f, ffn_post_norm);
  return {h, f};
}

}  // namespace lt2
