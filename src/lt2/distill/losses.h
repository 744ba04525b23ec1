// The distillation losses (spec/models.md §4).
//   alignment (stage 1): the teacher runs; every student mixer of `layers` sees the input the
//     teacher's attention saw in each (layer, loop) and is scored by the per-token output error
//     ||o_teacher - o_student||_2 * d^-1/2, averaged over tokens, layers and loops.
//   logit distillation (stage 2): KL(p_teacher || p_student) over next-token distributions, per
//     loop exit against the teacher's same loop, weighted by a schedule; chunked over the tokens
//     through the fused head loss (ops/loss/lm_head_loss.h: TeacherHead), so neither model's
//     [tokens x vocab] logits exist whole.
#pragma once
#include <vector>

#include "lt2/model/looped_lm.h"
#include "lt2/ops/loss/lm_head_loss.h"

namespace lt2::distill {

// Mean per-token RMS output error of the student's mixers of `layers` against the teacher's
// attention on the same inputs, over tokens, layers and loops. tokens: [B, T] int64. Gradients
// reach only the student's mixers of `layers`.
Tensor alignment_loss(LoopedLMImpl& teacher, LoopedLMImpl& student, const Tensor& tokens,
                      const std::vector<int64_t>& layers);

// The per-loop weights of the logit distillation for a model of `n_loops` loops: `configured`
// (one per loop, >= 0, not all 0) when given, else linearly rising (1, 2, ..., T) for the Ouro
// form, whose every loop exit decodes, and the last loop alone for the LT2 form. Normalised to
// sum to 1.
std::vector<double> loop_weights(const ModelConfig& cfg, const std::vector<double>& configured);

// sum_t w_t KL_t, KL_t the mean over tokens of KL(teacher's loop t || student's loop t); loops of
// weight 0 are not scored. tokens: [B, T] int64. checkpoint_loops: the student's forward recomputes
// each loop but the last stored_loops in backward, but for the last partial_loop_layers layers of
// the loop before them (ForwardOptions).
Tensor kd_loss(LoopedLMImpl& teacher, LoopedLMImpl& student, const Tensor& tokens, const std::vector<double>& weights,
               const ops::HeadLossOptions& head = {}, bool checkpoint_loops = false, int64_t stored_loops = 1,
               int64_t partial_loop_layers = 0);

}  // namespace lt2::distill
