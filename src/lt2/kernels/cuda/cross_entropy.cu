// Softmax cross-entropy of fp32 logit rows against hard labels with its gradient, one launch a chunk
// of the LM head's loss walk (prefill.h: cross_entropy_forward; ops/loss/lm_head_loss.cpp).
//
// Floor. A chunk of n rows of V logits reads the fp32 logits (4 n V bytes) and writes the gradient in
// its dtype (2 n V in bf16): at lt-100m's chunk (4096 x 32768) 0.54 + 0.27 GB, ~0.24 ms at ~3.3 TB/s.
// The libtorch form (log_softmax, gather, exp into the gradient's dtype, scatter of the label's p - 1)
// writes and re-reads the fp32 log-probabilities too: ~1.9 GB, measured 0.97 ms a chunk on an H100
// (log_softmax 0.66, exp 0.31).
//
// Design. A block of 1024 threads a row. Pass 1: each thread keeps a running max and a sum of
// exponentials scaled to it over its elements (16-byte loads where the row allows), the block merges
// the pairs; lse = max + log(sum). Pass 2 re-reads the row and writes exp(x - lse), minus 1 at the
// label, rounded once. At two blocks an SM the rows in flight (132 SMs x 2 x 128 KB at V 32k, ~34 MB)
// fit the L2 (50 MB), so the second read comes from it. exp and log are the accurate fp32 forms (the
// fp32 path's tolerance).
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 1024;

// (max, sum of exp(x - max)) of a set of values, merged pairwise. An empty set is (-inf, 0).
struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum add_value(MaxSum a, float x) {
  if (x == -INFINITY) return a;  // no mass (and no -inf - -inf)
  if (x <= a.max) return {a.max, a.sum + expf(x - a.max)};
  return {x, a.sum * expf(a.max - x) + 1.f};
}

// The block's merged pair, returned to every thread; scratch holds 32 pairs.
__device__ __forceinline__ MaxSum block_merge(MaxSum v, MaxSum* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, off), __shfl_xor_sync(0xffffffffu, v.sum, off)};
    v = merge(v, other);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  MaxSum total{-INFINITY, 0.f};
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total = merge(total, scratch[w]);
  return total;
}

// Four gradient values stored at once.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

// Vec logits a load (4: 16-byte loads and one store of four gradients, where V is a multiple of 4 and
// the logits and the gradient are 16-byte aligned; else 1).
template <typename TG, int Vec>
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(const CrossEntropyParams p) {
  __shared__ MaxSum scratch[32];
  const int64_t row = blockIdx.x;
  const float* x = p.logits + row * p.vocab;
  const int pieces = p.vocab / Vec;
  MaxSum acc{-INFINITY, 0.f};
  for (int i = threadIdx.x; i < pieces; i += kThreads) {
    if constexpr (Vec == 4) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      acc = add_value(add_value(add_value(add_value(acc, v.x), v.y), v.z), v.w);
    } else {
      acc = add_value(acc, x[i]);
    }
  }
  const MaxSum total = block_merge(acc, scratch);
  const float lse = total.max + logf(total.sum);
  const int64_t label = p.labels[row];
  const bool counted = label != p.ignore_index;
  if (threadIdx.x == 0) p.loss[row] = counted ? lse - x[label] : 0.f;
  if (!p.grad) return;
  TG* g = static_cast<TG*>(p.grad) + row * p.vocab;
  // exp(x - lse) of element j, less 1 at the label; 0 for an ignored row.
  auto grad_of = [&](float xj, int j) { return counted ? expf(xj - lse) - (j == label ? 1.f : 0.f) : 0.f; };
  for (int i = threadIdx.x; i < pieces; i += kThreads) {
    if constexpr (Vec == 4) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      const int j = 4 * i;
      Pack4<TG> out;
      out.v[0] = from_float<TG>(grad_of(v.x, j)), out.v[1] = from_float<TG>(grad_of(v.y, j + 1));
      out.v[2] = from_float<TG>(grad_of(v.z, j + 2)), out.v[3] = from_float<TG>(grad_of(v.w, j + 3));
      reinterpret_cast<Pack4<TG>*>(g)[i] = out;  // one 8- or 16-byte store
    } else {
      g[i] = from_float<TG>(grad_of(x[i], i));
    }
  }
}

}  // namespace

bool cross_entropy_supported(int64_t rows, int64_t vocab) {
  return rows >= 0 && rows <= INT32_MAX && vocab >= 1 && vocab <= INT32_MAX / 4;
}

void cross_entropy_forward(const CrossEntropyParams& p, void* stream) {
  LT2_CHECK(cross_entropy_supported(p.rows, p.vocab), "cross_entropy_forward: rows ", p.rows, " and vocabulary ",
            p.vocab, " outside the kernel's bounds");
  LT2_CHECK(p.logits && p.labels && p.loss, "cross_entropy_forward: logits, labels and loss must be given");
  if (p.rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const bool vec = p.vocab % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.grad) % 16 == 0;
  dispatch_dtype(p.grad_dtype, [&](auto t) {
    using TG = decltype(t);
    if (vec) cross_entropy_kernel<TG, 4><<<static_cast<unsigned>(p.rows), kThreads, 0, s>>>(p);
    else cross_entropy_kernel<TG, 1><<<static_cast<unsigned>(p.rows), kThreads, 0, s>>>(p);
  });
  check_launch("cross_entropy_forward");
}

}  // namespace lt2::kernels
