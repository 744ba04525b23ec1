// Flash-decoding (decode.h: attention_decode). A split block of 128 threads reads its keys with
// 16-byte loads: kThreadsPerKey threads share one key row (each holds a slice of the row and of
// every query head's q and output accumulator), the block's kGroups thread groups take
// interleaved keys, kUnroll keys per group in flight per step. Each group keeps its own online
// softmax (running max, sum and accumulator, base 2); the groups are merged in shared memory, then
// the splits by the combine kernel (split_combine.cuh).
#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/cuda/split_combine.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kMinKeysPerSplit = 64;    // fewer keys per split would spend more on the combine
constexpr int kTargetBlocksPerSm = 8;   // split blocks wanted per SM when the batch is small
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int D>
struct SplitShape {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  static constexpr int kThreadsPerKey = D / kVec < 32 ? D / kVec : 32;
  static constexpr int kVecsPerThread = D / (kVec * kThreadsPerKey);
  static constexpr int kElems = kVec * kVecsPerThread;  // row elements per thread
  static constexpr int kGroups = kThreads / kThreadsPerKey;
  static constexpr int kUnroll = kVecsPerThread == 1 ? 4 : 2;
  static_assert(D % (kVec * kThreadsPerKey) == 0, "head dim must fill whole 16-byte loads");
};


// Row offset of query head `head` of sequence b in the [B, Hq, ...] outputs and workspaces.
__device__ __forceinline__ int64_t q_row(const AttentionDecodeParams& p, int b, int head) {
  return static_cast<int64_t>(b) * p.q_heads + head;
}

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads) attention_split_kernel(const AttentionDecodeParams p) {
  dependent_kernel_start();
  using Shape = SplitShape<T, D>;
  constexpr int TPK = Shape::kThreadsPerKey, NV = Shape::kVecsPerThread, VEC = Shape::kVec;
  constexpr int E = Shape::kElems, GROUPS = Shape::kGroups, U = Shape::kUnroll;
  __shared__ float s_m[GROUPS][GMAX], s_l[GROUPS][GMAX];
  __shared__ float s_acc[GROUPS][GMAX][D];

  const int split = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z;
  const int G = p.q_heads / p.kv_heads, S = p.num_splits;
  const int tid = threadIdx.x, group = tid / TPK, lane = tid % TPK;
  // Keys [start, end) of this split; the split count is fixed, the length is read on the device.
  const int64_t len64 = p.seq_lens[b];
  const int len = static_cast<int>(len64 < 0 ? 0 : (len64 > p.max_len ? p.max_len : len64));
  const int chunk = (len + S - 1) / S;
  const int start = split * chunk, end = min(start + chunk, len);
  T* out = static_cast<T*>(p.out);

  if (start >= end) {  // nothing to attend: an empty partial (weight 0 in the combine)
    for (int idx = tid; idx < G * D; idx += kThreads) {
      const int64_t row = q_row(p, b, hkv * G + idx / D);
      const int d = idx % D;
      if (S == 1) {
        out[row * D + d] = from_float<T>(0.f);
      } else {
        p.partial_out[(row * S + split) * D + d] = 0.f;
        if (d == 0) p.partial_lse[row * S + split] = -INFINITY;
      }
    }
    return;
  }

  // This thread's slice of every query head, pre-scaled so scores are base-2 logits.
  float q[GMAX][E];
  const T* q_base = static_cast<const T*>(p.q) + b * p.q_batch_stride + hkv * G * p.q_head_stride;
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        const int d = (n * TPK + lane) * VEC + t;
        q[g][n * VEC + t] = g < G ? to_float(q_base[g * p.q_head_stride + d]) * p.scale * kLog2e : 0.f;
      }

  float m[GMAX], l[GMAX], acc[GMAX][E];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  const T* k_base = static_cast<const T*>(p.k_cache) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.v_cache) + b * p.v_batch_stride + hkv * p.v_head_stride;
  // Every thread runs the same number of steps (the shuffles below need whole warps).
  for (int base = start; base < end; base += GROUPS * U) {
    uint4 k_raw[U][NV], v_raw[U][NV];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * GROUPS + group;
      valid[u] = j < end;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int d0 = (n * TPK + lane) * VEC;
        if (valid[u]) {
          k_raw[u][n] = __ldg(reinterpret_cast<const uint4*>(k_base + j * p.k_row_stride + d0));
          v_raw[u][n] = __ldg(reinterpret_cast<const uint4*>(v_base + j * p.v_row_stride + d0));
        } else {
          k_raw[u][n] = make_uint4(0, 0, 0, 0);
          v_raw[u][n] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    float s[U][GMAX];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[E];
#pragma unroll
      for (int n = 0; n < NV; ++n) unpack16<T>(k_raw[u][n], kf + n * VEC);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += q[g][e] * kf[e];
        s[u][g] = dot;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int off = TPK / 2; off > 0; off >>= 1)
          s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);

    float w[U][GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (valid[u]) m_new = fmaxf(m_new, s[u][g]);
      // m_new is -inf only while this group has seen no key at all.
      const float correction = m_new == -INFINITY ? 1.f : exp2f(m[g] - m_new);
      l[g] *= correction;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= correction;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        w[u][g] = valid[u] ? exp2f(s[u][g] - m_new) : 0.f;
        l[g] += w[u][g];
      }
      m[g] = m_new;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[E];
#pragma unroll
      for (int n = 0; n < NV; ++n) unpack16<T>(v_raw[u][n], vf + n * VEC);
#pragma unroll
      for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] += w[u][g] * vf[e];
    }
  }

  // Merge the groups. Group 0 saw key `start`, so the block maximum is finite.
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (lane == 0) {
      s_m[group][g] = m[g];
      s_l[group][g] = l[g];
    }
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int t = 0; t < VEC; ++t) s_acc[group][g][(n * TPK + lane) * VEC + t] = acc[g][n * VEC + t];
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int r = 0; r < GROUPS; ++r) M = fmaxf(M, s_m[r][g]);
    float L = 0.f, A = 0.f;
    for (int r = 0; r < GROUPS; ++r) {
      if (s_m[r][g] == -INFINITY) continue;  // a group without keys
      const float weight = exp2f(s_m[r][g] - M);
      L += weight * s_l[r][g];
      A += weight * s_acc[r][g][d];
    }
    const int64_t row = q_row(p, b, hkv * G + g);
    if (S == 1) {
      out[row * D + d] = from_float<T>(A / L);
    } else {
      p.partial_out[(row * S + split) * D + d] = A / L;
      if (d == 0) p.partial_lse[row * S + split] = M + log2f(L);
    }
  }
}

template <typename T, int D>
void launch_split(const AttentionDecodeParams& p, int groups, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.kv_heads, p.batch);
  auto launch = [&](auto kernel) {
    launch_dependent(p.pdl, "attention_decode (splits)", kernel, grid, dim3(kThreads), 0, stream, {}, p);
  };
  if (groups <= 1) launch(attention_split_kernel<T, D, 1>);
  else if (groups <= 2) launch(attention_split_kernel<T, D, 2>);
  else if (groups <= 4) launch(attention_split_kernel<T, D, 4>);
  else launch(attention_split_kernel<T, D, 8>);
}

}  // namespace

bool attention_decode_head_dim_supported(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

int attention_decode_num_splits(int batch, int kv_heads, int max_len, int device) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device, "attention_decode");
  int splits = ceil_div(kTargetBlocksPerSm * sms, std::max(1, batch * kv_heads));
  splits = std::min(splits, ceil_div(std::max(1, max_len), kMinKeysPerSplit));
  return std::clamp(splits, 1, kAttentionMaxSplits);
}

void attention_decode(const AttentionDecodeParams& p, void* stream) {
  LT2_CHECK(attention_decode_head_dim_supported(p.head_dim), "attention_decode: head dim ",
            p.head_dim, " has no kernel instance (64, 128, 256)");
  LT2_CHECK(p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0 &&
                p.q_heads / p.kv_heads <= kAttentionMaxGroups,
            "attention_decode: ", p.q_heads, " query heads over ", p.kv_heads,
            " kv heads (at most ", kAttentionMaxGroups, " query heads per kv head)");
  LT2_CHECK(p.num_splits >= 1 && p.num_splits <= kAttentionMaxSplits &&
                (p.num_splits == 1 || (p.partial_out && p.partial_lse)),
            "attention_decode: ", p.num_splits, " splits (1..", kAttentionMaxSplits,
            ", a workspace when more than one)");
  if (p.batch == 0) return;
  const int groups = p.q_heads / p.kv_heads;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    switch (p.head_dim) {
      case 64: launch_split<T, 64>(p, groups, s); break;
      case 128: launch_split<T, 128>(p, groups, s); break;
      default: launch_split<T, 256>(p, groups, s); break;
    }
    if (p.num_splits > 1)
      launch_dependent(p.pdl, "attention_decode (combine)", combine_splits_kernel<T, kAttentionMaxSplits>,
                       dim3(p.batch * p.q_heads), dim3(kCombineThreads), 0, s, {}, p.partial_out, p.partial_lse,
                       static_cast<T*>(p.out), p.num_splits, p.head_dim);
  });
}

}  // namespace lt2::kernels
