// The recurrent mixers' gates from their raw projections. The gated delta rule's (prefill.h:
// delta_rule_gates), one launch where the libtorch form takes ten (conversions, exp, softplus,
// sigmoid, products): at inference the layer's cost at a few hundred tokens is its launches, not its
// bytes; and their backward in training, one launch where the libtorch form's autograd takes a dozen
// passes. The gated linear family's log-sigmoid decay (log_sigmoid_gates: GLA's, and HGRN2's with
// its input gate 1 - exp(g)), one pass each way where libtorch takes a cast, log_sigmoid, a division
// (GLA) or expm1 and a negation and cast (HGRN2), and their backwards and the sum of g's two
// gradients (HGRN2): at lt-100m/hgrn2's 32768 tokens of 768 channels ~30 ms a training step of
// elementwise passes, where one read of x and one write of g and k forward (8 bytes an element in
// bf16) and a read of x, dg, dk and a write of dx backward (10) take ~0.07 ms a call at ~3 TB/s.
// Mamba2's values scaled by their step, v = dt x (scale_heads): one pass each way where libtorch
// promotes to fp32 (the product, a cast back, and backward a cast up, two products, a sum over the
// head dim and a cast): at lt-100m/mamba2's 32768 tokens of 12 x 128 ~60 ms a training step, against
// 4 bytes an element forward (x read, v written in bf16) and 6 backward (dv, x read, dx written).
//
// Floor. Per token the forward reads G + H_b values and writes as many fp32: at lt2-gdn-1.3b (G =
// H_b = 16) 96 bytes a token, nothing next to the launch itself (~3 us) below ~30k tokens. KDA has
// one gate per key channel (G = 2,048 at d 2048): the backward reads a and dg and writes da, 8
// bytes an element in bf16 (0.54 GB at 8 x 4096, ~0.17 ms), where the libtorch form's forward and
// backward move ~60 bytes an element (casts, the sum, softplus, the product and their gradients).
//
// Design. Forward: one thread per output value, grid-stride over the g values then the beta values;
// the per-column parameters are read through the L1 (a few hundred bytes). Backward: a block takes
// every grid-th group of rows; thread t owns column t % W (W = min(cols, 256), then the next W
// columns) of rows t / W of each group, sums d dt_bias and dg * g for its column over its rows,
// the block's row groups add through shared memory and one atomicAdd per column and block remains;
// then the beta values grid-stride as in the forward. The log-sigmoid gates: one thread per value,
// grid-stride, each way. The scaled values: forward one thread per value; backward a warp per (row,
// head), lanes over the head dim, the sum of dy x by shuffles.
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 256;

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

constexpr int kGroupCols = kThreads;  // W at most

template <typename T>
__global__ void __launch_bounds__(kThreads) delta_rule_gates_backward_kernel(const DeltaRuleGatesBackwardParams bp) {
  const DeltaRuleGatesParams& p = bp.forward;
  __shared__ float sums[2][kThreads];
  const int width = min(p.cols, kGroupCols), groups = kThreads / width, per_head = p.cols / p.heads;
  const int tid = threadIdx.x, sub = tid / width;
  const bool worker = sub < groups;
  for (int c0 = 0; c0 < p.cols; c0 += width) {
    const int c = c0 + tid % width;
    float d_dt = 0.f, d_A = 0.f;
    if (worker && c < p.cols) {
      const float E = __expf(param_as_float<T>(p.A_log, p.param_dtype, c / per_head));
      const float bias = param_as_float<T>(p.dt_bias, p.param_dtype, c);
      for (int64_t r = static_cast<int64_t>(blockIdx.x) * groups + sub; r < p.rows;
           r += static_cast<int64_t>(gridDim.x) * groups) {
        const float x = to_float(static_cast<const T*>(p.a)[r * p.a_row_stride + c]) + bias;
        const float dg = bp.dg[r * p.cols + c];
        const float da = -dg * E * (x > 20.f ? 1.f : 1.f / (1.f + __expf(-x)));
        static_cast<T*>(bp.da)[r * p.cols + c] = from_float<T>(da);
        d_dt += da;
        d_A = fmaf(dg, -E * softplus(x), d_A);  // dg * g
      }
    }
    sums[0][tid] = d_dt, sums[1][tid] = d_A;
    __syncthreads();
    if (tid < width && c < p.cols) {
      for (int k = 1; k < groups; ++k) d_dt += sums[0][tid + k * width], d_A += sums[1][tid + k * width];
      atomicAdd(bp.dt_bias_cols + c, d_dt);
      atomicAdd(bp.A_log_cols + c, d_A);
    }
    __syncthreads();
  }
  const int64_t n_beta = p.rows * p.beta_cols;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + tid; j < n_beta;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = j / p.beta_cols;
    const int h = static_cast<int>(j - r * p.beta_cols);
    const float s = 1.f / (1.f + __expf(-to_float(static_cast<const T*>(p.b)[r * p.b_row_stride + h])));
    static_cast<T*>(bp.db)[j] = from_float<T>(bp.dbeta[j] * p.beta_scale * s * (1.f - s));
  }
}

// log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|)); sigmoid(-x) = exp(log_sigmoid(-x)).
__device__ __forceinline__ float log_sigmoid(float x) { return fminf(x, 0.f) - log1pf(expf(-fabsf(x))); }

// f(i, x) for every value of a [rows, cols] input whose rows are x_row_stride apart, grid-stride: i is
// the value's index in the packed [rows, cols] outputs, x the input value.
template <typename T, typename F>
__device__ __forceinline__ void for_each_value(const void* base, int64_t rows, int cols, int64_t x_row_stride,
                                               F&& f) {
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / cols;
    const int c = static_cast<int>(i - r * cols);
    f(i, to_float(static_cast<const T*>(base)[r * x_row_stride + c]));
  }
}

template <typename TX, typename TK>
__global__ void __launch_bounds__(kThreads) log_sigmoid_gates_kernel(const LogSigmoidGatesParams p) {
  for_each_value<TX>(p.x, p.rows, p.cols, p.x_row_stride, [&](int64_t i, float x) {
    const float g = log_sigmoid(x) / p.normalizer;
    p.g[i] = g;
    if (p.k) static_cast<TK*>(p.k)[i] = from_float<TK>(-expm1f(g));
  });
}

template <typename TX, typename TK>
__global__ void __launch_bounds__(kThreads) log_sigmoid_gates_backward_kernel(const LogSigmoidGatesBackwardParams bp) {
  const LogSigmoidGatesParams& p = bp.forward;
  for_each_value<TX>(p.x, p.rows, p.cols, p.x_row_stride, [&](int64_t i, float x) {
    float d = bp.dg ? bp.dg[i] : 0.f;
    if (bp.dk) d -= to_float(static_cast<const TK*>(bp.dk)[i]) * expf(log_sigmoid(x) / p.normalizer);
    static_cast<TX*>(bp.dx)[i] = from_float<TX>(d * expf(log_sigmoid(-x)) / p.normalizer);
  });
}

// f(TX{}, TK{}) with TX and TK the CUDA types of x's and k's dtypes.
template <typename F>
void dispatch_x_k(const LogSigmoidGatesParams& p, F&& f) {
  dispatch_dtype(p.x_dtype, [&](auto tx) { dispatch_dtype(p.k_dtype, [&](auto tk) { f(tx, tk); }); });
}

void check_log_sigmoid_gates(const LogSigmoidGatesParams& p, const char* op) {
  LT2_CHECK(p.x, op, ": x must be given");
  LT2_CHECK(p.rows >= 0 && p.cols >= 1 && p.x_row_stride >= p.cols && p.normalizer > 0.f, op, ": rows ", p.rows,
            " must be >= 0, cols ", p.cols, " >= 1, the row stride ", p.x_row_stride,
            " at least cols and the normalizer ", p.normalizer, " > 0");
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scale_heads_kernel(const ScaleHeadsParams p) {
  // Value i = (r H + h) P + p of the packed output scales by s[r H + h] = s[i / P].
  for_each_value<T>(p.x, p.rows, p.heads * p.head_dim, p.x_row_stride,
                    [&](int64_t i, float x) { static_cast<T*>(p.y)[i] = from_float<T>(x * p.s[i / p.head_dim]); });
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scale_heads_backward_kernel(const ScaleHeadsBackwardParams bp) {
  const ScaleHeadsParams& p = bp.forward;
  const int lane = threadIdx.x % 32, warps = kThreads / 32;
  const int64_t pairs = p.rows * p.heads;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32; w < pairs;
       w += static_cast<int64_t>(gridDim.x) * warps) {
    const int64_t r = w / p.heads;
    const int h = static_cast<int>(w - r * p.heads);
    const float s = p.s[w];
    const T* x = static_cast<const T*>(p.x) + r * p.x_row_stride + h * p.head_dim;
    const int64_t at = w * p.head_dim;  // (r, h)'s first value in the packed dy and dx
    float dot = 0.f;
    for (int j = lane; j < p.head_dim; j += 32) {
      const float dy = to_float(static_cast<const T*>(bp.dy)[at + j]);
      dot = fmaf(dy, to_float(x[j]), dot);
      static_cast<T*>(bp.dx)[at + j] = from_float<T>(dy * s);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) bp.ds[w] = dot;
  }
}

void check_scale_heads(const ScaleHeadsParams& p, const char* op) {
  LT2_CHECK(p.x && p.s, op, ": x and s must be given");
  LT2_CHECK(p.rows >= 0 && p.heads >= 1 && p.head_dim >= 1 &&
                p.x_row_stride >= static_cast<int64_t>(p.heads) * p.head_dim,
            op, ": rows ", p.rows, " must be >= 0, heads ", p.heads, " and head_dim ", p.head_dim,
            " >= 1, the row stride ", p.x_row_stride, " at least a row");
}

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
}

void check_gates(const DeltaRuleGatesParams& p, const char* op) {
  LT2_CHECK(p.a && p.b && p.A_log && p.dt_bias, op, ": a, b, A_log and dt_bias must be given");
  LT2_CHECK(p.rows >= 0 && p.cols >= 1 && p.heads >= 1 && p.cols % p.heads == 0 && p.beta_cols >= 1, op,
            ": rows ", p.rows, " must be >= 0, cols ", p.cols, " a multiple of heads ", p.heads, ", beta_cols ",
            p.beta_cols, " >= 1");
  LT2_CHECK(p.a_row_stride >= p.cols && p.b_row_stride >= p.beta_cols, op, ": row strides ", p.a_row_stride, " and ",
            p.b_row_stride, " must be at least the rows' lengths ", p.cols, " and ", p.beta_cols);
  LT2_CHECK(p.param_dtype == DType::Float32 || p.param_dtype == p.dtype, op,
            ": A_log and dt_bias must be fp32 or of a's dtype");
}

}  // namespace

void delta_rule_gates(const DeltaRuleGatesParams& p, void* stream) {
  const char* op = "delta_rule_gates";
  check_gates(p, op);
  LT2_CHECK(p.g && p.beta, op, ": g and beta must be given");
  const int64_t n = p.rows * (p.cols + p.beta_cols);
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype,
                 [&](auto t) { delta_rule_gates_kernel<decltype(t)><<<elementwise_blocks(n), kThreads, 0, s>>>(p); });
  check_launch(op);
}

void delta_rule_gates_backward(const DeltaRuleGatesBackwardParams& bp, void* stream) {
  const char* op = "delta_rule_gates_backward";
  const DeltaRuleGatesParams& p = bp.forward;
  check_gates(p, op);
  LT2_CHECK(bp.dg && bp.dbeta && bp.da && bp.db && bp.dt_bias_cols && bp.A_log_cols, op,
            ": dg, dbeta, da, db and the two column sums must be given");
  if (p.rows == 0) return;
  int device = 0;
  cudaGetDevice(&device);
  // Enough blocks to fill the device a few times over: the column atomics are per block.
  const int64_t groups = kThreads / std::min(p.cols, kGroupCols);
  const int64_t fill = 4LL * device_attribute(cudaDevAttrMultiProcessorCount, device, op);
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min((p.rows + groups - 1) / groups, fill)));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) { delta_rule_gates_backward_kernel<decltype(t)><<<blocks, kThreads, 0, s>>>(bp); });
  check_launch(op);
}

void log_sigmoid_gates(const LogSigmoidGatesParams& p, void* stream) {
  const char* op = "log_sigmoid_gates";
  check_log_sigmoid_gates(p, op);
  LT2_CHECK(p.g, op, ": g must be given");
  const int64_t n = p.rows * p.cols;
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_x_k(p, [&](auto tx, auto tk) {
    log_sigmoid_gates_kernel<decltype(tx), decltype(tk)><<<elementwise_blocks(n), kThreads, 0, s>>>(p);
  });
  check_launch(op);
}

void log_sigmoid_gates_backward(const LogSigmoidGatesBackwardParams& bp, void* stream) {
  const char* op = "log_sigmoid_gates_backward";
  const LogSigmoidGatesParams& p = bp.forward;
  check_log_sigmoid_gates(p, op);
  LT2_CHECK(bp.dx, op, ": dx must be given");
  const int64_t n = p.rows * p.cols;
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_x_k(p, [&](auto tx, auto tk) {
    log_sigmoid_gates_backward_kernel<decltype(tx), decltype(tk)><<<elementwise_blocks(n), kThreads, 0, s>>>(bp);
  });
  check_launch(op);
}

void scale_heads(const ScaleHeadsParams& p, void* stream) {
  const char* op = "scale_heads";
  check_scale_heads(p, op);
  LT2_CHECK(p.y, op, ": y must be given");
  const int64_t n = p.rows * p.heads * p.head_dim;
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) { scale_heads_kernel<decltype(t)><<<elementwise_blocks(n), kThreads, 0, s>>>(p); });
  check_launch(op);
}

void scale_heads_backward(const ScaleHeadsBackwardParams& bp, void* stream) {
  const char* op = "scale_heads_backward";
  const ScaleHeadsParams& p = bp.forward;
  check_scale_heads(p, op);
  LT2_CHECK(bp.dy && bp.dx && bp.ds, op, ": dy, dx and ds must be given");
  const int64_t pairs = p.rows * p.heads;
  if (pairs == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) {
    scale_heads_backward_kernel<decltype(t)><<<elementwise_blocks(pairs * 32), kThreads, 0, s>>>(bp);
  });
  check_launch(op);
}

}  // namespace lt2::kernels
