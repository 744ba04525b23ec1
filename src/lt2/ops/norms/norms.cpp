#include "lt2/ops/norms/norms.h"

#include <cstdint>

#include "lt2/kernels/decode.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace lt2::ops {

using namespace detail;

Tensor rms_norm(const Tensor& x, const RMSNorm& norm) {
  if (fused_elementwise_applies({x, norm->weight})) return rms_norm_fused(x, norm->weight, norm->eps);
  return lt2::rms_norm(x, norm->weight, norm->eps);
}

AddRmsNormResult add_rms_norm(const Tensor& x, const Tensor& m, const RMSNorm& norm) {
  if (fused_elementwise_applies({x, m, norm->weight}) && m.sizes() == x.sizes())
    return add_rms_norm_fused(x, m, norm->weight, norm->eps);
  const auto h = x + m;
  return {h, ops::rms_norm(h, norm)};
}

Tensor silu_mul(const Tensor& gate_up) {
  if (fused_elementwise_applies({gate_up})) return silu_mul_fused(gate_up);
  const int64_t n = gate_up.size(-1) / 2;
  return torch::silu(gate_up.narrow(-1, 0, n)) * gate_up.narrow(-1, n, n);
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
  c10::cuda::CUDAGuard guard(gate_up.device());
  const auto in = with_contiguous_rows(gate_up.reshape({-1, 2 * hidden}), gate_up.scalar_type());  // [N, 2H]
  auto sizes = gate_up.sizes().vec();
  sizes.back() = hidden;
  auto out = torch::empty(sizes, gate_up.options().memory_format(torch::MemoryFormat::Contiguous));
  kernels::SiluMulParams p{};
  p.gate_up = in.data_ptr(), p.row_stride = in.stride(0);
  p.out = out.data_ptr();
  p.rows = in.size(0), p.hidden = static_cast<int>(hidden);
  p.dtype = kernel_dtype(gate_up.scalar_type());
  kernels::silu_mul(p, current_stream(gate_up));
  return out;
#else
  no_cuda(op);
#endif
}

}  // namespace lt2::ops
