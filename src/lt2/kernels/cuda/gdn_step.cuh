// The pieces of the GDN decode step shared by gdn_decode's forms (recurrent_decode.cu) and by
// gemv_chain's GDN prelude (gemv_chain.cu): the short convs, the L2 norms of q and k, the gates,
// and the whole register-form step for one (sequence, head).
#pragma once
#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
// Internal linkage: each .cu that includes this gets its own instances (see split_combine.cuh).
namespace {

// oldest slot, consecutive slots `channels` apart; `weight` at its taps.
template <typename T>
__device__ __forceinline__ float conv_silu(T x_new, const T* weight, const T* window, int W, int channels) {
  float acc = to_float(weight[W - 1]) * to_float(x_new);
  for (int j = 0; j < W - 1; ++j) acc += to_float(weight[j]) * to_float(window[j * channels]);
  return acc * sigmoid(acc);
}

// The window shift after conv_silu: drop the oldest input, append x_new.
template <typename T>
__device__ __forceinline__ void conv_shift(T x_new, T* window, int W, int channels) {
  for (int j = 0; j + 1 < W - 1; ++j) window[j * channels] = window[(j + 1) * channels];
  if (W > 1) window[(W - 2) * channels] = x_new;
}

// One window of the batch: [W-1, channels] of sequence b.
template <typename T>
__device__ T* batch_window(void* window, int b, int W, int channels) {
  return static_cast<T*>(window) + static_cast<int64_t>(b) * (W - 1) * channels;
}

// q, k ([K]) and v ([V]) of (sequence b, head h) in shared memory: SiLU(ShortConv) of the new
// inputs, the conv windows advanced in place. The calling group must own the whole head's
// channels (it is their only reader and writer); the threads of group g stride over them.
template <typename T, typename Group>
__device__ __forceinline__ void head_conv_silu_w(const GdnDecodeParams& p, int b, int h, float* s_q, float* s_k,
                                                 float* s_v, const int W, Group g) {
  const int K = p.head_k, V = p.head_v;
  const int qk_channels = p.heads * K, v_channels = p.heads * V;
  T* q_window = batch_window<T>(p.q_conv_window, b, W, qk_channels);
  T* k_window = batch_window<T>(p.k_conv_window, b, W, qk_channels);
  T* v_window = batch_window<T>(p.v_conv_window, b, W, v_channels);
  const T* q_raw = static_cast<const T*>(p.q_raw) + b * p.q_stride;
  const T* k_raw = static_cast<const T*>(p.k_raw) + b * p.k_stride;
  const T* v_raw = static_cast<const T*>(p.v_raw) + b * p.v_stride;
  // One pass: a thread reads all of its channels' inputs, windows and taps before it writes any
  // window, so those loads are in flight together (the windows' pointers may alias as far as
  // the compiler knows, so interleaved shifts would serialise them into three round trips).
  #pragma unroll 1  // a thread takes ~1 element: no trip-count division
  for (int i = g.rank(); i < max(K, V); i += g.size()) {
    const int cq = h * K + i, cv = h * V + i;
    float q = 0.f, k = 0.f, v = 0.f;
    if (i < K) {
      q = conv_silu(q_raw[cq], static_cast<const T*>(p.q_conv_weight) + cq * W, q_window + cq, W, qk_channels);
      k = conv_silu(k_raw[cq], static_cast<const T*>(p.k_conv_weight) + cq * W, k_window + cq, W, qk_channels);
    }
    if (i < V) v = conv_silu(v_raw[cv], static_cast<const T*>(p.v_conv_weight) + cv * W, v_window + cv, W, v_channels);
    if (i < K) {
      s_q[i] = q, s_k[i] = k;
      conv_shift(q_raw[cq], q_window + cq, W, qk_channels);
      conv_shift(k_raw[cq], k_window + cq, W, qk_channels);
    }
    if (i < V) {
      s_v[i] = v;
      conv_shift(v_raw[cv], v_window + cv, W, v_channels);
    }
  }
}

// ShortConv's width in every preset: head_conv_silu unrolls its tap loops for it.
constexpr int kCommonConvSize = 4;

template <typename T, typename Group = WholeBlock>
__device__ void head_conv_silu(const GdnDecodeParams& p, int b, int h, float* s_q, float* s_k, float* s_v,
                               Group g = {}) {
  if (p.conv_size == kCommonConvSize) head_conv_silu_w<T>(p, b, h, s_q, s_k, s_v, kCommonConvSize, g);
  else head_conv_silu_w<T>(p, b, h, s_q, s_k, s_v, p.conv_size, g);
}

// q, k ([K] in shared memory, after SiLU(conv)) scaled to unit L2 norm (+1e-6 under the root).
// Every thread of group g calls it after a barrier that made s_q, s_k complete.
template <typename Group = WholeBlock>
__device__ void l2_normalize_qk(float* s_q, float* s_k, int K, float* scratch, Group g = {}) {
  float qq = 0.f, kk = 0.f;
  #pragma unroll 1  // a thread takes ~1 element: no trip-count division
  for (int i = g.rank(); i < K; i += g.size()) {
    qq += s_q[i] * s_q[i];
    kk += s_k[i] * s_k[i];
  }
  const float2 sums = block_sum(make_float2(qq, kk), reinterpret_cast<float2*>(scratch), g);
  const float q_inv = rsqrtf(sums.x + 1e-6f), k_inv = rsqrtf(sums.y + 1e-6f);
  #pragma unroll 1  // a thread takes ~1 element: no trip-count division
  for (int i = g.rank(); i < K; i += g.size()) {
    s_q[i] *= q_inv;
    s_k[i] *= k_inv;
  }
}

// Decay alpha = exp(g) and beta of (sequence b, head h), fp32.
template <typename T>
__device__ void gdn_gates(const GdnDecodeParams& p, int b, int h, float* alpha, float* beta) {
  const float a = to_float(static_cast<const T*>(p.a_raw)[b * p.a_stride + h]) +
                  to_float(static_cast<const T*>(p.dt_bias)[h]);
  *alpha = __expf(-__expf(to_float(static_cast<const T*>(p.A_log)[h])) * softplus(a));
  *beta = sigmoid(to_float(static_cast<const T*>(p.b_raw)[b * p.b_stride + h]));
  if (p.allow_neg_eigval) *beta *= 2.f;
}

// ---------------------------------------------------------------------------------------------
// The register form of the step for one (sequence b, head h), S held in registers. Lane l of a
// warp owns rows KR (l / 4) .. KR (l / 4) + KR - 1 of C consecutive value columns (quad l % 4 of
// the warp's 4 C), so a warp covers 4 C columns of all K rows and the column sums over k (S^T k,
// S^T q) are sums over its 8 row groups: 3 shuffles per column, no barrier, no shared copy of S.
// Every load of the step (S, the conv inputs and windows, the gates, the norm weight and the
// output gate) is issued before the first result is needed, so a step costs about one memory
// round trip plus S's transfer; the per-head form waits on ~4 dependent rounds and 3 barriers per
// 32 columns. Heads wider than 4 C x warps columns take passes over the columns.
// Run by the threads of group g (whole warps): gdn_decode's register kernel (the whole block,
// C = 4) and gemv_chain's GDN prelude (its 8 consumer warps, C = 6 for the 1.3B head's 192).

constexpr int kRegRowGroups = 8;  // row groups per warp (lane / 4)

// Shared memory of one step: s_q, s_k [8 KR], s_v, s_o [V], scratch [32].
__host__ __device__ constexpr int gdn_register_smem_floats(int KR, int V) {
  return 2 * kRegRowGroups * KR + 2 * V + 32;
}

// Sum over the 8 row groups of a warp (lanes l, l ^ 4, l ^ 8, ...), to every lane.
template <int C>
__device__ __forceinline__ void row_group_sum(float (&x)[C]) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1)
#pragma unroll
    for (int j = 0; j < C; ++j) x[j] += __shfl_xor_sync(0xffffffffu, x[j], off);
}

// n = 2 or 4 floats at p (n-float aligned) as one access; ldcg: through L2 (a load issued before a
// programmatic wait sees no stale L1 line).
template <int n>
__device__ __forceinline__ void load_floats_cg(float* dst, const float* p) {
  if constexpr (n == 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  } else {
    const float2 v = __ldcg(reinterpret_cast<const float2*>(p));
    dst[0] = v.x, dst[1] = v.y;
  }
}
template <int n>
__device__ __forceinline__ void load_floats(float* dst, const float* p) {
  if constexpr (n == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  } else {
    const float2 v = *reinterpret_cast<const float2*>(p);
    dst[0] = v.x, dst[1] = v.y;
  }
}
template <int n>
__device__ __forceinline__ void store_floats(float* p, const float* src) {
  if constexpr (n == 4) *reinterpret_cast<float4*>(p) = make_float4(src[0], src[1], src[2], src[3]);
  else *reinterpret_cast<float2*>(p) = make_float2(src[0], src[1]);
}

// Whether the register form with C columns per lane serves these head dims: K rows in 8 row
// groups of KR, V whole pieces of C's vector width (S rows of V floats stay piece-aligned).
__host__ __device__ constexpr bool gdn_register_fits(int KR, int C, int K, int V) {
  return K >= 1 && K <= kRegRowGroups * KR && V >= 1 && V % (C % 4 == 0 ? 4 : 2) == 0;
}

// smem: gdn_register_smem_floats(KR, V) floats. wait_inputs() is called once, before anything
// the kernel before may write is read: S's first loads go before it when p.state_settled.
template <typename T, int KR, int C, typename Group, typename Wait>
__device__ __forceinline__ void gdn_register_step(const GdnDecodeParams& p, int b, int h, float* smem, Group g,
                                                  Wait wait_inputs) {
  static_assert(C % 2 == 0 && KR % 4 == 0, "C pieces of 2 or 4 floats; k, q rows in 16-byte loads");
  constexpr int kPiece = C % 4 == 0 ? 4 : 2;  // floats per access of S, s_v and s_o
  const int K = p.head_k, V = p.head_v;
  const int rank = g.rank(), lane = rank % 32, warp = rank / 32, warps = g.size() / 32;
  const int r0 = (lane / 4) * KR, quad = lane % 4;  // rows r0 .. r0 + KR - 1
  constexpr int kRows = kRegRowGroups * KR;         // s_q, s_k are zero from K to kRows
  float* s_q = smem;           // [kRows]
  float* s_k = s_q + kRows;    // [kRows]
  float* s_v = s_k + kRows;    // [V]
  float* s_o = s_v + V;        // [V]: scale S^T q
  float* scratch = s_o + V;    // [32]

  float* S = p.state + (static_cast<int64_t>(b) * p.heads + h) * K * V;
  float s[KR][C];  // S[r0 + i, c .. c + C - 1] of the current pass
  auto load_pass = [&](int c) {
#pragma unroll
    for (int i = 0; i < KR; ++i)
#pragma unroll
      for (int j = 0; j < C; j += kPiece) {
        if (r0 + i < K && c + j < V) load_floats_cg<kPiece>(&s[i][j], S + static_cast<int64_t>(r0 + i) * V + c + j);
        else
#pragma unroll
          for (int e = 0; e < kPiece; ++e) s[i][j + e] = 0.f;
      }
  };
  const int warp_cols = 4 * C, pass_cols = warp_cols * warps, c_first = warp * warp_cols + C * quad;
  if (p.state_settled) load_pass(c_first);
  wait_inputs();
  if (!p.state_settled) load_pass(c_first);

  // The epilogue's inputs of the first pass over the outputs, while S is in flight.
  const T* norm_weight = static_cast<const T*>(p.norm_weight);
  const T* gate = p.gate ? static_cast<const T*>(p.gate) + b * p.gate_stride + h * V : nullptr;
  const int v_first = rank;
  const float w_first = v_first < V ? to_float(norm_weight[v_first]) : 0.f;
  const float z_first = gate && v_first < V ? to_float(gate[v_first]) : 0.f;
  float alpha, beta;
  gdn_gates<T>(p, b, h, &alpha, &beta);

  head_conv_silu<T>(p, b, h, s_q, s_k, s_v, g);
  #pragma unroll 1  // a thread takes ~1 element: no trip-count division
  for (int i = K + rank; i < kRows; i += g.size()) s_q[i] = 0.f, s_k[i] = 0.f;
  g.sync();
  l2_normalize_qk(s_q, s_k, K, scratch, g);
  g.sync();  // the normalised q, k are visible to every thread
  float kr[KR], qr[KR];  // this thread's rows of k and q (16-byte shared loads: r0 % 4 == 0)
#pragma unroll
  for (int i = 0; i < KR; i += 4) {
    load_floats<4>(&kr[i], s_k + r0 + i);
    load_floats<4>(&qr[i], s_q + r0 + i);
  }

  for (int c0 = 0; c0 < V; c0 += pass_cols) {
    const int c = c0 + c_first;
    if (c0 > 0) load_pass(c);
    // u = beta (v - alpha S^T k), the decayed state's prediction error (rows past K add 0).
    float pred[C] = {};
#pragma unroll
    for (int i = 0; i < KR; ++i)
#pragma unroll
      for (int j = 0; j < C; ++j) pred[j] += kr[i] * s[i][j];
    row_group_sum(pred);
    float u[C];
#pragma unroll
    for (int j = 0; j < C; j += kPiece) {
      if (c + j < V) load_floats<kPiece>(&u[j], s_v + c + j);
      else
#pragma unroll
        for (int e = 0; e < kPiece; ++e) u[j + e] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < C; ++j) u[j] = beta * (u[j] - alpha * pred[j]);
    // S <- alpha S + k u^T;  o = S^T q.
    float o[C] = {};
#pragma unroll
    for (int i = 0; i < KR; ++i) {
#pragma unroll
      for (int j = 0; j < C; ++j) {
        s[i][j] = alpha * s[i][j] + kr[i] * u[j];
        o[j] += qr[i] * s[i][j];
      }
#pragma unroll
      for (int j = 0; j < C; j += kPiece)
        if (r0 + i < K && c + j < V) store_floats<kPiece>(S + static_cast<int64_t>(r0 + i) * V + c + j, &s[i][j]);
    }
    row_group_sum(o);
    if (r0 == 0) {
#pragma unroll
      for (int j = 0; j < C; ++j) o[j] *= p.scale;
#pragma unroll
      for (int j = 0; j < C; j += kPiece)
        if (c + j < V) store_floats<kPiece>(s_o + c + j, &o[j]);
    }
  }
  g.sync();  // s_o is complete

  // Swish-gated RMSNorm over V.
  float oo = 0.f;
  #pragma unroll 1  // a thread takes ~1 element: no trip-count division
  for (int i = rank; i < V; i += g.size()) oo += s_o[i] * s_o[i];
  const float inv_rms = rsqrtf(block_sum(oo, scratch, g) / V + p.norm_eps);
  T* y = static_cast<T*>(p.y) + (static_cast<int64_t>(b) * p.heads + h) * V;
  #pragma unroll 1  // a thread takes ~1 element: no trip-count division
  for (int i = rank; i < V; i += g.size()) {
    const float w = i == v_first ? w_first : to_float(norm_weight[i]);
    float yi = s_o[i] * inv_rms * w;
    if (gate) {
      const float z = i == v_first ? z_first : to_float(gate[i]);
      yi *= z * sigmoid(z);
    }
    y[i] = from_float<T>(yi);
  }
}

}  // namespace
}  // namespace lt2::kernels
