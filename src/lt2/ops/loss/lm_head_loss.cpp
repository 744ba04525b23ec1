#include "lt2/ops/loss/lm_head_loss.h"

#include "lt2/kernels/prefill.h"  // cross_entropy_forward
#include "lt2/nn/precision.h"  // product_dtype
#include "lt2/ops/chunking.h"  // Fp32Scope
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace lt2::ops {

namespace {

using torch::ScalarType;

bool reduced_precision(ScalarType t) { return t == torch::kBFloat16 || t == torch::kHalf; }

// a b in the dtype `out`: on CUDA, reduced-precision operands go through one GEMM with an fp32
// result (cuBLAS accumulates in fp32 either way); elsewhere the product in the operands' dtype,
// converted.
Tensor product(const Tensor& a, const Tensor& b, ScalarType out) {
  if (a.scalar_type() == out) return at::mm(a, b);
  if (a.is_cuda() && out == torch::kFloat32 && reduced_precision(a.scalar_type())) return at::mm(a, b, out);
  return at::mm(a, b).to(out);
}

// acc += a b in acc's dtype: on CUDA, reduced-precision operands add into an fp32 acc in the GEMM's
// epilogue (no [V, d] temporary per chunk).
void add_product(Tensor& acc, const Tensor& a, const Tensor& b) {
  if (a.scalar_type() == acc.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.is_cuda() && acc.scalar_type() == torch::kFloat32 && reduced_precision(a.scalar_type())) {
    at::addmm_out(acc, acc, a, b, torch::kFloat32);
  } else {
    acc.add_(at::mm(a, b));
  }
}

struct WalkResult {
  Tensor sum;       // 0-dim, the logits' dtype
  Tensor d_hidden;  // [N, d] in hidden's dtype, undefined unless asked for
  Tensor d_weight;  // [V, d] in weight's dtype, undefined unless asked for
};

// The chunk walk (the file comment of lm_head_loss.h): the summed loss and, where asked for, its
// gradients w.r.t. hidden [N, d] and weight [V, d].
WalkResult walk(const Tensor& hidden, const Tensor& weight, const HeadLossTarget& target, ScalarType compute,
                int64_t chunk, bool want_d_hidden, bool want_d_weight) {
  Fp32Scope no_autocast;  // the dtypes are chosen here; autocast must not re-cast the products
  const int64_t N = hidden.size(0);
  const auto logit_dtype = compute == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto w = weight.to(compute);  // [V, d]
  WalkResult r;
  r.sum = torch::zeros({}, hidden.options().dtype(logit_dtype));
  if (want_d_hidden) r.d_hidden = torch::empty(hidden.sizes(), hidden.options());
  if (want_d_weight) r.d_weight = torch::zeros(weight.sizes(), weight.options());
  const bool want_grad = want_d_hidden || want_d_weight;
  for (int64_t begin = 0; begin < N; begin += chunk) {
    const int64_t n = std::min(chunk, N - begin);
    const auto h = hidden.narrow(0, begin, n).to(compute);  // [n, d]
    auto scored = target.score(product(h, w.t(), logit_dtype), begin,
                               want_grad ? std::optional<ScalarType>(compute) : std::nullopt);
    r.sum.add_(scored.loss);
    if (want_d_hidden) r.d_hidden.narrow(0, begin, n).copy_(product(scored.grad, w, hidden.scalar_type()));
    if (want_d_weight) add_product(r.d_weight, scored.grad.t(), h);
  }
  return r;
}

// The walk as an autograd function: forward walks and keeps the gradients, backward scales them.
struct HeadLossFunction : torch::autograd::Function<HeadLossFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                        const HeadLossTarget* target, ScalarType compute, int64_t chunk, bool grad_mode) {
    auto r = walk(hidden, weight, *target, compute, chunk, grad_mode && hidden.requires_grad(),
                  grad_mode && weight.requires_grad());
    ctx->save_for_backward({r.d_hidden, r.d_weight});
    return r.sum;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_sum) {
    const auto saved = ctx->get_saved_variables();
    const auto& g = grad_sum[0];  // 0-dim, the logits' dtype
    // Scaled in g's dtype, so a reduced-precision gradient is rounded once.
    auto scaled = [&g](const Tensor& d) { return d.defined() ? (d.to(g.scalar_type()) * g).to(d.scalar_type()) : Tensor(); };
    return {scaled(saved[0]), scaled(saved[1]), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

HardLabels::HardLabels(Tensor labels, int64_t vocab, int64_t ignore_index)
    : labels_(std::move(labels)), vocab_(vocab), ignore_index_(ignore_index) {
  LT2_CHECK(labels_.dim() == 1 && labels_.scalar_type() == torch::kLong,
            "hard labels: expected a [N] int64 tensor, found ", labels_.sizes(), " ", labels_.scalar_type());
  const auto ignored = labels_ == ignore_index_;
  const auto in_range = (labels_ >= 0).logical_and(labels_ < vocab).logical_or(ignored);
  const auto flags = torch::stack({in_range.all(), ignored.any()}).cpu();  // one host sync for both
  LT2_CHECK(flags[0].item<bool>(), "hard labels: expected every label in [0, ", vocab, ") or equal to ",
            ignore_index_, " (ignored); found one outside");
  any_ignored_ = flags[1].item<bool>();
}

void HardLabels::check(int64_t rows, int64_t vocab, torch::Device device) const {
  LT2_CHECK(labels_.size(0) == rows, "hard labels: expected ", rows, " labels (one per hidden row), found ",
            labels_.size(0));
  LT2_CHECK(vocab == vocab_, "hard labels: made for a vocabulary of ", vocab_, ", the head has ", vocab);
  LT2_CHECK(labels_.device() == device, "hard labels: expected them on ", device, " with the hidden states, found ",
            labels_.device());
}

namespace {
// Hard labels' score by the kernel (kernels/prefill.h: cross_entropy_forward) where it takes the
// chunk: packed fp32 CUDA logits, a kernel dtype for the gradient, the switch on. Undefined loss where not.
ChunkScore cross_entropy_by_kernel(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                                   std::optional<ScalarType> grad_dtype) {
#ifdef LT2_WITH_CUDA
  if (!decode_options().cross_entropy_kernel || !logits.is_cuda() || logits.scalar_type() != torch::kFloat32 ||
      !logits.is_contiguous() || (grad_dtype && !detail::kernel_dtype_ok(*grad_dtype)) ||
      !kernels::cross_entropy_supported(logits.size(0), logits.size(1)))
    return {};
  c10::cuda::CUDAGuard guard(logits.device());
  const auto packed_labels = labels.contiguous();
  auto losses = torch::empty({logits.size(0)}, logits.options());
  ChunkScore s;
  if (grad_dtype) s.grad = torch::empty(logits.sizes(), logits.options().dtype(*grad_dtype));
  kernels::CrossEntropyParams p{};
  p.logits = logits.data_ptr<float>(), p.labels = packed_labels.data_ptr<int64_t>(), p.loss = losses.data_ptr<float>();
  p.grad = grad_dtype ? s.grad.data_ptr() : nullptr;
  p.rows = logits.size(0), p.vocab = static_cast<int>(logits.size(1)), p.ignore_index = ignore_index;
  p.grad_dtype = detail::kernel_dtype(grad_dtype.value_or(torch::kFloat32));
  kernels::cross_entropy_forward(p, detail::current_stream(logits));
  s.loss = losses.sum();
  return s;
#else
  (void)logits, (void)labels, (void)ignore_index, (void)grad_dtype;
  return {};
#endif
}
}  // namespace

ChunkScore HardLabels::score(Tensor logits, int64_t begin, std::optional<ScalarType> grad_dtype) const {
  const int64_t n = logits.size(0);
  const auto labels = labels_.narrow(0, begin, n);                                // [n]
  if (auto s = cross_entropy_by_kernel(logits, labels, ignore_index_, grad_dtype); s.loss.defined()) return s;
  const auto counted = labels != ignore_index_;                                   // [n]
  const auto index = labels.masked_fill(counted.logical_not(), 0).unsqueeze(1);   // [n, 1]
  auto log_probs = torch::log_softmax(logits, 1);                                 // [n, V]
  logits = Tensor();
  const auto picked = log_probs.gather(1, index);                                 // [n, 1]
  ChunkScore s;
  s.loss = -torch::where(counted, picked.squeeze(1), 0).sum();
  if (!grad_dtype) return s;
  // softmax - onehot(label): the softmax written in the gradient's dtype in one pass, the label's
  // entry from p - 1 in the logits' dtype (p rounded first would lose p - 1 where p is near 1).
  if (*grad_dtype == log_probs.scalar_type()) {
    s.grad = log_probs.exp_();
  } else {
    s.grad = torch::empty(log_probs.sizes(), log_probs.options().dtype(*grad_dtype));
    at::exp_out(s.grad, log_probs);
  }
  s.grad.scatter_(1, index, (picked.exp() - 1).to(*grad_dtype));
  if (any_ignored_) s.grad.mul_(counted.unsqueeze(1).to(*grad_dtype));  // ignored rows: no gradient
  return s;
}

Tensor HardLabels::count() const { return (labels_ != ignore_index_).sum(); }

TeacherLogProbs::TeacherLogProbs(Tensor teacher_log_probs) : log_probs_(std::move(teacher_log_probs)) {
  LT2_CHECK(log_probs_.dim() == 2 && log_probs_.is_floating_point(),
            "teacher log-probabilities: expected a [N, V] float tensor, found ", log_probs_.sizes(), " ",
            log_probs_.scalar_type());
}

void TeacherLogProbs::check(int64_t rows, int64_t vocab, torch::Device) const {
  LT2_CHECK(log_probs_.size(0) == rows && log_probs_.size(1) == vocab,
            "teacher log-probabilities: expected [", rows, ", ", vocab, "] (hidden rows x head vocabulary), found ",
            log_probs_.sizes());
}

namespace {
// KL(teacher || student) of one chunk: t the teacher's log-probabilities [n, V] in the logits'
// dtype, logits the student's [n, V]; gradient softmax(student) - p_t.
ChunkScore kl_chunk(const Tensor& t, Tensor logits, std::optional<ScalarType> grad_dtype) {
  const auto p = t.exp();                      // [n, V]
  auto log_q = torch::log_softmax(logits, 1);  // student, [n, V]
  logits = Tensor();
  ChunkScore s;
  // p log p is 0 where p is: the masked form keeps -inf log-probabilities from making 0 * inf.
  s.loss = torch::where(p > 0, p * (t - log_q), 0).sum();
  if (grad_dtype) s.grad = log_q.exp_().sub_(p).to(*grad_dtype);
  return s;
}
}  // namespace

ChunkScore TeacherLogProbs::score(Tensor logits, int64_t begin, std::optional<ScalarType> grad_dtype) const {
  const auto t = log_probs_.narrow(0, begin, logits.size(0)).detach().to(logits.options());  // [n, V]
  return kl_chunk(t, std::move(logits), grad_dtype);
}

TeacherHead::TeacherHead(Tensor teacher_hidden, Tensor teacher_weight) {
  LT2_CHECK(teacher_hidden.dim() == 2 && teacher_weight.dim() == 2 && teacher_hidden.size(1) == teacher_weight.size(1),
            "teacher head: expected hidden [N, d] and weight [V, d]; found hidden ", teacher_hidden.sizes(),
            " and weight ", teacher_weight.sizes());
  const auto compute = product_dtype(teacher_hidden, teacher_weight);
  hidden_ = teacher_hidden.detach().to(compute);
  weight_ = teacher_weight.detach().to(compute);
}

void TeacherHead::check(int64_t rows, int64_t vocab, torch::Device device) const {
  LT2_CHECK(hidden_.size(0) == rows && weight_.size(0) == vocab, "teacher head: expected ", rows,
            " hidden rows and a vocabulary of ", vocab, " (the student's), found ", hidden_.size(0), " rows and ",
            weight_.size(0), " tokens");
  LT2_CHECK(hidden_.device() == device && weight_.device() == device, "teacher head: expected it on ", device,
            " with the student's hidden states, found ", hidden_.device());
}

ChunkScore TeacherHead::score(Tensor logits, int64_t begin, std::optional<ScalarType> grad_dtype) const {
  const auto h = hidden_.narrow(0, begin, logits.size(0));  // [n, d_t]
  const auto t = torch::log_softmax(product(h, weight_.t(), logits.scalar_type()), 1);  // teacher, [n, V]
  return kl_chunk(t, std::move(logits), grad_dtype);
}

Tensor TeacherHead::count() const {
  return torch::scalar_tensor(hidden_.size(0), torch::TensorOptions().dtype(torch::kLong).device(hidden_.device()));
}

Tensor TeacherLogProbs::count() const {
  return torch::scalar_tensor(log_probs_.size(0), torch::TensorOptions().dtype(torch::kLong).device(log_probs_.device()));
}

int64_t head_loss_chunk_tokens(int64_t vocab, int64_t logit_bytes, const HeadLossOptions& opts) {
  LT2_CHECK(opts.chunk_tokens >= 0, "head loss: chunk_tokens must be >= 0 (0 = automatic), found ", opts.chunk_tokens);
  if (opts.chunk_tokens > 0) return opts.chunk_tokens;
  return std::max<int64_t>(1, kAutoChunkBytes / (vocab * logit_bytes));
}

HeadLoss lm_head_loss(const Tensor& hidden, const Tensor& weight, const HeadLossTarget& target,
                      const HeadLossOptions& opts) {
  LT2_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
            "head loss: expected hidden [N, d] and weight [V, d]; found hidden ", hidden.sizes(), " and weight ",
            weight.sizes());
  LT2_CHECK(hidden.device() == weight.device(), "head loss: expected hidden and weight on one device; found ",
            hidden.device(), " and ", weight.device());
  target.check(hidden.size(0), weight.size(0), hidden.device());
  const auto compute = product_dtype(hidden, weight);
  const int64_t chunk = head_loss_chunk_tokens(weight.size(0), compute == torch::kFloat64 ? 8 : 4, opts);
  HeadLoss out;
  out.sum = HeadLossFunction::apply(hidden, weight, &target, compute, chunk, torch::GradMode::is_enabled());
  out.count = target.count();
  return out;
}

Tensor lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                             const HeadLossOptions& opts, int64_t ignore_index) {
  LT2_CHECK(hidden.dim() >= 1 && labels.sizes() == hidden.sizes().slice(0, hidden.dim() - 1),
            "head cross-entropy: expected labels shaped like hidden without its last dim; found hidden ",
            hidden.sizes(), " and labels ", labels.sizes());
  return lm_head_loss(hidden.reshape({-1, hidden.size(-1)}), weight,
                      HardLabels(labels.reshape({-1}), weight.size(0), ignore_index), opts)
      .mean();
}

}  // namespace lt2::ops
