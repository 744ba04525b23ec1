// The gated delta rule's gates from their raw projections (prefill.h: delta_rule_gates), one
// launch where the libtorch form takes ten (conversions, exp, softplus, sigmoid, products): at
// inference the layer's cost at a few hundred tokens is its launches, not its bytes.
//
// Floor. Per token it reads G + H_b values and writes as many fp32: at lt2-gdn-1.3b (G = H_b = 16)
// 96 bytes a token, nothing next to the launch itself (~3 us) below ~30k tokens.
//
// Design: one thread per output value, grid-stride over the g values then the beta values; the
// per-column parameters are read through the L1 (a few hundred bytes).
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 256;

// libtorch's softplus with beta 1 and threshold 20.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

template <typename T>
__global__ void __launch_bounds__(kThreads) delta_rule_gates_kernel(const DeltaRuleGatesParams p) {
  const int64_t n_g = p.rows * p.cols, n = n_g + p.rows * p.beta_cols;
  const int per_head = p.cols / p.heads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    if (i < n_g) {
      const int64_t r = i / p.cols;
      const int c = static_cast<int>(i - r * p.cols);
      const float a = to_float(static_cast<const T*>(p.a)[r * p.a_row_stride + c]);
      p.g[i] = -__expf(param_as_float<T>(p.A_log, p.param_dtype, c / per_head)) *
               softplus(a + param_as_float<T>(p.dt_bias, p.param_dtype, c));
    } else {
      const int64_t j = i - n_g, r = j / p.beta_cols;
      const int h = static_cast<int>(j - r * p.beta_cols);
      const float b = to_float(static_cast<const T*>(p.b)[r * p.b_row_stride + h]);
      p.beta[j] = p.beta_scale / (1.f + __expf(-b));
    }
  }
}

}  // namespace

void delta_rule_gates(const DeltaRuleGatesParams& p, void* stream) {
  const char* op = "delta_rule_gates";
  LT2_CHECK(p.a && p.b && p.A_log && p.dt_bias && p.g && p.beta, op, ": every pointer must be given");
  LT2_CHECK(p.rows >= 0 && p.cols >= 1 && p.heads >= 1 && p.cols % p.heads == 0 && p.beta_cols >= 1, op,
            ": rows ", p.rows, " must be >= 0, cols ", p.cols, " a multiple of heads ", p.heads, ", beta_cols ",
            p.beta_cols, " >= 1");
  LT2_CHECK(p.a_row_stride >= p.cols && p.b_row_stride >= p.beta_cols, op, ": row strides ", p.a_row_stride, " and ",
            p.b_row_stride, " must be at least the rows' lengths ", p.cols, " and ", p.beta_cols);
  LT2_CHECK(p.param_dtype == DType::Float32 || p.param_dtype == p.dtype, op,
            ": A_log and dt_bias must be fp32 or of a's dtype");
  const int64_t n = p.rows * (p.cols + p.beta_cols);
  if (n == 0) return;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) { delta_rule_gates_kernel<decltype(t)><<<blocks, kThreads, 0, s>>>(p); });
  check_launch(op);
}

}  // namespace lt2::kernels
