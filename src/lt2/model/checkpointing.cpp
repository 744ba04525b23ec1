#include "lt2/model/checkpointing.h"

#include "lt2/nn/precision.h"
#include "lt2/nn/recompute_phase.h"
#include "lt2/ops/decode_options.h"

namespace lt2 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FnHolder : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  AutocastState autocast;
  DecodeOptions kernel_options;  // the forward's kernel switches (thread-local, like autocast)
};

class Checkpoint : public torch::autograd::Function<Checkpoint> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, c10::intrusive_ptr<FnHolder> holder) {
    holder->autocast = AutocastState::current();
    holder->kernel_options = decode_options();
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    torch::NoGradGuard no_grad;
    RecomputePhaseScope phase(RecomputePhase::CheckpointForward);
    return holder->fn(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    // The forward's switches on autograd's thread, for the recomputation and the backward through it.
    const DecodeOptionsGuard kernel_options(holder->kernel_options);
    torch::Tensor y;
    {
      AutocastStateScope autocast(holder->autocast);  // the forward's, on autograd's thread
      torch::AutoGradMode enable(true);
      RecomputePhaseScope phase(RecomputePhase::Recompute);
      y = holder->fn(x);
    }
    torch::autograd::backward({y}, {grad_out[0]});
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor checkpointed(std::function<torch::Tensor(const torch::Tensor&)> fn, const torch::Tensor& x) {
  auto holder = c10::make_intrusive<FnHolder>();
  holder->fn = std::move(fn);
  return Checkpoint::apply(x, holder);
}

}  // namespace lt2
