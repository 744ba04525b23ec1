// Elementwise kernels of a block: the RMSNorm of its decode path (decode.h: rms_norm), the gated
// product of SwiGLU and the attention output gate (prefill.h: gated_product_*) and the gated sum of
// NSA's branches (prefill.h: gated_sum_*).
//
// rms_norm: at decode a row is a few KiB, so it is launch-bound; its point is replacing the chain
// of small libtorch kernels (dtype casts, add, norm) with one launch. At prefill it is memory-bound:
// 8k rows of 2,048 bf16 (lt2-gdn-1.3b) move 64 MB a call (96 MB with the residual add), ~20 us
// (~29) at ~3.3 TB/s.
//
// Gated product floor (H100, ~3.3 TB/s): lt-100m's SwiGLU at 16 x 2048 tokens is 32,768 rows of
// 2,048 bf16, 134 MB a tensor: forward 3 tensors, ~0.12 ms; backward 5, ~0.20 ms. The unfused
// libtorch form runs silu and mul forward (5 tensor passes) and, backward, two muls, silu_backward
// and a copy of each half into the gradient of the packed w1|w3 output (~11 passes).
// Design: a thread takes 16 bytes of T (8 bf16 / fp16 or 4 fp32 columns of one row) where hidden,
// the row strides and the pointers allow 16-byte accesses, else one element; so a thread divides
// once for its row and moves its 48 (forward) or 80 (backward) bytes in 16-byte accesses.
// The gated sum of NSA's branches (three [32768, 12, 64] bf16 tensors at lt-100m/nsa's 16 x 2048, 50 MB
// each): forward 4 tensors (~0.06 ms), backward 7 (~0.11 ms), where the libtorch form (sigmoid, three
// products, two sums; backward three products, three products and head sums for the gates) made ~15
// passes. A thread takes a 16-byte piece of a row of every branch.
#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/prefill.h"

namespace lt2::kernels {
namespace {

constexpr int kNormThreads = 256;
constexpr int kGatedThreads = 256;

// One block per row. Two passes over the row: the sum of squares, then the scaled output. The
// second pass reads back what the same thread wrote or read in the first (same index mapping),
// so it needs neither shared memory for the row nor a barrier, and the row is in L1/L2.
template <typename T, bool kResidual>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const RmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int d = p.dim;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* residual = kResidual ? static_cast<const T*>(p.residual) + row * p.residual_row_stride : nullptr;
  T* h = kResidual ? static_cast<T*>(p.h) + row * d : nullptr;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < d; i += kNormThreads) {
    float v = to_float(x[i]);
    if constexpr (kResidual) {
      const T hv = from_float<T>(v + to_float(residual[i]));  // the residual stream's rounding
      h[i] = hv;
      v = to_float(hv);
    }
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / d + p.eps);
  const T* src = kResidual ? h : x;
  const T* weight = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * d;
  for (int i = threadIdx.x; i < d; i += kNormThreads)
    y[i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
}

template <typename T, int kVec>
__device__ __forceinline__ void load_piece(T (&dst)[kVec], const T* src) {
  if constexpr (kVec * sizeof(T) == 16) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  else
#pragma unroll
    for (int j = 0; j < kVec; ++j) dst[j] = src[j];
}

template <typename T, int kVec>
__device__ __forceinline__ void store_piece(T* dst, const T (&src)[kVec]) {
  if constexpr (kVec * sizeof(T) == 16) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  else
#pragma unroll
    for (int j = 0; j < kVec; ++j) dst[j] = src[j];
}

// The same in 16-byte pieces where the row is whole pieces and every pointer and stride allows
// them: thread i holds pieces i, i + 256, ... (kPieces of them) in registers, so the row is read
// once. At prefill (8k rows of 2,048 bf16: one piece a thread) the element form above issues eight
// 2-byte loads a thread and reads the row twice, ~2.4x the traffic floor.
template <typename T, bool kResidual, int kPieces>
__global__ void __launch_bounds__(kNormThreads) rms_norm_vec_kernel(const RmsNormParams p) {
  constexpr int kVec = 16 / sizeof(T);
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int pieces = p.dim / kVec;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* residual = kResidual ? static_cast<const T*>(p.residual) + row * p.residual_row_stride : nullptr;
  T* h = kResidual ? static_cast<T*>(p.h) + row * p.dim : nullptr;
  alignas(16) T v[kPieces][kVec];
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < kPieces; ++j) {
    const int c = (threadIdx.x + j * kNormThreads) * kVec;
    if (c >= pieces * kVec) break;
    load_piece(v[j], x + c);
    if constexpr (kResidual) {
      alignas(16) T r[kVec];
      load_piece(r, residual + c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[j][e] = from_float<T>(to_float(v[j][e]) + to_float(r[e]));  // as stored
      store_piece(h + c, v[j]);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum_sq += to_float(v[j][e]) * to_float(v[j][e]);
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / p.dim + p.eps);
  const T* weight = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * p.dim;
#pragma unroll
  for (int j = 0; j < kPieces; ++j) {
    const int c = (threadIdx.x + j * kNormThreads) * kVec;
    if (c >= pieces * kVec) break;
    alignas(16) T w[kVec], out[kVec];
    load_piece(w, weight + c);
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = from_float<T>(to_float(v[j][e]) * inv_rms * to_float(w[e]));
    store_piece(y + c, out);
  }
}

__device__ __forceinline__ float gate_activation(float x, GateAct act) {
  return act == GateAct::Sigmoid ? sigmoid(x) : silu(x);
}

// d act(x) / dx: sigmoid' = s (1 - s); silu' = s (1 + x (1 - s)), s = sigmoid(x).
__device__ __forceinline__ float gate_activation_grad(float x, GateAct act) {
  const float s = sigmoid(x);
  return act == GateAct::Sigmoid ? s * (1.f - s) : s * (1.f + x * (1.f - s));
}

// Thread idx takes columns [c, c + kVec) of one row (prefill.h: GatedProductParams).
template <typename T, int kVec, bool kBackward>
__global__ void __launch_bounds__(kGatedThreads) gated_product_kernel(const GatedProductParams p) {
  const int per_row = p.hidden / kVec;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kGatedThreads + threadIdx.x;
  if (idx >= p.rows * per_row) return;
  const int64_t row = idx / per_row;
  const int c = static_cast<int>(idx - row * per_row) * kVec;
  alignas(16) T a[kVec], b[kVec];
  load_piece(a, static_cast<const T*>(p.a) + row * p.a_row_stride + c);
  load_piece(b, static_cast<const T*>(p.b) + row * p.b_row_stride + c);
  if constexpr (!kBackward) {
    alignas(16) T out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const T act = from_float<T>(gate_activation(to_float(a[j]), p.act));
      out[j] = from_float<T>(to_float(act) * to_float(b[j]));
    }
    store_piece(static_cast<T*>(p.out) + idx * kVec, out);  // packed: row * hidden + c
  } else {
    alignas(16) T dout[kVec], da[kVec], db[kVec];
    load_piece(dout, static_cast<const T*>(p.dout) + idx * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = to_float(a[j]), g = to_float(dout[j]);
      const float act = to_float(from_float<T>(gate_activation(x, p.act)));  // as the forward rounded it
      da[j] = from_float<T>(g * to_float(b[j]) * gate_activation_grad(x, p.act));
      db[j] = from_float<T>(g * act);
    }
    store_piece(static_cast<T*>(p.da) + row * p.da_row_stride + c, da);
    store_piece(static_cast<T*>(p.db) + row * p.db_row_stride + c, db);
  }
}

// Thread idx takes columns [c, c + kVec) of one row (b, t, h) (prefill.h: GatedSumParams); a row's
// D / kVec threads are consecutive lanes of one warp (D / kVec divides 32), so the backward sums a
// gate's dot product over them by shuffles. Threads past the last row take part in the shuffles
// with zeros and store nothing.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kGatedThreads) gated_sum_kernel(const GatedSumParams p) {
  constexpr int kVec = 16 / sizeof(T);
  const int per_row = p.head_dim / kVec;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kGatedThreads + threadIdx.x;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.length * p.heads;
  const bool live = idx < rows * per_row;
  if (!kBackward && !live) return;
  const int64_t row = live ? idx / per_row : 0;
  const int c = static_cast<int>(idx % per_row) * kVec;
  const int h = static_cast<int>(row % p.heads);
  const int64_t bt = row / p.heads;
  const int64_t t = bt % p.length, b = bt / p.length;
  const T* logits = static_cast<const T*>(p.logits) + b * p.logit_strides[0] + t * p.logit_strides[1] +
                    h * p.logit_strides[2];
  alignas(16) T dout[kVec];
  float acc[kVec] = {};
  if constexpr (kBackward) {
    if (live) {
      load_piece(dout, static_cast<const T*>(p.dout) + idx * kVec);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) dout[j] = from_float<T>(0.f);
    }
  }
#pragma unroll
  for (int i = 0; i < kGatedSumMaxBranches; ++i) {
    if (i >= p.branches) break;
    const float s = sigmoid(to_float(logits[i]));
    alignas(16) T x[kVec];
    if (live) {
      load_piece(x, static_cast<const T*>(p.x[i]) + b * p.x_strides[i][0] + t * p.x_strides[i][1] +
                        h * p.x_strides[i][2] + c);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = from_float<T>(0.f);
    }
    if constexpr (!kBackward) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += s * to_float(x[j]);
    } else {
      alignas(16) T dx[kVec];
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float g = to_float(dout[j]);
        dot += g * to_float(x[j]);
        dx[j] = from_float<T>(s * g);
      }
      for (int lanes = per_row / 2; lanes >= 1; lanes /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, lanes);
      if (!live) continue;
      store_piece(static_cast<T*>(p.dx[i]) + idx * kVec, dx);
      if (c == 0) static_cast<T*>(p.dlogits)[row * p.branches + i] = from_float<T>(s * (1.f - s) * dot);
    }
  }
  if constexpr (!kBackward) {
    alignas(16) T out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = from_float<T>(acc[j]);
    store_piece(static_cast<T*>(p.out) + idx * kVec, out);  // packed: row * D + c
  }
}

}  // namespace

void rms_norm(const RmsNormParams& p, void* stream) {
  LT2_CHECK(p.dim >= 1 && p.rows >= 0 && p.rows <= INT32_MAX && (!p.residual || p.h),
            "rms_norm: ", p.rows, " rows of dim ", p.dim, " (an h output is needed with a residual)");
  if (p.rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(p.rows);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const int pieces_per_thread = (p.dim / kVec + kNormThreads - 1) / kNormThreads;
    const bool vec = p.dim % kVec == 0 && pieces_per_thread <= 4 && p.x_row_stride % kVec == 0 &&
                     aligned16(p.x) && aligned16(p.weight) && aligned16(p.y) &&
                     (!p.residual || (p.residual_row_stride % kVec == 0 && aligned16(p.residual) && aligned16(p.h)));
    auto launch = [&](auto residual, auto pieces) {
      constexpr bool kResidual = decltype(residual)::value;
      constexpr int kPieces = decltype(pieces)::value;
      if (vec) rms_norm_vec_kernel<T, kResidual, kPieces><<<grid, kNormThreads, 0, s>>>(p);
      else rms_norm_kernel<T, kResidual><<<grid, kNormThreads, 0, s>>>(p);
    };
    auto with_pieces = [&](auto residual) {
      if (pieces_per_thread <= 1) launch(residual, std::integral_constant<int, 1>{});
      else if (pieces_per_thread <= 2) launch(residual, std::integral_constant<int, 2>{});
      else launch(residual, std::integral_constant<int, 4>{});
    };
    if (p.residual) with_pieces(std::true_type{});
    else with_pieces(std::false_type{});
  });
  check_launch("rms_norm");
}

namespace {

template <bool kBackward>
void launch_gated_product(const GatedProductParams& p, void* stream, const char* op) {
  LT2_CHECK(p.hidden >= 1 && p.rows >= 0 && (p.act == GateAct::Swish || p.act == GateAct::Sigmoid), op, ": ",
            p.rows, " rows of hidden size ", p.hidden, " (act SiLU or sigmoid)");
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    bool vec = p.hidden % kVec == 0 && p.a_row_stride % kVec == 0 && p.b_row_stride % kVec == 0 &&
               aligned16(p.a) && aligned16(p.b);
    if constexpr (kBackward)
      vec = vec && p.da_row_stride % kVec == 0 && p.db_row_stride % kVec == 0 && aligned16(p.dout) &&
            aligned16(p.da) && aligned16(p.db);
    else
      vec = vec && aligned16(p.out);
    const int64_t threads = p.rows * p.hidden / (vec ? kVec : 1);
    const int64_t blocks = (threads + kGatedThreads - 1) / kGatedThreads;
    LT2_CHECK(blocks <= INT32_MAX, op, ": ", p.rows, " x ", p.hidden, " elements is too many for one launch");
    const auto s = static_cast<cudaStream_t>(stream);
    if (vec) gated_product_kernel<T, kVec, kBackward><<<static_cast<unsigned>(blocks), kGatedThreads, 0, s>>>(p);
    else gated_product_kernel<T, 1, kBackward><<<static_cast<unsigned>(blocks), kGatedThreads, 0, s>>>(p);
  });
  check_launch(op);
}

}  // namespace

void gated_product_forward(const GatedProductParams& p, void* stream) {
  launch_gated_product<false>(p, stream, "gated_product_forward");
}

void gated_product_backward(const GatedProductParams& p, void* stream) {
  launch_gated_product<true>(p, stream, "gated_product_backward");
}

bool gated_sum_supported(const GatedSumParams& p) {
  const int vec = p.dtype == DType::Float32 ? 4 : 8;
  const int per_row = p.head_dim / vec;
  bool ok = p.branches >= 1 && p.branches <= kGatedSumMaxBranches && p.head_dim % vec == 0 && per_row >= 1 &&
            per_row <= 32 && (per_row & (per_row - 1)) == 0 && p.batch >= 0 && p.length >= 0 && p.heads >= 1 &&
            static_cast<int64_t>(p.batch) * p.length * p.heads * per_row <= int64_t{kGatedThreads} * INT32_MAX;
  for (int i = 0; ok && i < p.branches; ++i)
    ok = aligned16(p.x[i]) && p.x_strides[i][0] % vec == 0 && p.x_strides[i][1] % vec == 0 &&
         p.x_strides[i][2] % vec == 0;
  return ok;
}

namespace {

template <bool kBackward>
void launch_gated_sum(const GatedSumParams& p, void* stream, const char* op) {
  LT2_CHECK(gated_sum_supported(p), op, ": ", p.branches, " branches of head dim ", p.head_dim, " (1 to ",
            kGatedSumMaxBranches, " branches; rows of a power-of-two count of 16-byte pieces, at most 32; 16-byte "
            "aligned branches and strides)");
  LT2_CHECK(p.logits && (kBackward ? p.dout && p.dlogits : p.out != nullptr), op, ": an input or output is missing");
  const int64_t threads =
      static_cast<int64_t>(p.batch) * p.length * p.heads * (p.head_dim / (p.dtype == DType::Float32 ? 4 : 8));
  if (threads == 0) return;
  const auto blocks = static_cast<unsigned>((threads + kGatedThreads - 1) / kGatedThreads);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) {
    gated_sum_kernel<decltype(t), kBackward><<<blocks, kGatedThreads, 0, s>>>(p);
  });
  check_launch(op);
}

}  // namespace

void gated_sum_forward(const GatedSumParams& p, void* stream) {
  launch_gated_sum<false>(p, stream, "gated_sum_forward");
}

void gated_sum_backward(const GatedSumParams& p, void* stream) {
  launch_gated_sum<true>(p, stream, "gated_sum_backward");
}

}  // namespace lt2::kernels
