#include "lt2/ops/norms/norms.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "lt2/kernels/decode.h"
#include "lt2/nn/linear.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

using namespace detail;

namespace {

// Whether the gated-product kernel takes these tensors (norms.h: the gated products).
bool gated_product_applies(const std::vector<Tensor>& tensors) {
  if (!fused_decode_available() || !decode_options().gated_product) return false;
  if (!torch::GradMode::is_enabled() && !decode_options().fused) return false;
  const Tensor& first = tensors.front();
  for (const auto& t : tensors)
    if (!activation_problem(t, "t").empty() || t.dim() == 0 || t.numel() == 0 || t.stride(-1) != 1 ||
        t.size(-1) > INT32_MAX || t.scalar_type() != first.scalar_type() || t.device() != first.device())
      return false;
  return true;
}

#ifdef LT2_WITH_CUDA
kernels::GateAct kernel_act(GateActivation act) {
  return act == GateActivation::Swish     ? kernels::GateAct::Swish
         : act == GateActivation::Sigmoid ? kernels::GateAct::Sigmoid
                                          : kernels::GateAct::None;
}

// The kernels' view of act(a) * b: with `second` defined a = first, b = second, both [rows,
// hidden]; else a and b are the halves of first [rows, 2 hidden].
kernels::GatedProductParams gated_product_params(const Tensor& first, const Tensor& second, int64_t act) {
  kernels::GatedProductParams p{};
  const bool halves = second.numel() == 0;
  p.hidden = static_cast<int>(halves ? first.size(1) / 2 : first.size(1));
  p.a = first.data_ptr(), p.a_row_stride = first.stride(0);
  p.b = halves ? static_cast<const char*>(first.data_ptr()) + p.hidden * first.element_size() : second.data_ptr();
  p.b_row_stride = halves ? first.stride(0) : second.stride(0);
  p.rows = first.size(0);
  p.act = kernel_act(static_cast<GateActivation>(act));
  p.dtype = kernel_dtype(first.scalar_type());
  return p;
}

Tensor gated_product_forward_cuda(const Tensor& first, const Tensor& second, int64_t act) {
  c10::cuda::CUDAGuard guard(first.device());
  auto p = gated_product_params(first, second, act);
  auto out = torch::empty({p.rows, p.hidden}, first.options().memory_format(torch::MemoryFormat::Contiguous));
  p.out = out.data_ptr();
  kernels::gated_product_forward(p, current_stream(first));
  return out;
}

// Autograd over the kernels on 2-D views with a unit column stride; a and b are saved (the
// activation is recomputed). An absent `second` (the halves form) travels as an empty tensor, and
// the gradient of `first` is then one tensor holding both halves'.
struct GatedProductFunction : public torch::autograd::Function<GatedProductFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& first, const Tensor& second,
                        int64_t act) {
    ctx->save_for_backward({first, second});
    ctx->saved_data["act"] = act;
    return gated_product_forward_cuda(first, second, act);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &first = saved[0], &second = saved[1];
    c10::cuda::CUDAGuard guard(first.device());
    auto p = gated_product_params(first, second, ctx->saved_data["act"].toInt());
    const bool halves = second.numel() == 0;
    const auto dout = grads[0].to(first.scalar_type()).contiguous();
    auto d_first = torch::empty({p.rows, first.size(1)}, dout.options());
    auto d_second = halves ? Tensor() : torch::empty({p.rows, p.hidden}, dout.options());
    p.dout = dout.data_ptr();
    p.da = d_first.data_ptr(), p.da_row_stride = d_first.stride(0);
    p.db = halves ? static_cast<char*>(d_first.data_ptr()) + p.hidden * d_first.element_size() : d_second.data_ptr();
    p.db_row_stride = halves ? d_first.stride(0) : d_second.stride(0);
    kernels::gated_product_backward(p, current_stream(first));
    return {d_first, d_second, Tensor()};
  }
};
#endif

// act(a) * b through the kernel on [..., n] tensors (second undefined: the halves of first).
Tensor gated_product_kernel(const Tensor& first, const Tensor& second, GateActivation act) {
#ifdef LT2_WITH_CUDA
  const int64_t n = first.size(-1);
  const auto first2 = first.reshape({-1, n});
  const auto second2 = second.defined() ? second.reshape({-1, n}) : torch::empty({0}, first.options());
  auto sizes = first.sizes().vec();
  if (!second.defined()) sizes.back() = n / 2;
  const bool grad = torch::GradMode::is_enabled() &&
                    (first.requires_grad() || (second.defined() && second.requires_grad()));
  const auto out = grad ? GatedProductFunction::apply(first2, second2, static_cast<int64_t>(act))
                        : gated_product_forward_cuda(first2, second2, static_cast<int64_t>(act));
  return out.view(sizes);
#else
  no_cuda("gated_product");
#endif
}

}  // namespace

Tensor silu_mul(const Tensor& gate_up) {
  if (gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gated_product_applies({gate_up}))
    return gated_product_kernel(gate_up, Tensor(), GateActivation::Swish);
  const auto halves = gate_up.chunk(2, -1);  // one backward node for both halves
  return torch::silu(halves[0]) * halves[1];
}

namespace {
// y * act(gate), act Swish or Sigmoid: the kernel where it applies, the libtorch ops otherwise.
Tensor activated_gate(const Tensor& y, const Tensor& gate, GateActivation act) {
  if (gate.sizes() == y.sizes() && gated_product_applies({gate, y})) return gated_product_kernel(gate, y, act);
  return y * (act == GateActivation::Swish ? torch::silu(gate) : torch::sigmoid(gate));
}
}  // namespace

Tensor sigmoid_gate(const Tensor& y, const Tensor& gate) { return activated_gate(y, gate, GateActivation::Sigmoid); }

Tensor silu_gate(const Tensor& y, const Tensor& gate) { return activated_gate(y, gate, GateActivation::Swish); }

namespace {

#ifdef LT2_WITH_CUDA
// The kernels' view of sigmoid_gated_sum's inputs (logits [B, T, H, n], the n at unit stride; branches
// [B, T, H, D], D at unit stride); nullopt where they do not take them.
std::optional<kernels::GatedSumParams> gated_sum_params(const Tensor& logits, at::TensorList branches) {
  const int64_t n = static_cast<int64_t>(branches.size());
  if (logits.dim() != 4 || logits.stride(3) != 1 || n > kernels::kGatedSumMaxBranches || logits.size(0) > INT32_MAX ||
      logits.size(1) > INT32_MAX || logits.size(2) > INT32_MAX || branches.front().size(3) > INT32_MAX)
    return std::nullopt;
  kernels::GatedSumParams p{};
  p.logits = logits.data_ptr();
  for (int d = 0; d < 3; ++d) p.logit_strides[d] = logits.stride(d);
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& x = branches[i];
    if (x.dim() != 4 || x.stride(3) != 1) return std::nullopt;
    p.x[i] = x.data_ptr();
    for (int d = 0; d < 3; ++d) p.x_strides[i][d] = x.stride(d);
  }
  p.batch = static_cast<int>(logits.size(0)), p.length = static_cast<int>(logits.size(1));
  p.heads = static_cast<int>(logits.size(2)), p.head_dim = static_cast<int>(branches.front().size(3));
  p.branches = static_cast<int>(n);
  p.dtype = kernel_dtype(logits.scalar_type());
  if (!kernels::gated_sum_supported(p)) return std::nullopt;
  return p;
}

Tensor gated_sum_forward_cuda(kernels::GatedSumParams p, const Tensor& like) {
  c10::cuda::CUDAGuard guard(like.device());
  auto out = torch::empty({p.batch, p.length, p.heads, p.head_dim}, like.options());
  p.out = out.data_ptr();
  kernels::gated_sum_forward(p, current_stream(like));
  return out;
}

// Autograd over the kernels; the logits and the branches are saved. The branches come as four tensors,
// absent ones empty (Function::apply counts a tensor list as one input).
struct GatedSumFunction : public torch::autograd::Function<GatedSumFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& logits, const Tensor& x0,
                        const Tensor& x1, const Tensor& x2, const Tensor& x3) {
    ctx->save_for_backward({logits, x0, x1, x2, x3});
    return gated_sum_forward_cuda(*gated_sum_params(logits, present({x0, x1, x2, x3})), logits);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& logits = saved[0];
    const auto branches = present({saved[1], saved[2], saved[3], saved[4]});
    c10::cuda::CUDAGuard guard(logits.device());
    auto p = *gated_sum_params(logits, branches);
    const auto dout = grads[0].to(logits.scalar_type()).contiguous();
    auto dlogits = torch::empty(logits.sizes(), logits.options());
    torch::autograd::variable_list out{dlogits, Tensor(), Tensor(), Tensor(), Tensor()};
    for (size_t i = 0; i < branches.size(); ++i) {
      out[1 + i] = torch::empty(dout.sizes(), dout.options());
      p.dx[i] = out[1 + i].data_ptr();
    }
    p.dout = dout.data_ptr(), p.dlogits = dlogits.data_ptr();
    kernels::gated_sum_backward(p, current_stream(logits));
    return out;
  }
  // The branches given: the leading non-empty ones.
  static std::vector<Tensor> present(const std::vector<Tensor>& slots) {
    std::vector<Tensor> out;
    for (const auto& t : slots)
      if (t.numel() > 0) out.push_back(t);
    return out;
  }
};
#endif

}  // namespace

Tensor sigmoid_gated_sum(const Tensor& logits, const std::vector<Tensor>& branches) {
  LT2_CHECK(logits.dim() >= 1 && logits.size(-1) == static_cast<int64_t>(branches.size()) && !branches.empty(),
            "sigmoid_gated_sum: logits [..., n] for n branches, found ", logits.sizes(), " for ", branches.size());
#ifdef LT2_WITH_CUDA
  std::vector<Tensor> all{logits};
  all.insert(all.end(), branches.begin(), branches.end());
  bool same_shape = true;
  for (const auto& x : branches) same_shape = same_shape && x.sizes() == branches.front().sizes();
  if (decode_options().gated_sum && gated_product_applies(all) && same_shape &&
      logits.sizes().slice(0, logits.dim() - 1) == branches.front().sizes().slice(0, branches.front().dim() - 1)) {
    if (auto p = gated_sum_params(logits, branches)) {
      const bool grad = torch::GradMode::is_enabled() &&
                        std::any_of(all.begin(), all.end(), [](const Tensor& t) { return t.requires_grad(); });
      if (!grad) return gated_sum_forward_cuda(*p, logits);
      std::vector<Tensor> slots(branches);
      slots.resize(kernels::kGatedSumMaxBranches, torch::empty({0}, logits.options()));
      return GatedSumFunction::apply(logits, slots[0], slots[1], slots[2], slots[3]);
    }
  }
#endif
  const auto g = torch::sigmoid(logits).unsqueeze(-1);
  Tensor out;
  for (size_t i = 0; i < branches.size(); ++i) {
    auto term = g.select(-2, static_cast<int64_t>(i)) * branches[i];
    out = out.defined() ? out + term : term;
  }
  return out;
}

namespace {

Tensor gated_rms_norm_reference(const Tensor& x, const Tensor& weight, double eps, const Tensor& gate,
                                GateActivation act) {
  const auto dt = accum_dtype(x);
  auto y = lt2::rms_norm(x.to(dt), weight, eps);
  if (gate.defined() && act != GateActivation::None) {
    auto gf = gate.to(dt);
    y = y * (act == GateActivation::Swish ? torch::silu(gf) : torch::sigmoid(gf));
  }
  return y.to(x.scalar_type());
}

constexpr double kL2Eps = 1e-6;

#ifdef LT2_WITH_CUDA
// How the kernels read a gate of x's sizes [..., G, d] (x's rows, G to a group) in place: the rows
// of a group packed and the groups evenly strided, as a column slice of a packed projection holding
// a token's G heads is. {G, the groups' stride}, or {0, 0} where the gate needs a packed copy.
std::pair<int64_t, int64_t> gate_groups(const Tensor& gate) {
  const int64_t n = gate.dim(), d = gate.size(-1);
  if (gate.is_contiguous()) return {1, d};
  if (n < 3 || gate.stride(-1) != 1 || (gate.size(-2) > 1 && gate.stride(-2) != d)) return {0, 0};
  const int64_t G = gate.size(-2), group_stride = gate.stride(-3);
  if (G > INT32_MAX || group_stride < G * d) return {0, 0};
  for (int64_t i = 0; i + 3 < n; ++i)
    if (gate.size(i) > 1 && gate.stride(i) != gate.size(i + 1) * gate.stride(i + 1)) return {0, 0};
  return {G, group_stride};
}

// The kernels' view of x [rows, d] (packed), weight [d] in fp32 or x's dtype or undefined, gate of x's
// rows (gate_groups' layout) or undefined.
kernels::RowNormParams row_norm_params(const Tensor& x, const Tensor& weight, const Tensor& gate, double divisor,
                                       double eps, GateActivation act, const Tensor& rstd, torch::ScalarType out_dtype) {
  kernels::RowNormParams p{};
  p.out_dtype = kernel_dtype(out_dtype);
  p.x = x.data_ptr();
  p.gate = gate.defined() ? gate.data_ptr() : nullptr;
  if (gate.defined()) {
    const auto [rows, stride] = gate_groups(gate);
    LT2_CHECK(rows > 0, "row norm: the gate's rows must be packed in evenly strided groups, found strides ",
              gate.strides());
    p.gate_group_rows = static_cast<int>(rows), p.gate_group_stride = stride;
  }
  p.weight = weight.defined() ? weight.data_ptr() : nullptr;
  p.weight_dtype = kernel_dtype(weight.defined() ? weight.scalar_type() : torch::kFloat32);
  p.rstd = rstd.data_ptr<float>();
  p.rows = x.size(0), p.dim = static_cast<int>(x.size(1));
  p.divisor = static_cast<float>(divisor), p.eps = static_cast<float>(eps);
  p.act = kernel_act(act);
  p.dtype = kernel_dtype(x.scalar_type());
  return p;
}

// The forward kernel on x [rows, d]: y in out_dtype and r; with a residual m ([rows, d] packed, x's
// dtype or bf16 with fp32 x, no gate) it normalises h = x + m and writes h too.
struct RowNormForward {
  Tensor y, rstd, h;
};
RowNormForward row_norm_forward_cuda(const Tensor& x, const Tensor& weight, const Tensor& gate, double divisor,
                                     double eps, GateActivation act, torch::ScalarType out_dtype,
                                     const Tensor& residual = Tensor()) {
  c10::cuda::CUDAGuard guard(x.device());
  RowNormForward r;
  r.y = torch::empty(x.sizes(), x.options().dtype(out_dtype));
  r.rstd = torch::empty({x.size(0)}, x.options().dtype(torch::kFloat32));
  auto p = row_norm_params(x, weight, gate, divisor, eps, act, r.rstd, out_dtype);
  p.y = r.y.data_ptr();
  if (residual.defined()) {
    r.h = torch::empty_like(x);
    p.residual = residual.data_ptr(), p.residual_dtype = kernel_dtype(residual.scalar_type()), p.h = r.h.data_ptr();
  }
  kernels::row_norm_forward(p, current_stream(x));
  return r;
}

// Whether the row-norm kernels take x [..., d] with weight [d] (or undefined) and an output in
// out_dtype (x's, or bf16 for fp32 x).
bool row_norm_kernels_take(const Tensor& x, const Tensor& weight, torch::ScalarType out_dtype) {
  if (!decode_options().row_norm || !x.is_cuda() || !kernel_dtype_ok(x.scalar_type()) || x.dim() < 1 ||
      x.size(-1) < 1 || x.size(-1) > kernels::kMaxRowNormDim || x.numel() == 0)
    return false;
  if (weight.defined() && (weight.dim() != 1 || weight.size(0) != x.size(-1) || weight.device() != x.device()))
    return false;
  return out_dtype == x.scalar_type() || (x.scalar_type() == torch::kFloat32 && out_dtype == torch::kBFloat16);
}

// Autograd over the kernels: x, weight (fp32 [d]) and gate get gradients; r is saved (one float a
// row), the normalised row recomputed. An absent weight or gate travels as an empty tensor. y is
// written in out_dtype (x's, or bf16 for fp32 x) and its gradient read in it.
struct RowNormFunction : public torch::autograd::Function<RowNormFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& gate, double divisor, double eps, int64_t act, int64_t out_dtype) {
    const auto w = weight.numel() > 0 ? weight : Tensor(), g = gate.numel() > 0 ? gate : Tensor();
    auto f = row_norm_forward_cuda(x, w, g, divisor, eps, static_cast<GateActivation>(act),
                                   static_cast<torch::ScalarType>(out_dtype));
    ctx->save_for_backward({x, weight, gate, f.rstd});
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = act;
    ctx->saved_data["out_dtype"] = out_dtype;
    return f.y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor w = saved[1].numel() > 0 ? saved[1] : Tensor(), g = saved[2].numel() > 0 ? saved[2] : Tensor();
    c10::cuda::CUDAGuard guard(x.device());
    const auto out_dtype = static_cast<torch::ScalarType>(ctx->saved_data["out_dtype"].toInt());
    const auto dy = grads[0].to(out_dtype).contiguous();
    auto dx = torch::empty_like(x);
    auto dgate = g.defined() ? torch::empty(g.sizes(), g.options()) : Tensor();  // packed, whatever g's strides
    auto dweight = w.defined() ? torch::zeros_like(w) : Tensor();
    kernels::RowNormBackwardParams p{};
    p.forward = row_norm_params(x, w, g, ctx->saved_data["divisor"].toDouble(), ctx->saved_data["eps"].toDouble(),
                                static_cast<GateActivation>(ctx->saved_data["act"].toInt()), saved[3], out_dtype);
    p.dy = dy.data_ptr();
    p.dx = dx.data_ptr();
    p.dgate = g.defined() ? dgate.data_ptr() : nullptr;
    p.dweight = w.defined() ? dweight.data_ptr<float>() : nullptr;
    kernels::row_norm_backward(p, current_stream(x));
    return {dx, w.defined() ? dweight : Tensor(), g.defined() ? dgate : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};
#endif

#ifdef LT2_WITH_CUDA
// Autograd over it: x, m and the weight get gradients; h and r are saved. The backward adds the
// gradient h receives from its other uses (the residual stream) to the norm's, in the kernel, and
// writes the sum once more in m's dtype as m's gradient: one pass where autograd would sum the two
// gradients of h and cast m's apart.
struct AddRowNormFunction : public torch::autograd::Function<AddRowNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const Tensor& m, const Tensor& weight, double eps, int64_t out_dtype) {
    auto f = row_norm_forward_cuda(x, weight, Tensor(), static_cast<double>(x.size(1)), eps, GateActivation::None,
                                   static_cast<torch::ScalarType>(out_dtype), m);
    ctx->save_for_backward({f.h, weight, f.rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["out_dtype"] = out_dtype;
    ctx->saved_data["m_dtype"] = static_cast<int64_t>(m.scalar_type());
    return {f.h, f.y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &h = saved[0], &w = saved[1];
    c10::cuda::CUDAGuard guard(h.device());
    const auto out_dtype = static_cast<torch::ScalarType>(ctx->saved_data["out_dtype"].toInt());
    const auto m_dtype = static_cast<torch::ScalarType>(ctx->saved_data["m_dtype"].toInt());
    const auto dy = grads[1].defined() ? grads[1].to(out_dtype).contiguous()
                                       : torch::zeros(h.sizes(), h.options().dtype(out_dtype));
    const auto dh = grads[0].defined() ? grads[0].to(h.scalar_type()).contiguous() : Tensor();
    auto dx = torch::empty_like(h), dm = torch::empty(h.sizes(), h.options().dtype(m_dtype));
    auto dweight = torch::zeros_like(w);
    kernels::RowNormBackwardParams p{};
    p.forward = row_norm_params(h, w, Tensor(), static_cast<double>(h.size(1)), ctx->saved_data["eps"].toDouble(),
                                GateActivation::None, saved[2], out_dtype);
    p.forward.residual_dtype = kernel_dtype(m_dtype);
    p.dy = dy.data_ptr(), p.dx = dx.data_ptr(), p.dweight = dweight.data_ptr<float>();
    p.dh = dh.defined() ? dh.data_ptr() : nullptr;
    p.dresidual = dm.data_ptr();
    kernels::row_norm_backward(p, current_stream(h));
    return {dx, dm, dweight, Tensor(), Tensor()};
  }
};
#endif

// The residual add and RMSNorm kernels (AddRowNormFunction) under autograd for x [..., d], m of x's
// sizes (x's dtype, or bf16 with fp32 x) and weight [d], y in out_dtype; undefined tensors where
// they do not apply (the caller adds and normalises apart).
AddRmsNormResult add_row_norm_kernels(const Tensor& x, const Tensor& m, const Tensor& weight, double eps,
                                      torch::ScalarType out_dtype) {
#ifdef LT2_WITH_CUDA
  if (!decode_options().residual_norm || !torch::GradMode::is_enabled() || !weight.defined() ||
      !row_norm_kernels_take(x, weight, out_dtype) || x.size(-1) > kernels::kMaxWarpRowDim ||
      m.sizes() != x.sizes() || m.device() != x.device() ||
      !(m.scalar_type() == x.scalar_type() ||
        (x.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kBFloat16)))
    return {};
  const int64_t d = x.size(-1);
  const auto x2 = x.reshape({-1, d}).contiguous(), m2 = m.reshape({-1, d}).contiguous();
  const auto w = weight.to(torch::kFloat32).contiguous();
  Tensor h, y;
  if (x.requires_grad() || m.requires_grad() || weight.requires_grad()) {
    const auto out = AddRowNormFunction::apply(x2, m2, w, eps, static_cast<int64_t>(out_dtype));
    h = out[0], y = out[1];
  } else {
    const auto f =
        row_norm_forward_cuda(x2, w, Tensor(), static_cast<double>(d), eps, GateActivation::None, out_dtype, m2);
    h = f.h, y = f.y;
  }
  return {h.view(x.sizes()), y.view(x.sizes())};
#else
  (void)x, (void)m, (void)weight, (void)eps, (void)out_dtype;
  return {};
#endif
}

// The row-norm kernels for x [..., d] (weight [d] or undefined, gate of x's sizes or undefined),
// or an undefined tensor where they do not apply (the caller then runs the reference). The output
// in out_dtype where given (bf16 for fp32 x), else in x's.
Tensor row_norm_kernels(const Tensor& x, const Tensor& weight, const Tensor& gate, double divisor, double eps,
                        GateActivation act, std::optional<torch::ScalarType> out_dtype = std::nullopt) {
#ifdef LT2_WITH_CUDA
  const auto out = out_dtype.value_or(x.scalar_type());
  if (!row_norm_kernels_take(x, weight, out)) return Tensor();
  if (gate.defined() && (gate.sizes() != x.sizes() || gate.device() != x.device())) return Tensor();
  const int64_t d = x.size(-1);
  const auto x2 = x.reshape({-1, d}).contiguous();
  // The gate read in place where its layout allows (a slice of the projection that made it).
  auto g = gate.defined() ? gate.to(x.scalar_type()) : Tensor();
  if (g.defined() && gate_groups(g).first == 0) g = g.contiguous();
  const bool grad = torch::GradMode::is_enabled() && (x.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                                                      (gate.defined() && gate.requires_grad()));
  // Without gradients a weight of x's dtype is read as it is (no conversion pass); the backward takes fp32.
  const bool weight_as_is = weight.defined() && !grad && weight.scalar_type() == x.scalar_type();
  const auto w = !weight.defined() ? Tensor() : (weight_as_is ? weight : weight.to(torch::kFloat32)).contiguous();
  Tensor y;
  if (grad) {
    const auto empty = torch::empty({0}, x.options());
    y = RowNormFunction::apply(x2, w.defined() ? w : empty.to(torch::kFloat32), g.defined() ? g : empty, divisor, eps,
                               static_cast<int64_t>(act), static_cast<int64_t>(out));
  } else {
    y = row_norm_forward_cuda(x2, w, g, divisor, eps, act, out).y;
  }
  return y.view(x.sizes());
#else
  return Tensor();
#endif
}

}  // namespace

Tensor gated_rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& gate, GateActivation act) {
  const auto g = act == GateActivation::None ? Tensor() : gate;
  // One group's gain [1, d] is a gain [d]: the kernels take it.
  const auto w = weight.defined() && weight.dim() == 2 && weight.size(0) == 1 ? weight.squeeze(0) : weight;
  if (auto y = row_norm_kernels(x, w, g, static_cast<double>(x.size(-1)), eps, act); y.defined()) return y;
  return gated_rms_norm_reference(x, weight, eps, gate, act);
}

Tensor rms_norm(const Tensor& x, const RMSNorm& norm) {
  if (fused_elementwise_applies({x, norm->weight})) return rms_norm_fused(x, norm->weight, norm->eps);
  // Under autograd the row-norm kernels forward and backward (d <= 1024), where ATen's fused
  // rms_norm takes its backward through the layer-norm kernels (~2.4x their traffic floor at d 768).
  if (torch::GradMode::is_enabled())
    if (auto y = row_norm_kernels(x, norm->weight, Tensor(), static_cast<double>(x.size(-1)), norm->eps,
                                  GateActivation::None);
        y.defined())
      return y;
  return lt2::rms_norm(x, norm->weight, norm->eps);
}

namespace {
// Whether a norm of x whose output only feeds products is written in bf16 (rms_norm_for_products).
bool products_in_bf16(const Tensor& x) {
  const auto autocast = AutocastState::current();
  return decode_options().norm_products_dtype && x.is_cuda() && x.scalar_type() == torch::kFloat32 &&
         autocast.enabled && autocast.dtype == torch::kBFloat16;
}
}  // namespace

Tensor rms_norm_for_products(const Tensor& x, const RMSNorm& norm) {
  if (products_in_bf16(x))
    if (auto y = row_norm_kernels(x, norm->weight, Tensor(), static_cast<double>(x.size(-1)), norm->eps,
                                  GateActivation::None, torch::kBFloat16);
        y.defined())
      return y;
  return rms_norm(x, norm);
}

AddRmsNormResult add_rms_norm(const Tensor& x, const Tensor& m, const RMSNorm& norm, bool for_products) {
  if (fused_elementwise_applies({x, m, norm->weight}) && m.sizes() == x.sizes())
    return add_rms_norm_fused(x, m, norm->weight, norm->eps);
  const auto out_dtype = for_products && products_in_bf16(x) ? torch::kBFloat16 : x.scalar_type();
  if (auto r = add_row_norm_kernels(x, m, norm->weight, norm->eps, out_dtype); r.h.defined()) return r;
  const auto h = x + m;
  return {h, for_products ? ops::rms_norm_for_products(h, norm) : ops::rms_norm(h, norm)};
}

Tensor l2_normalize(const Tensor& x) {
  if (auto y = row_norm_kernels(x, Tensor(), Tensor(), 1.0, kL2Eps, GateActivation::None); y.defined()) return y;
  auto xf = x.to(accum_dtype(x));
  return (xf * torch::rsqrt(xf.pow(2).sum(-1, /*keepdim=*/true) + kL2Eps)).to(x.scalar_type());
}

namespace {

// x [..., d] with weight [d] of x's dtype on x's device: throws naming `op` otherwise.
void check_norm_inputs(const char* op, const Tensor& x, const Tensor& weight) {
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = activation_problem(x, "x");
  LT2_CHECK(problem.empty(), op, ": ", problem);
  LT2_CHECK(x.dim() >= 1 && x.size(-1) >= 1 && x.size(-1) <= INT32_MAX, op, ": x must be [..., d], found ",
            x.sizes());
  LT2_CHECK(weight.defined() && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
            ": weight must be [", x.size(-1), "], found ", weight.defined() ? weight.sizes() : torch::IntArrayRef{});
  LT2_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(), op,
            ": weight must be ", x.scalar_type(), " on ", x.device(), " like x, found ", weight.scalar_type(),
            " on ", weight.device());
}

#ifdef LT2_WITH_CUDA
// Shared by rms_norm_fused and add_rms_norm_fused (m undefined: no residual add).
AddRmsNormResult launch_rms_norm(const Tensor& x, const Tensor& m, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  const auto dt = x.scalar_type();
  c10::cuda::CUDAGuard guard(x.device());
  const auto x2 = with_contiguous_rows(x.reshape({-1, d}), dt);  // [N, d]
  const auto m2 = m.defined() ? with_contiguous_rows(m.reshape({-1, d}), dt) : Tensor();
  const auto w = weight.contiguous();
  AddRmsNormResult r;
  r.y = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  if (m.defined()) r.h = torch::empty_like(r.y);
  kernels::RmsNormParams p{};
  p.x = x2.data_ptr(), p.x_row_stride = x2.stride(0);
  p.residual = m.defined() ? m2.data_ptr() : nullptr;
  p.residual_row_stride = m.defined() ? m2.stride(0) : 0;
  p.weight = w.data_ptr();
  p.h = m.defined() ? r.h.data_ptr() : nullptr;
  p.y = r.y.data_ptr();
  p.rows = x2.size(0), p.dim = static_cast<int>(d);
  p.eps = static_cast<float>(eps);
  p.dtype = kernel_dtype(dt);
  kernels::rms_norm(p, current_stream(x));
  return r;
}
#endif

}  // namespace

Tensor rms_norm_fused(const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "rms_norm_fused";
  check_norm_inputs(op, x, weight);
#ifdef LT2_WITH_CUDA
  return launch_rms_norm(x, Tensor(), weight, eps).y;
#else
  no_cuda(op);
#endif
}

AddRmsNormResult add_rms_norm_fused(const Tensor& x, const Tensor& m, const Tensor& weight, double eps) {
  const char* op = "add_rms_norm_fused";
  check_norm_inputs(op, x, weight);
  LT2_CHECK(m.defined() && m.sizes() == x.sizes() && m.scalar_type() == x.scalar_type() &&
                m.device() == x.device(),
            op, ": m must be ", x.sizes(), " ", x.scalar_type(), " on ", x.device(), " like x, found ",
            m.defined() ? m.sizes() : torch::IntArrayRef{}, " ", m.defined() ? m.scalar_type() : x.scalar_type(),
            " on ", m.defined() ? m.device() : x.device());
#ifdef LT2_WITH_CUDA
  return launch_rms_norm(x, m, weight, eps);
#else
  no_cuda(op);
#endif
}

Tensor silu_mul_fused(const Tensor& gate_up) {
  const char* op = "silu_mul_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = activation_problem(gate_up, "gate_up");
  LT2_CHECK(problem.empty(), op, ": ", problem);
  LT2_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gate_up.size(-1) >= 2 &&
                gate_up.size(-1) / 2 <= INT32_MAX,
            op, ": gate_up must be [..., 2 hidden], found ", gate_up.sizes());
#ifdef LT2_WITH_CUDA
  const int64_t hidden = gate_up.size(-1) / 2;
  const auto in = with_contiguous_rows(gate_up.reshape({-1, 2 * hidden}), gate_up.scalar_type());  // [N, 2H]
  auto sizes = gate_up.sizes().vec();
  sizes.back() = hidden;
  return gated_product_forward_cuda(in, torch::empty({0}, in.options()), static_cast<int64_t>(GateActivation::Swish))
      .view(sizes);
#else
  no_cuda(op);
#endif
}

}  // namespace lt2::ops
