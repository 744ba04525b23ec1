// Decode kernels of the linear-recurrence family (decode.h: recurrent_step, gdn_decode).
//
// A block brings a tile of S [K, V] (all K rows, a range of value columns) of one (sequence, head)
// into shared memory with cp.async, so the whole tile is in flight at once without holding it in
// registers, updates it there and writes it back: S is read once and written once. In the update,
// warp y takes rows y, y + 8, ... and lane c column c of a 32-column chunk (conflict-free shared
// reads); the column sums over k (S^T k, S^T q) are summed over the 8 warps through shared memory.
#include <cooperative_groups.h>

#include <atomic>

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowGroups = kThreads / 32;          // warps; warp y holds rows y + kRowGroups * i
constexpr int kStepTileElems = 4096;                // recurrent_step: ~16 KiB tiles, many blocks
constexpr int kGdnTileBytes = 128 * 1024;           // gdn_decode: up to 128 KiB of S per pass
constexpr int kMaxGdnClusterBlocks = 8;             // the portable cluster size

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// Columns [v0, v0 + tw) of S ([K, V] row-major) <-> tile ([K, pitch] in shared memory). vec16:
// rows start 16-byte aligned (V % 4 == 0, aligned S, v0 % 4 == 0) and pitch % 4 == 0.
__device__ void load_tile_async(const float* S, int K, int V, int v0, int tw, float* tile, int pitch,
                                bool vec16) {
  if (vec16) {
    const int per_row = tw / 4;
    for (int i = threadIdx.x; i < K * per_row; i += kThreads) {
      const int r = i / per_row, c = 4 * (i % per_row);
      cp_async16(tile + r * pitch + c, S + static_cast<int64_t>(r) * V + v0 + c);
    }
  } else {
    for (int i = threadIdx.x; i < K * tw; i += kThreads) {
      const int r = i / tw, c = i % tw;
      cp_async4(tile + r * pitch + c, S + static_cast<int64_t>(r) * V + v0 + c);
    }
  }
}

__device__ void store_tile(float* S, int K, int V, int v0, int tw, const float* tile, int pitch,
                           bool vec16) {
  if (vec16) {
    const int per_row = tw / 4;
    for (int i = threadIdx.x; i < K * per_row; i += kThreads) {
      const int r = i / per_row, c = 4 * (i % per_row);
      *reinterpret_cast<float4*>(S + static_cast<int64_t>(r) * V + v0 + c) =
          *reinterpret_cast<const float4*>(tile + r * pitch + c);
    }
  } else {
    for (int i = threadIdx.x; i < K * tw; i += kThreads) {
      const int r = i / tw, c = i % tw;
      S[static_cast<int64_t>(r) * V + v0 + c] = tile[r * pitch + c];
    }
  }
}

// One token through the tile's columns [0, tw):
//   S <- d S (d = s_decay[k] per row, or head_decay);  u = beta (v - S^T k) or v;  S <- S + k u^T
//   s_o[c] = sum_k q[k] S[k, c]   (unscaled)
// s_q, s_k, s_decay: [K] shared; s_v, s_o: [tw] shared; red: [2 * kThreads] shared scratch.
// Every thread of the block calls it; it ends with a barrier (tile and s_o complete).
__device__ void step_tile(float* tile, int pitch, int K, int tw, const float* s_q, const float* s_k,
                          const float* s_decay, float head_decay, bool delta, float beta,
                          const float* s_v, float* s_o, float* red) {
  const int lane = threadIdx.x % 32, y = threadIdx.x / 32;
  float* red_pred = red;
  float* red_o = red + kThreads;
  for (int c0 = 0; c0 < tw; c0 += 32) {
    const int c = c0 + lane;
    const bool active = c < tw;
    float u = active ? s_v[c] : 0.f;
    if (delta) {
      float part = 0.f;
      if (active) {
#pragma unroll 4
        for (int k = y; k < K; k += kRowGroups)
          part += s_k[k] * ((s_decay ? s_decay[k] : head_decay) * tile[k * pitch + c]);
      }
      red_pred[y * 32 + lane] = part;
      __syncthreads();
      float pred = 0.f;
#pragma unroll
      for (int j = 0; j < kRowGroups; ++j) pred += red_pred[j * 32 + lane];
      u = beta * (u - pred);
    }
    float part_o = 0.f;
    if (active) {
#pragma unroll 4
      for (int k = y; k < K; k += kRowGroups) {
        const float s = (s_decay ? s_decay[k] : head_decay) * tile[k * pitch + c] + s_k[k] * u;
        tile[k * pitch + c] = s;
        part_o += s_q[k] * s;
      }
    }
    red_o[y * 32 + lane] = part_o;
    __syncthreads();
    if (y == 0 && active) {
      float o = 0.f;
#pragma unroll
      for (int j = 0; j < kRowGroups; ++j) o += red_o[j * 32 + lane];
      s_o[c] = o;
    }
    __syncthreads();  // red is reused by the next chunk
  }
}

// ---------------------------------------------------------------------------------------------
// recurrent_step: grid (column tiles, H, B), one tile of `tile_cols` columns per block.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    recurrent_step_kernel(const RecurrentStepParams p, int tile_cols, int pitch, bool vec16) {
  const int v0 = blockIdx.x * tile_cols, h = blockIdx.y, b = blockIdx.z;
  const int K = p.head_k, V = p.head_v, tw = min(tile_cols, V - v0);
  extern __shared__ float smem[];
  float* tile = smem;                 // [K, pitch]
  float* s_q = tile + K * pitch;      // [K]
  float* s_k = s_q + K;               // [K]
  float* s_decay = s_k + K;           // [K]
  float* s_v = s_decay + K;           // [tile_cols]
  float* s_o = s_v + tile_cols;       // [tile_cols]
  float* red = s_o + tile_cols;       // [2 * kThreads]

  const int64_t bh = static_cast<int64_t>(b) * p.heads + h;
  float* S = p.state + bh * K * V;
  load_tile_async(S, K, V, v0, tw, tile, pitch, vec16);

  // The token's inputs, while the tile is in flight.
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride;
  const bool per_channel = p.decay_kind == DecayKind::PerChannel;
  for (int i = threadIdx.x; i < K; i += kThreads) {
    s_q[i] = to_float(q[i]);
    s_k[i] = to_float(k[i]);
    if (per_channel) s_decay[i] = __expf(p.g[bh * K + i]);
  }
  for (int i = threadIdx.x; i < tw; i += kThreads) s_v[i] = to_float(v[v0 + i]);
  const float head_decay = p.decay_kind == DecayKind::PerHead ? __expf(p.g[bh]) : 1.f;
  const bool delta = p.beta != nullptr;
  const float beta = delta ? p.beta[bh] : 0.f;
  cp_async_wait_all();
  __syncthreads();

  step_tile(tile, pitch, K, tw, s_q, s_k, per_channel ? s_decay : nullptr, head_decay, delta, beta,
            s_v, s_o, red);
  store_tile(S, K, V, v0, tw, tile, pitch, vec16);
  T* o = static_cast<T*>(p.o) + bh * V + v0;
  for (int i = threadIdx.x; i < tw; i += kThreads) o[i] = from_float<T>(s_o[i] * p.scale);
}

// ---------------------------------------------------------------------------------------------
// gdn_decode, shared pieces of its two forms.

// SiLU(causal conv) of one channel for the new input x_new. `window` points at this channel's
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
// inputs, the conv windows advanced in place. The calling block must own the whole head's
// channels (it is their only reader and writer); the block's threads stride over them.
template <typename T>
__device__ __forceinline__ void head_conv_silu_w(const GdnDecodeParams& p, int b, int h, float* s_q, float* s_k,
                                                 float* s_v, const int W) {
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
  for (int i = threadIdx.x; i < max(K, V); i += blockDim.x) {
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

template <typename T>
__device__ void head_conv_silu(const GdnDecodeParams& p, int b, int h, float* s_q, float* s_k, float* s_v) {
  if (p.conv_size == kCommonConvSize) head_conv_silu_w<T>(p, b, h, s_q, s_k, s_v, kCommonConvSize);
  else head_conv_silu_w<T>(p, b, h, s_q, s_k, s_v, p.conv_size);
}

// q, k ([K] in shared memory, after SiLU(conv)) scaled to unit L2 norm (+1e-6 under the root).
// Every thread of the block calls it after a barrier that made s_q, s_k complete.
__device__ void l2_normalize_qk(float* s_q, float* s_k, int K, float* scratch) {
  float qq = 0.f, kk = 0.f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    qq += s_q[i] * s_q[i];
    kk += s_k[i] * s_k[i];
  }
  const float2 sums = block_sum(make_float2(qq, kk), reinterpret_cast<float2*>(scratch));
  const float q_inv = rsqrtf(sums.x + 1e-6f), k_inv = rsqrtf(sums.y + 1e-6f);
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
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

// y[v0 + i] = o[i] * inv_rms * norm_weight[v0 + i] * silu(gate[v0 + i]) for i < n; s_o is scaled.
template <typename T>
__device__ void store_gated_norm(const GdnDecodeParams& p, int b, int h, int v0, int n, const float* s_o,
                                 float inv_rms) {
  const int V = p.head_v;
  const T* weight = static_cast<const T*>(p.norm_weight);
  const T* gate = p.gate ? static_cast<const T*>(p.gate) + b * p.gate_stride + h * V : nullptr;
  T* y = static_cast<T*>(p.y) + (static_cast<int64_t>(b) * p.heads + h) * V;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float yi = s_o[i] * inv_rms * to_float(weight[v0 + i]);
    if (gate) {
      const float z = to_float(gate[v0 + i]);
      yi *= z * sigmoid(z);
    }
    y[v0 + i] = from_float<T>(yi);
  }
}

// ---------------------------------------------------------------------------------------------
// gdn_decode, per-head form: grid (H, B), one block per (sequence, head), passes of `tile_cols`
// columns.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gdn_decode_kernel(const GdnDecodeParams p, int tile_cols, int pitch, bool vec16) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int K = p.head_k, V = p.head_v, H = p.heads;
  extern __shared__ float smem[];
  float* tile = smem;             // [K, pitch]
  float* s_q = tile + K * pitch;  // [K]
  float* s_k = s_q + K;           // [K]
  float* s_v = s_k + K;           // [V]
  float* s_o = s_v + V;           // [V]
  float* red = s_o + V;           // [2 * kThreads]
  float* scratch = red + 2 * kThreads;  // [32]

  float* S = p.state + (static_cast<int64_t>(b) * H + h) * K * V;
  load_tile_async(S, K, V, 0, min(tile_cols, V), tile, pitch, vec16);

  // Short convs of this head's channels, while the first tile is in flight.
  head_conv_silu<T>(p, b, h, s_q, s_k, s_v);
  __syncthreads();
  l2_normalize_qk(s_q, s_k, K, scratch);
  float alpha, beta;
  gdn_gates<T>(p, b, h, &alpha, &beta);

  // Delta rule over the tiles of value columns.
  for (int v0 = 0; v0 < V; v0 += tile_cols) {
    const int tw = min(tile_cols, V - v0);
    if (v0 > 0) load_tile_async(S, K, V, v0, tw, tile, pitch, vec16);
    cp_async_wait_all();
    __syncthreads();  // the tile and the normalised q, k are visible to every thread
    step_tile(tile, pitch, K, tw, s_q, s_k, nullptr, alpha, true, beta, s_v + v0, s_o + v0, red);
    store_tile(S, K, V, v0, tw, tile, pitch, vec16);
    __syncthreads();  // the tile is free for the next pass
  }

  // Swish-gated RMSNorm over V.
  float oo = 0.f;
  for (int i = threadIdx.x; i < V; i += kThreads) {
    s_o[i] *= p.scale;
    oo += s_o[i] * s_o[i];
  }
  const float inv_rms = rsqrtf(block_sum(oo, scratch) / V + p.norm_eps);
  store_gated_norm<T>(p, b, h, 0, V, s_o, inv_rms);
}

// ---------------------------------------------------------------------------------------------
// gdn_decode, register form: grid (H, B), one block per (sequence, head), S held in registers.
// Lane l of a warp owns rows KR (l / 4) .. KR (l / 4) + KR - 1 of 4 consecutive value columns
// (quad l % 4 of the warp's 16), so a warp covers 16 columns of all K rows and the column sums
// over k (S^T k, S^T q) are sums over its 8 row groups: 3 shuffles, no barrier, no shared copy
// of S. Every load of the step (S, the conv inputs and windows, the gates, the norm weight and
// the output gate) is issued before the first result is needed, so a step costs about one memory
// round trip plus S's transfer; the per-head form waits on ~4 dependent rounds and 3 barriers per
// 32 columns. Heads wider than 16 x warps columns take passes over the columns.

constexpr int kRegRowGroups = 8;   // row groups per warp (lane / 4)
constexpr int kRegWarpCols = 16;   // value columns per warp and pass (4 lanes x 4)

// Threads per block of the register form with KR rows per thread: 16 warps while a thread's
// slab fits in ~128 registers, 8 beyond.
__host__ __device__ constexpr int gdn_register_threads(int KR) { return KR <= 16 ? 512 : 256; }

// Sum over the 8 row groups of a warp (lanes l, l ^ 4, l ^ 8, ...), to every lane.
__device__ __forceinline__ float4 row_group_sum(float4 x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    x.x += __shfl_xor_sync(0xffffffffu, x.x, off);
    x.y += __shfl_xor_sync(0xffffffffu, x.y, off);
    x.z += __shfl_xor_sync(0xffffffffu, x.z, off);
    x.w += __shfl_xor_sync(0xffffffffu, x.w, off);
  }
  return x;
}

template <typename T, int KR>
__global__ void __launch_bounds__(gdn_register_threads(KR)) gdn_decode_registers_kernel(const GdnDecodeParams p) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int K = p.head_k, V = p.head_v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int r0 = (lane / 4) * KR, quad = lane % 4;  // rows r0 .. r0 + KR - 1
  constexpr int kRows = kRegRowGroups * KR;         // s_q, s_k are zero from K to kRows
  extern __shared__ float smem[];
  float* s_q = smem;           // [kRows]
  float* s_k = s_q + kRows;    // [kRows]
  float* s_v = s_k + kRows;    // [V]
  float* s_o = s_v + V;        // [V]: scale S^T q
  float* scratch = s_o + V;    // [32]

  float* S = p.state + (static_cast<int64_t>(b) * p.heads + h) * K * V;
  float4 s[KR];  // S[r0 + i, c .. c + 3] of the current pass (V % 4 == 0, rows 16-byte aligned)
  auto load_pass = [&](int c) {  // from L2 (__ldcg): a load issued before the wait sees no stale L1
#pragma unroll
    for (int i = 0; i < KR; ++i)
      s[i] = r0 + i < K && c < V ? __ldcg(reinterpret_cast<const float4*>(S + static_cast<int64_t>(r0 + i) * V + c))
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  const int pass_cols = kRegWarpCols * warps;
  // Launched as a programmatic dependent: its blocks are placed while the input projection ends.
  // Nothing that kernel writes is read before the wait; S only when the caller vouches that no
  // kernel still running writes it (state_settled: an earlier step on the same state may run).
  // The block tail chained after this step (gemv_chain) then starts on the SMs this grid leaves
  // idle and streams its weights meanwhile; it waits for this step's y before reading it.
  if (p.state_settled) load_pass(warp * kRegWarpCols + 4 * quad);
  dependent_kernel_start();
  if (!p.state_settled) load_pass(warp * kRegWarpCols + 4 * quad);

  // The epilogue's inputs of the first pass over the outputs, while S is in flight.
  const T* norm_weight = static_cast<const T*>(p.norm_weight);
  const T* gate = p.gate ? static_cast<const T*>(p.gate) + b * p.gate_stride + h * V : nullptr;
  const int v_first = threadIdx.x;
  const float w_first = v_first < V ? to_float(norm_weight[v_first]) : 0.f;
  const float z_first = gate && v_first < V ? to_float(gate[v_first]) : 0.f;
  float alpha, beta;
  gdn_gates<T>(p, b, h, &alpha, &beta);

  head_conv_silu<T>(p, b, h, s_q, s_k, s_v);
  for (int i = K + threadIdx.x; i < kRows; i += blockDim.x) s_q[i] = 0.f, s_k[i] = 0.f;
  __syncthreads();
  l2_normalize_qk(s_q, s_k, K, scratch);
  __syncthreads();  // the normalised q, k are visible to every thread
  float kr[KR], qr[KR];  // this thread's rows of k and q (16-byte shared loads: r0 % 4 == 0)
#pragma unroll
  for (int i = 0; i < KR; i += 4) {
    const float4 k4 = *reinterpret_cast<const float4*>(s_k + r0 + i);
    const float4 q4 = *reinterpret_cast<const float4*>(s_q + r0 + i);
    kr[i] = k4.x, kr[i + 1] = k4.y, kr[i + 2] = k4.z, kr[i + 3] = k4.w;
    qr[i] = q4.x, qr[i + 1] = q4.y, qr[i + 2] = q4.z, qr[i + 3] = q4.w;
  }

  for (int c0 = 0; c0 < V; c0 += pass_cols) {
    const int c = c0 + warp * kRegWarpCols + 4 * quad;
    if (c0 > 0) load_pass(c);
    // u = beta (v - alpha S^T k), the decayed state's prediction error (rows past K add 0).
    float4 pred = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < KR; ++i)
      pred.x += kr[i] * s[i].x, pred.y += kr[i] * s[i].y, pred.z += kr[i] * s[i].z, pred.w += kr[i] * s[i].w;
    pred = row_group_sum(pred);
    const float4 v = c < V ? *reinterpret_cast<const float4*>(s_v + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 u = make_float4(beta * (v.x - alpha * pred.x), beta * (v.y - alpha * pred.y),
                                 beta * (v.z - alpha * pred.z), beta * (v.w - alpha * pred.w));
    // S <- alpha S + k u^T;  o = S^T q.
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < KR; ++i) {
      s[i].x = alpha * s[i].x + kr[i] * u.x, s[i].y = alpha * s[i].y + kr[i] * u.y;
      s[i].z = alpha * s[i].z + kr[i] * u.z, s[i].w = alpha * s[i].w + kr[i] * u.w;
      o.x += qr[i] * s[i].x, o.y += qr[i] * s[i].y, o.z += qr[i] * s[i].z, o.w += qr[i] * s[i].w;
      if (r0 + i < K && c < V) *reinterpret_cast<float4*>(S + static_cast<int64_t>(r0 + i) * V + c) = s[i];
    }
    o = row_group_sum(o);
    if (r0 == 0 && c < V)
      *reinterpret_cast<float4*>(s_o + c) = make_float4(p.scale * o.x, p.scale * o.y, p.scale * o.z, p.scale * o.w);
  }
  __syncthreads();  // s_o is complete

  // Swish-gated RMSNorm over V.
  float oo = 0.f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) oo += s_o[i] * s_o[i];
  const float inv_rms = rsqrtf(block_sum(oo, scratch) / V + p.norm_eps);
  T* y = static_cast<T*>(p.y) + (static_cast<int64_t>(b) * p.heads + h) * V;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float w = i == v_first ? w_first : to_float(norm_weight[i]);
    float yi = s_o[i] * inv_rms * w;
    if (gate) {
      const float z = i == v_first ? z_first : to_float(gate[i]);
      yi *= z * sigmoid(z);
    }
    y[i] = from_float<T>(yi);
  }
}

// ---------------------------------------------------------------------------------------------
// gdn_decode, cluster form (sm_90): grid (tiles, H, B) in clusters of (tiles, 1, 1), so one
// cluster per (sequence, head) and one tile of `tile_cols` value columns per block: a small batch
// still spreads S over many SMs, with no second launch. Every block computes its head's q, k
// (K channels: cheap) and the v of its own columns; the RMSNorm over V adds up the blocks' sums
// of squares through distributed shared memory. Window writes: a block shifts the v windows of
// its own columns; block 0 shifts the head's q, k windows after a cluster barrier that every
// block reaches only once it has read them.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gdn_decode_cluster_kernel(const GdnDecodeParams p, int tile_cols, bool vec16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;  // tile == cluster.block_rank()
  const int K = p.head_k, V = p.head_v, H = p.heads, W = p.conv_size;
  const int v0 = tile * tile_cols, tw = min(tile_cols, V - v0), pitch = tile_cols;
  extern __shared__ float smem[];
  float* s_tile = smem;                 // [K, pitch]
  float* s_q = s_tile + K * pitch;      // [K]
  float* s_k = s_q + K;                 // [K]
  float* s_v = s_k + K;                 // [tile_cols]
  float* s_o = s_v + tile_cols;         // [tile_cols]
  float* red = s_o + tile_cols;         // [2 * kThreads]
  float* scratch = red + 2 * kThreads;  // [32]
  __shared__ float s_sum_sq;            // this block's sum of (scale o)^2, read by the whole cluster

  float* S = p.state + (static_cast<int64_t>(b) * H + h) * K * V;
  load_tile_async(S, K, V, v0, tw, s_tile, pitch, vec16);

  const int qk_channels = H * K, v_channels = H * V;
  T* q_window = batch_window<T>(p.q_conv_window, b, W, qk_channels);
  T* k_window = batch_window<T>(p.k_conv_window, b, W, qk_channels);
  T* v_window = batch_window<T>(p.v_conv_window, b, W, v_channels);
  const T* q_raw = static_cast<const T*>(p.q_raw) + b * p.q_stride;
  const T* k_raw = static_cast<const T*>(p.k_raw) + b * p.k_stride;
  const T* v_raw = static_cast<const T*>(p.v_raw) + b * p.v_stride;
  for (int i = threadIdx.x; i < K; i += kThreads) {
    const int c = h * K + i;
    s_q[i] = conv_silu(q_raw[c], static_cast<const T*>(p.q_conv_weight) + c * W, q_window + c, W, qk_channels);
    s_k[i] = conv_silu(k_raw[c], static_cast<const T*>(p.k_conv_weight) + c * W, k_window + c, W, qk_channels);
  }
  for (int i = threadIdx.x; i < tw; i += kThreads) {
    const int c = h * V + v0 + i;
    s_v[i] = conv_silu(v_raw[c], static_cast<const T*>(p.v_conv_weight) + c * W, v_window + c, W, v_channels);
    conv_shift(v_raw[c], v_window + c, W, v_channels);
  }
  __syncthreads();
  l2_normalize_qk(s_q, s_k, K, scratch);
  float alpha, beta;
  gdn_gates<T>(p, b, h, &alpha, &beta);

  cp_async_wait_all();
  __syncthreads();  // the tile and the normalised q, k are visible to every thread
  step_tile(s_tile, pitch, K, tw, s_q, s_k, nullptr, alpha, true, beta, s_v, s_o, red);
  store_tile(S, K, V, v0, tw, s_tile, pitch, vec16);

  float oo = 0.f;
  for (int i = threadIdx.x; i < tw; i += kThreads) {
    s_o[i] *= p.scale;
    oo += s_o[i] * s_o[i];
  }
  const float block_sq = block_sum(oo, scratch);
  if (threadIdx.x == 0) s_sum_sq = block_sq;
  cluster.sync();  // every s_sum_sq is written, and every block has read the q, k windows

  // Lane r of each warp reads block r's sum (at most kMaxGdnClusterBlocks <= 32 blocks).
  const int lane = threadIdx.x % 32;
  const float part = lane < static_cast<int>(cluster.num_blocks()) ? *cluster.map_shared_rank(&s_sum_sq, lane) : 0.f;
  const float inv_rms = rsqrtf(warp_sum(part) / V + p.norm_eps);
  if (tile == 0) {
    for (int i = threadIdx.x; i < K; i += kThreads) {
      const int c = h * K + i;
      conv_shift(q_raw[c], q_window + c, W, qk_channels);
      conv_shift(k_raw[c], k_window + c, W, qk_channels);
    }
  }
  store_gated_norm<T>(p, b, h, v0, tw, s_o, inv_rms);
  cluster.sync();  // no block exits (freeing its s_sum_sq) while another may still read it
#endif
}

// ---------------------------------------------------------------------------------------------
// Launchers.

bool rows_16_byte_aligned(const float* state, int V) {
  return V % 4 == 0 && reinterpret_cast<uintptr_t>(state) % 16 == 0;
}

}  // namespace

void recurrent_step(const RecurrentStepParams& p, void* stream) {
  LT2_CHECK(p.head_k >= 1 && p.head_k <= kMaxRecurrentHeadK && p.head_v >= 1,
            "recurrent_step: head dims K ", p.head_k, " (1..", kMaxRecurrentHeadK, "), V ", p.head_v);
  LT2_CHECK((p.decay_kind == DecayKind::None) == (p.g == nullptr),
            "recurrent_step: the log decay pointer must be given exactly when decay_kind is not None");
  if (p.batch == 0 || p.heads == 0) return;
  const int K = p.head_k, V = p.head_v;
  const int tile_cols = 32 * std::max(1, std::min(ceil_div(V, 32), kStepTileElems / (32 * K)));
  const int pitch = tile_cols;
  const size_t smem = sizeof(float) * (K * pitch + 3 * K + 2 * tile_cols + 2 * kThreads);
  const dim3 grid(ceil_div(V, tile_cols), p.heads, p.batch);
  const bool vec16 = rows_16_byte_aligned(p.state, V);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    reserve_shared<recurrent_step_kernel<T>>(smem, "recurrent_step");
    recurrent_step_kernel<T><<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
        p, tile_cols, pitch, vec16);
  });
  check_launch("recurrent_step");
}

namespace {

// The cluster form's column tiles: recurrent_step's ~16 KiB tiles, widened so a head takes at
// most kMaxGdnClusterBlocks of them.
struct GdnClusterPlan {
  int tile_cols = 0, tiles = 0;
  size_t smem = 0;
};
GdnClusterPlan gdn_cluster_plan(int K, int V) {
  GdnClusterPlan plan;
  plan.tile_cols = 32 * std::max(1, std::min(ceil_div(V, 32), kStepTileElems / (32 * K)));
  plan.tile_cols = std::max(plan.tile_cols, round_up(ceil_div(V, kMaxGdnClusterBlocks), 32));
  plan.tiles = ceil_div(V, plan.tile_cols);
  plan.smem = sizeof(float) * (K * plan.tile_cols + 2 * K + 2 * plan.tile_cols + 2 * kThreads + 32);
  return plan;
}

// Whether the cluster form serves these head dims on the current device (sm_90+, tiles of at
// most kGdnTileBytes).
bool gdn_cluster_fits(int K, int V, int device) {
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device, "gdn_decode");
  return major >= 9 && sizeof(float) * K * gdn_cluster_plan(K, V).tile_cols <= kGdnTileBytes;
}

void launch_gdn_per_head(const GdnDecodeParams& p, cudaStream_t stream) {
  const int K = p.head_k, V = p.head_v;
  // The whole head in one pass when it fits, else passes of a multiple of 32 columns.
  const int fit_cols = kGdnTileBytes / static_cast<int>(sizeof(float) * K);
  const int tile_cols = V <= fit_cols ? V : std::max(32, fit_cols / 32 * 32);
  const int pitch = round_up(tile_cols, 4);
  const size_t smem = sizeof(float) * (K * pitch + 2 * K + 2 * V + 2 * kThreads + 32);
  const dim3 grid(p.heads, p.batch);
  const bool vec16 = rows_16_byte_aligned(p.state, V);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    reserve_shared<gdn_decode_kernel<T>>(smem, "gdn_decode");
    gdn_decode_kernel<T><<<grid, kThreads, smem, stream>>>(p, tile_cols, pitch, vec16);
  });
  check_launch("gdn_decode");
}

void launch_gdn_cluster(const GdnDecodeParams& p, cudaStream_t stream) {
  LT2_CHECK(p.batch <= 65535 && p.heads <= 65535, "gdn_decode (cluster form): batch ", p.batch, " and heads ",
            p.heads, " must be at most 65535");
  const auto plan = gdn_cluster_plan(p.head_k, p.head_v);
  // Tiles start at multiples of 32 columns, so 16-byte rows stay 16-byte aligned in every tile.
  const bool vec16 = rows_16_byte_aligned(p.state, p.head_v);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(plan.tiles, p.heads, p.batch);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = plan.smem;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = plan.tiles;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    reserve_shared<gdn_decode_cluster_kernel<T>>(plan.smem, "gdn_decode (cluster form)");
    const cudaError_t err = cudaLaunchKernelEx(&config, gdn_decode_cluster_kernel<T>, p, plan.tile_cols, vec16);
    LT2_CHECK(err == cudaSuccess, "gdn_decode (cluster form) launch failed: ", cudaGetErrorString(err));
  });
  check_launch("gdn_decode (cluster form)");
}

// The register form: KR rows per thread for K <= 8 KR, enough warps for the head's columns in
// one pass where the block allows.
// A programmatic dependent of its input projection only on a small grid (launch_dependent_on_small_grid):
// at batch 1 (16 blocks) the early launch hides the launch latency, while at batch 8 (128 blocks)
// the ordinary launch is faster on every 1.3B preset (bench/notes/decode_engine.md, launch policy).
template <int KR>
void launch_gdn_registers_kr(const GdnDecodeParams& p, cudaStream_t stream) {
  const int warps = std::min(gdn_register_threads(KR) / 32, ceil_div(p.head_v, kRegWarpCols));
  const size_t smem = sizeof(float) * (2 * kRegRowGroups * KR + 2 * p.head_v + 32);
  const dim3 grid(p.heads, p.batch);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    reserve_shared<gdn_decode_registers_kernel<T, KR>>(smem, "gdn_decode (register form)");
    launch_dependent_on_small_grid(p.pdl, "gdn_decode (register form)", gdn_decode_registers_kernel<T, KR>, grid,
                                   dim3(32 * warps), smem, stream, {}, p);
  });
}

void launch_gdn_registers(const GdnDecodeParams& p, cudaStream_t stream) {
  if (p.head_k <= 8 * kRegRowGroups) launch_gdn_registers_kr<8>(p, stream);
  else if (p.head_k <= 12 * kRegRowGroups) launch_gdn_registers_kr<12>(p, stream);  // the 1.3B presets' K = 96
  else if (p.head_k <= 16 * kRegRowGroups) launch_gdn_registers_kr<16>(p, stream);
  else launch_gdn_registers_kr<32>(p, stream);
}

}  // namespace

bool gdn_decode_registers_supported(int head_k, int head_v) {
  return head_k >= 1 && head_k <= kMaxGdnRegisterHeadK && head_v >= 4 && head_v % 4 == 0;
}

bool gdn_decode_cluster_supported(int head_k, int head_v, int device) {
  return head_k >= 1 && head_k <= kMaxRecurrentHeadK && head_v >= 1 && gdn_cluster_fits(head_k, head_v, device);
}

GdnDecodeForm gdn_decode_form(int batch, int heads, int head_k, int head_v, int device) {
  if (gdn_decode_registers_supported(head_k, head_v)) return GdnDecodeForm::Registers;
  // The cluster form spreads a head over several SMs, which pays only while the per-head grid
  // leaves most SMs idle: at the 1.3B GDN head (96 x 192) on an H200 (132 SMs), 16 (sequence, head)
  // blocks take 9.1 us as clusters against 13.0 per head, 128 blocks 20.1 against 13.7
  // (bench/results/decode_kernels_h200.txt).
  const bool few_blocks = grid_leaves_sms_idle(static_cast<int64_t>(batch) * heads, device);
  return few_blocks && gdn_decode_cluster_supported(head_k, head_v, device) ? GdnDecodeForm::Cluster
                                                                            : GdnDecodeForm::PerHead;
}

void gdn_decode(const GdnDecodeParams& p, void* stream) {
  LT2_CHECK(p.head_k >= 1 && p.head_k <= kMaxRecurrentHeadK && p.head_v >= 1 && p.conv_size >= 1,
            "gdn_decode: head dims K ", p.head_k, " (1..", kMaxRecurrentHeadK, "), V ", p.head_v,
            ", conv size ", p.conv_size);
  if (p.batch == 0 || p.heads == 0) return;
  int device = 0;
  cudaGetDevice(&device);
  GdnDecodeForm form = p.form;
  if (form == GdnDecodeForm::Auto) form = gdn_decode_form(p.batch, p.heads, p.head_k, p.head_v, device);
  LT2_CHECK(form != GdnDecodeForm::Cluster || gdn_decode_cluster_supported(p.head_k, p.head_v, device),
            "gdn_decode: the cluster form needs an sm_90 device and K x tile columns within ", kGdnTileBytes,
            " bytes; K ", p.head_k, ", V ", p.head_v);
  // The register form moves S in 16-byte pieces: a misaligned state takes the per-head form.
  const bool aligned = rows_16_byte_aligned(p.state, p.head_v);
  if (p.form == GdnDecodeForm::Auto && form == GdnDecodeForm::Registers && !aligned) form = GdnDecodeForm::PerHead;
  LT2_CHECK(form != GdnDecodeForm::Registers || (gdn_decode_registers_supported(p.head_k, p.head_v) && aligned),
            "gdn_decode: the register form takes K <= ", kMaxGdnRegisterHeadK, ", V a multiple of 4 and a 16-byte ",
            "aligned state; K ", p.head_k, ", V ", p.head_v);
  const auto s = static_cast<cudaStream_t>(stream);
  if (form == GdnDecodeForm::Registers) launch_gdn_registers(p, s);
  else if (form == GdnDecodeForm::Cluster) launch_gdn_cluster(p, s);
  else launch_gdn_per_head(p, s);
}

}  // namespace lt2::kernels
