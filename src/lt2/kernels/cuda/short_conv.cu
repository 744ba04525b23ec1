// The causal depthwise short convolution (+ SiLU) of the linear mixers, forward and backward, over
// many tokens (training, prefill): kernels/prefill.h has the formulas.
//
// Floor. Per token and channel the forward reads x and writes y, the backward reads x and dy and
// writes dx (pre recomputed from the W inputs each thread already holds): 4 and 6 bytes in bf16.
// lt2-gdn-1.3b's three convolutions (q, k: 1536 channels, v: 3072) at 8 x 4096 tokens are 0.81 GB
// forward and 1.21 GB backward: ~0.17 and ~0.25 ms at the H200's ~4.8 TB/s. FLOPs are ~2 W per
// value: nothing. The reference it replaces (cat of the past inputs, transposes around a depthwise
// conv1d, a separate SiLU, and autograd's backward of each) moves the tensor several times over.
//
// Design.
// - A block is 32 channels x 8 token tiles (256 threads); a thread owns one channel of one tile of
//   TT consecutive tokens and walks them in order, the last W inputs in registers, so every input
//   is loaded once (plus the W - 1 before the tile). A warp reads 32 consecutive channels of one
//   token: one 64-byte (bf16) or 128-byte (fp32) segment.
// - W is a runtime value up to MaxW (4 or 8): the taps sit right-aligned in fixed-size register
//   arrays (tap distance d at index MaxW - 1 - d, zero weights beyond W), so every array index is a
//   compile-time constant and nothing spills to local memory.
// - Backward: dpre[s] = dy[s] * silu'(pre[s]) for s from the tile start on; dx[t] needs dpre[t ..
//   t + W - 1], so it is written MaxW - 1 tokens behind, and the walk runs MaxW - 1 tokens past the
//   tile (the redundant lookahead is (MaxW - 1) / TT of the loads). dweight and dbias sum over the
//   tile in registers, over the block's 8 tiles in shared memory, then one atomicAdd per block.
// - Loads go out kInFlight tokens at a time before any is used: one load in flight per thread
//   would keep ~4 KiB in flight per SM, far below the ~20 KiB the HBM latency-bandwidth product
//   asks (Little's law: 4.8 TB/s x ~0.6 us over 132 SMs). The loads are unconditional (a token
//   past the tile or row re-reads the last one inside and is not used): a load behind its own branch
//   is consumed before the next one issues, which would make the walk one memory latency per token.
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kChannels = 32;  // per block (threadIdx.x)
constexpr int kTiles = 8;      // token tiles per block (threadIdx.y)
constexpr int kForwardTile = 32;
constexpr int kBackwardTile = 64;
constexpr int kInFlight = 8;  // tokens whose loads a thread issues before it uses the first
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// The thread's channel, batch row and tile, and the row's pointers.
template <typename T>
struct ConvThread {
  int c, b, t0, t1;  // channel, row, tile [t0, t1)
  bool active;       // c < C and the tile starts inside the row
  const T* x;        // x[b, 0, c]
  const int64_t* offsets;
  __device__ ConvThread(const ShortConvParams& p, int tile) {
    c = blockIdx.x * kChannels + threadIdx.x;
    b = blockIdx.z;
    t0 = (blockIdx.y * kTiles + threadIdx.y) * tile;
    t1 = min(t0 + tile, p.seq);
    active = c < p.channels && t0 < p.seq;
    x = static_cast<const T*>(p.x) + static_cast<int64_t>(b) * p.seq * p.x_token_stride + c;
    offsets = p.offsets ? p.offsets + static_cast<int64_t>(b) * p.seq : nullptr;
  }
  // x at token t of the row, 0 <= t < seq: no branch, so a batch of these issues back to back.
  __device__ T at(const ShortConvParams& p, int t) const { return x[static_cast<int64_t>(t) * p.x_token_stride]; }
  // x at token t, or the past inputs for t < 0 (the taps before a tile).
  __device__ float load(const ShortConvParams& p, int t) const {
    if (t >= 0) return to_float(at(p, t));
    if (!p.past) return 0.f;
    const T* past = static_cast<const T*>(p.past) + static_cast<int64_t>(b) * (p.width - 1) * p.channels + c;
    return to_float(past[static_cast<int64_t>(p.width - 1 + t) * p.channels]);
  }
  // The token's position in its document (how far back its taps may reach; at most MaxW - 1 matters).
  __device__ int reach(int t) const { return offsets ? static_cast<int>(min(offsets[t], int64_t{kMaxConvWidth})) : kMaxConvWidth; }
};

// Weights right-aligned: w[MaxW - 1 - d] multiplies the input d tokens back; zero for d >= W.
template <typename T, int MaxW>
__device__ __forceinline__ void load_taps(const ShortConvParams& p, int c, float (&w)[MaxW]) {
#pragma unroll
  for (int j = 0; j < MaxW; ++j) {
    const int d = MaxW - 1 - j;
    w[j] = d < p.width ? param_as_float<T>(p.weight, p.weight_dtype, static_cast<int64_t>(c) * p.width + (p.width - 1 - d))
                       : 0.f;
  }
}

// pre = bias + sum_d w[d] x[t - d] over the taps that stay inside the document.
template <int MaxW>
__device__ __forceinline__ float conv_at(const float (&w)[MaxW], const float (&xs)[MaxW], float bias, int reach) {
  float pre = bias;
#pragma unroll
  for (int j = 0; j < MaxW; ++j)
    if (MaxW - 1 - j <= reach) pre = fmaf(w[j], xs[j], pre);
  return pre;
}

template <typename A, int MaxW>
__device__ __forceinline__ void shift(A (&a)[MaxW]) {
#pragma unroll
  for (int j = 0; j + 1 < MaxW; ++j) a[j] = a[j + 1];
}

template <typename T, int MaxW>
__global__ void __launch_bounds__(kChannels* kTiles) short_conv_forward_kernel(const ShortConvParams p) {
  const ConvThread<T> th(p, kForwardTile);
  if (!th.active) return;
  float w[MaxW], xs[MaxW];
  load_taps<T>(p, th.c, w);
  const float bias = p.bias ? p.bias[th.c] : 0.f;
#pragma unroll
  for (int j = 0; j + 1 < MaxW; ++j) {
    const int d = MaxW - 1 - j;
    xs[j] = d < p.width ? th.load(p, th.t0 - d) : 0.f;
  }
  T* y = static_cast<T*>(p.y) + static_cast<int64_t>(th.b) * p.seq * p.channels + th.c;
  for (int t = th.t0; t < th.t1; t += kInFlight) {
    T in[kInFlight];
    int reach[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {  // past the tile: its last token again, unused
      const int tu = min(t + u, th.t1 - 1);
      in[u] = th.at(p, tu);
      reach[u] = th.reach(tu);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      xs[MaxW - 1] = to_float(in[u]);
      const float pre = conv_at(w, xs, bias, reach[u]);
      if (t + u < th.t1) y[static_cast<int64_t>(t + u) * p.channels] = from_float<T>(p.silu ? pre * sigmoid(pre) : pre);
      shift(xs);
    }
  }
}

template <typename T, int MaxW>
__global__ void __launch_bounds__(kChannels* kTiles) short_conv_backward_kernel(const ShortConvBackwardParams bp) {
  const ShortConvParams& p = bp.forward;
  const ConvThread<T> th(p, kBackwardTile);
  float dw[MaxW] = {}, dbias = 0.f;
  if (th.active) {
    float w[MaxW], xs[MaxW], dpre[MaxW] = {};
    int reach[MaxW] = {};
    load_taps<T>(p, th.c, w);
    const float bias = p.bias ? p.bias[th.c] : 0.f;
#pragma unroll
    for (int j = 0; j + 1 < MaxW; ++j) {
      const int d = MaxW - 1 - j;
      xs[j] = d < p.width ? th.load(p, th.t0 - d) : 0.f;
    }
    const int64_t row = static_cast<int64_t>(th.b) * p.seq * p.channels + th.c;
    const T* dy = static_cast<const T*>(bp.dy) + row;
    T* dx = static_cast<T*>(bp.dx) + row;
    const int s_end = th.t1 + MaxW - 1;  // dx of the tile's last token needs dpre up to t1 + W - 2
    const int s_last = min(s_end, p.seq) - 1;
    for (int s0 = th.t0; s0 < s_end; s0 += kInFlight) {
      T in[kInFlight], grad[kInFlight];
      int in_reach[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {  // past the row: its last token again, read as zeros below
        const int su = min(s0 + u, s_last);
        in[u] = th.at(p, su);
        grad[u] = dy[static_cast<int64_t>(su) * p.channels];
        in_reach[u] = th.reach(su);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int s = s0 + u;
        if (s >= s_end) break;
        // The newest ring entries: token s (past the row: zeros, which no gradient reads).
        const bool inside = s <= s_last;
        xs[MaxW - 1] = inside ? to_float(in[u]) : 0.f;
        reach[MaxW - 1] = inside ? in_reach[u] : 0;
        const float pre = conv_at(w, xs, bias, reach[MaxW - 1]);
        float d = inside ? to_float(grad[u]) : 0.f;
        if (p.silu) {
          const float sg = sigmoid(pre);
          d *= sg * (1.f + pre * (1.f - sg));
        }
        dpre[MaxW - 1] = d;
        if (s < th.t1) {
#pragma unroll
          for (int j = 0; j < MaxW; ++j)
            if (MaxW - 1 - j <= reach[MaxW - 1]) dw[j] = fmaf(d, xs[j], dw[j]);
          dbias += d;
        }
        // dx[t], t = s - (MaxW - 1): sum_d w(d) dpre[t + d] over the taps of t + d that reach t.
        const int t = s - (MaxW - 1);
        if (t >= th.t0) {
          float acc = 0.f;
#pragma unroll
          for (int dist = 0; dist < MaxW; ++dist)
            if (dist <= reach[dist]) acc = fmaf(w[MaxW - 1 - dist], dpre[dist], acc);
          dx[static_cast<int64_t>(t) * p.channels] = from_float<T>(acc);
        }
        shift(xs);
        shift(dpre);
        shift(reach);
      }
    }
  }
  // Sum dweight and dbias over the block's tiles, then one atomic per channel and tap.
  __shared__ float partial[kTiles][MaxW + 1][kChannels];
#pragma unroll
  for (int j = 0; j < MaxW; ++j) partial[threadIdx.y][j][threadIdx.x] = dw[j];
  partial[threadIdx.y][MaxW][threadIdx.x] = dbias;
  __syncthreads();
  const int c = blockIdx.x * kChannels + threadIdx.x;
  if (c >= p.channels) return;
  for (int j = threadIdx.y; j <= MaxW; j += kTiles) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) sum += partial[i][j][threadIdx.x];
    if (j == MaxW) {
      if (bp.dbias) atomicAdd(bp.dbias + c, sum);
    } else if (const int d = MaxW - 1 - j; d < p.width) {
      atomicAdd(bp.dweight + static_cast<int64_t>(c) * p.width + (p.width - 1 - d), sum);
    }
  }
}

void check_params(const ShortConvParams& p, const char* op) {
  LT2_CHECK(p.width >= 1 && p.width <= kMaxConvWidth, op, ": width must be in [1, ", kMaxConvWidth, "], found ",
            p.width);
  LT2_CHECK(p.batch >= 0 && p.batch <= 65535 && p.seq >= 0 && p.channels >= 0, op, ": batch ", p.batch,
            " must be in [0, 65535], seq ", p.seq, " and channels ", p.channels, " >= 0");
  LT2_CHECK(p.x && p.weight, op, ": x and weight must be given");
  LT2_CHECK(p.x_token_stride >= p.channels, op, ": x_token_stride (", p.x_token_stride, ") must be >= channels (",
            p.channels, ")");
  LT2_CHECK(p.weight_dtype == DType::Float32 || p.weight_dtype == p.dtype, op,
            ": the weight must be fp32 or of x's dtype");
}

dim3 conv_grid(const ShortConvParams& p, int tile) {
  return dim3(ceil_div(p.channels, kChannels), ceil_div(p.seq, tile * kTiles), p.batch);
}

// Calls f(T{}, MaxW) with T the CUDA type of the params' dtype and MaxW the register taps its width
// needs: 4 (W <= 4) or kMaxConvWidth.
template <typename F>
void dispatch_conv(const ShortConvParams& p, F&& f) {
  dispatch_dtype(p.dtype, [&](auto t) {
    if (p.width <= 4) f(t, std::integral_constant<int, 4>{});
    else f(t, std::integral_constant<int, kMaxConvWidth>{});
  });
}

}  // namespace

void short_conv_forward(const ShortConvParams& p, void* stream) {
  check_params(p, "short_conv_forward");
  LT2_CHECK(p.y, "short_conv_forward: y must be given");
  if (p.batch == 0 || p.seq == 0 || p.channels == 0) return;
  const dim3 grid = conv_grid(p, kForwardTile), block(kChannels, kTiles);
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_conv(p, [&](auto t, auto max_w) {
    short_conv_forward_kernel<decltype(t), decltype(max_w)::value><<<grid, block, 0, s>>>(p);
  });
  check_launch("short_conv_forward");
}

void short_conv_backward(const ShortConvBackwardParams& bp, void* stream) {
  const ShortConvParams& p = bp.forward;
  check_params(p, "short_conv_backward");
  LT2_CHECK(!p.past, "short_conv_backward: no past inputs (the op differentiates only from a fresh start)");
  LT2_CHECK(bp.dy && bp.dx && bp.dweight, "short_conv_backward: dy, dx and dweight must be given");
  if (p.batch == 0 || p.seq == 0 || p.channels == 0) return;
  const dim3 grid = conv_grid(p, kBackwardTile), block(kChannels, kTiles);
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_conv(p, [&](auto t, auto max_w) {
    short_conv_backward_kernel<decltype(t), decltype(max_w)::value><<<grid, block, 0, s>>>(bp);
  });
  check_launch("short_conv_backward");
}

}  // namespace lt2::kernels
