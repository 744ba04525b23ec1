// Decode kernels of the linear-recurrence family (decode.h: recurrent_step, gdn_decode).
//
// A block brings a tile of S [K, V] (all K rows, a range of value columns) of one (sequence, head)
// into shared memory with cp.async, so the whole tile is in flight at once without holding it in
// registers, updates it there and writes it back: S is read once and written once. In the update,
// warp y takes rows y, y + 8, ... and lane c column c of a 32-column chunk (conflict-free shared
// reads); the column sums over k (S^T k, S^T q) are summed over the 8 warps through shared memory.
#include <atomic>

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowGroups = kThreads / 32;          // warps; warp y holds rows y + kRowGroups * i
constexpr int kStepTileElems = 4096;                // recurrent_step: ~16 KiB tiles, many blocks
constexpr int kGdnTileBytes = 128 * 1024;           // gdn_decode: up to 128 KiB of S per pass
constexpr int kMaxDefaultSharedBytes = 48 * 1024;   // above this a kernel must opt in

int ceil_div(int a, int b) { return (a + b - 1) / b; }
int round_up(int a, int b) { return ceil_div(a, b) * b; }

__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
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
// gdn_decode: grid (H, B), one block per (sequence, head), passes of `tile_cols` columns.

// SiLU(causal conv) of one channel for the new input x_new, then the window shift. `window`
// points at this channel's oldest slot, consecutive slots `channels` apart; `weight` at its taps.
template <typename T>
__device__ float conv_silu_step(T x_new, const T* weight, T* window, int W, int channels) {
  float acc = to_float(weight[W - 1]) * to_float(x_new);
  for (int j = 0; j < W - 1; ++j) acc += to_float(weight[j]) * to_float(window[j * channels]);
  for (int j = 0; j + 1 < W - 1; ++j) window[j * channels] = window[(j + 1) * channels];
  if (W > 1) window[(W - 2) * channels] = x_new;
  return acc * sigmoid(acc);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gdn_decode_kernel(const GdnDecodeParams p, int tile_cols, int pitch, bool vec16) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int K = p.head_k, V = p.head_v, H = p.heads, W = p.conv_size;
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

  // Short convs of this head's channels, while the first tile is in flight. This block is the
  // only reader and writer of these channels' windows.
  const int qk_channels = H * K, v_channels = H * V;
  T* q_window = static_cast<T*>(p.q_conv_window) + static_cast<int64_t>(b) * (W - 1) * qk_channels;
  T* k_window = static_cast<T*>(p.k_conv_window) + static_cast<int64_t>(b) * (W - 1) * qk_channels;
  T* v_window = static_cast<T*>(p.v_conv_window) + static_cast<int64_t>(b) * (W - 1) * v_channels;
  const T* q_raw = static_cast<const T*>(p.q_raw) + b * p.q_stride;
  const T* k_raw = static_cast<const T*>(p.k_raw) + b * p.k_stride;
  const T* v_raw = static_cast<const T*>(p.v_raw) + b * p.v_stride;
  for (int i = threadIdx.x; i < K; i += kThreads) {
    const int c = h * K + i;
    s_q[i] = conv_silu_step(q_raw[c], static_cast<const T*>(p.q_conv_weight) + c * W, q_window + c, W,
                            qk_channels);
    s_k[i] = conv_silu_step(k_raw[c], static_cast<const T*>(p.k_conv_weight) + c * W, k_window + c, W,
                            qk_channels);
  }
  for (int i = threadIdx.x; i < V; i += kThreads) {
    const int c = h * V + i;
    s_v[i] = conv_silu_step(v_raw[c], static_cast<const T*>(p.v_conv_weight) + c * W, v_window + c, W,
                            v_channels);
  }
  __syncthreads();

  // L2 norms of q and k over K.
  float qq = 0.f, kk = 0.f;
  for (int i = threadIdx.x; i < K; i += kThreads) {
    qq += s_q[i] * s_q[i];
    kk += s_k[i] * s_k[i];
  }
  const float q_inv = rsqrtf(block_sum(qq, scratch) + 1e-6f);
  const float k_inv = rsqrtf(block_sum(kk, scratch) + 1e-6f);
  for (int i = threadIdx.x; i < K; i += kThreads) {
    s_q[i] *= q_inv;
    s_k[i] *= k_inv;
  }

  // Gates, fp32.
  const float a = to_float(static_cast<const T*>(p.a_raw)[b * p.a_stride + h]) +
                  to_float(static_cast<const T*>(p.dt_bias)[h]);
  const float alpha = __expf(-__expf(to_float(static_cast<const T*>(p.A_log)[h])) * softplus(a));
  float beta = sigmoid(to_float(static_cast<const T*>(p.b_raw)[b * p.b_stride + h]));
  if (p.allow_neg_eigval) beta *= 2.f;

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
  const T* weight = static_cast<const T*>(p.norm_weight);
  const T* gate = p.gate ? static_cast<const T*>(p.gate) + b * p.gate_stride + h * V : nullptr;
  T* y = static_cast<T*>(p.y) + (static_cast<int64_t>(b) * H + h) * V;
  for (int i = threadIdx.x; i < V; i += kThreads) {
    float yi = s_o[i] * inv_rms * to_float(weight[i]);
    if (gate) {
      const float z = to_float(gate[i]);
      yi *= z * sigmoid(z);
    }
    y[i] = from_float<T>(yi);
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.

// Raises Kernel's dynamic shared memory limit on the current device when it needs more than the
// default 48 KiB; once per size and device, so a graph-captured launch after an eager one makes
// no call.
template <auto Kernel>
void reserve_shared(size_t bytes, const char* name) {
  if (bytes <= kMaxDefaultSharedBytes) return;
  constexpr int kMaxDevices = 64;
  static std::atomic<size_t> reserved[kMaxDevices];
  int device = 0, optin = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices && bytes <= reserved[device].load()) return;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  LT2_CHECK(bytes <= static_cast<size_t>(optin), name, ": needs ", bytes,
            " bytes of shared memory, the device allows ", optin, " (head dims too large)");
  const cudaError_t err =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  LT2_CHECK(err == cudaSuccess, name, ": cannot reserve shared memory: ", cudaGetErrorString(err));
  if (device < kMaxDevices) reserved[device].store(bytes);
}

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

void gdn_decode(const GdnDecodeParams& p, void* stream) {
  LT2_CHECK(p.head_k >= 1 && p.head_k <= kMaxRecurrentHeadK && p.head_v >= 1 && p.conv_size >= 1,
            "gdn_decode: head dims K ", p.head_k, " (1..", kMaxRecurrentHeadK, "), V ", p.head_v,
            ", conv size ", p.conv_size);
  if (p.batch == 0 || p.heads == 0) return;
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
    gdn_decode_kernel<T><<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
        p, tile_cols, pitch, vec16);
  });
  check_launch("gdn_decode");
}

}  // namespace lt2::kernels
