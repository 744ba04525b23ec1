#include "lt2/distill/losses.h"

#include <cmath>
#include <set>

namespace lt2::distill {

Tensor alignment_loss(LoopedLMImpl& teacher, LoopedLMImpl& student, const Tensor& tokens,
                      const std::vector<int64_t>& layers) {
  LT2_CHECK(!layers.empty(), "alignment: no layer to align (every full-attention layer is kept)");
  const std::set<int64_t> aligned(layers.begin(), layers.end());
  struct Pair {
    int64_t layer, loop;
    Tensor input, output;  // [B, T, d] each
  };
  std::vector<Pair> pairs;
  {
    torch::NoGradGuard ng;
    ForwardOptions fo;
    fo.compute_logits = false;
    fo.mixer_tap = [&](int64_t layer, int64_t loop, const Tensor& in, const Tensor& out) {
      if (aligned.count(layer)) pairs.push_back({layer, loop, in, out});
    };
    teacher.forward(tokens, nullptr, fo);
  }
  const auto mixers = student.mixers();
  const double d = static_cast<double>(student.config().d_model);
  Tensor total;
  for (const auto& p : pairs) {
    const Tensor o = mixers[p.layer]->forward(p.input, Positions(0, p.loop));
    const auto diff = o.to(accum_dtype(o)) - p.output.to(accum_dtype(o));          // [B, T, d]
    const auto per_token = diff.pow(2).sum(-1).sqrt() / std::sqrt(d);              // [B, T]
    total = total.defined() ? total + per_token.mean() : per_token.mean();
  }
  return total / static_cast<double>(pairs.size());
}

std::vector<double> loop_weights(const ModelConfig& cfg, const std::vector<double>& configured) {
  const int64_t T = cfg.n_loops;
  std::vector<double> w(T, 0.0);
  if (!configured.empty()) {
    LT2_CHECK(static_cast<int64_t>(configured.size()) == T, "distill: loop_weights has ", configured.size(),
              " entries but the model has ", T, " loops (one weight per loop)");
    w = configured;
  } else if (cfg.form == ModelForm::Ouro) {
    for (int64_t t = 0; t < T; ++t) w[t] = static_cast<double>(t + 1);
  } else {
    w[T - 1] = 1.0;
  }
  double sum = 0;
  for (double x : w) {
    LT2_CHECK(x >= 0 && std::isfinite(x), "distill: loop weights must be finite and >= 0, found ", x);
    sum += x;
  }
  LT2_CHECK(sum > 0, "distill: loop weights are all 0; at least one loop must be supervised");
  for (double& x : w) x /= sum;
  return w;
}

Tensor kd_loss(LoopedLMImpl& teacher, LoopedLMImpl& student, const Tensor& tokens, const std::vector<double>& weights,
               const ops::HeadLossOptions& head, bool checkpoint_loops, int64_t stored_loops,
               int64_t partial_loop_layers) {
  const int64_t T = student.config().n_loops;
  LT2_CHECK(static_cast<int64_t>(weights.size()) == T, "distill: ", weights.size(), " loop weights for ", T,
            " loops");
  ForwardOptions fo;
  fo.compute_logits = false;
  fo.loop_hidden = true;
  ModelOutput t_out;
  {
    torch::NoGradGuard ng;
    t_out = teacher.forward(tokens, nullptr, fo);
  }
  fo.checkpoint_loops = checkpoint_loops;
  fo.stored_loops = stored_loops;
  fo.partial_loop_layers = partial_loop_layers;
  const auto s_out = student.forward(tokens, nullptr, fo);
  Tensor total;
  for (int64_t t = 0; t < T; ++t) {
    if (weights[t] == 0) continue;
    const auto& hs = s_out.loop_hidden[t];  // [B, T, d]
    const auto& ht = t_out.loop_hidden[t];  // [B, T, d]
    const auto kl = ops::lm_head_loss(hs.reshape({-1, hs.size(-1)}), student.head_weight(),
                                      ops::TeacherHead(ht.reshape({-1, ht.size(-1)}), teacher.head_weight()), head)
                        .mean();
    total = total.defined() ? total + weights[t] * kl : weights[t] * kl;
  }
  return total;
}

}  // namespace lt2::distill
