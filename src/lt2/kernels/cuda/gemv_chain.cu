// Dependent decode products in one persistent kernel (decode.h: gemv_chain).
//
// Why: each separate GEMV launch pays ~4-6 us of ramp and tail (the launch, the first loads in
// flight, the last blocks draining): 2048 x 3072 takes 7.2 us where its 12.6 MB need 3.0 us at the
// copy bandwidth (bench/results/gemv_splits_h200.txt), and a 1.3B LT2 step has ~340 products. The
// weights do not depend on the activations, so a block can fetch the next product's weights while
// the current product finishes and while the grid waits for that product's y to be complete.
//
// Shape: one block per SM (cooperative launch: all co-resident), 8 consumer warps and 1 producer
// warp. A product's work is tiles of 8 weight rows (the mma's N), dealt round-robin to the blocks,
// each tile in slices of kSliceK along K. The producer walks the block's (product, tile, slice)
// sequence and copies each slice's 8 row pieces into the next ring slot with cp.async.bulk (TMA),
// which completes the slot's `full` mbarrier; the consumers walk the same sequence, multiply the
// slot and release it on its `empty` mbarrier. Only the consumers meet at the grid barrier between
// products, so the producer streams on across it until the ring is full.
// The mma: m16n8k16 with the x rows as A (M <= 8 of its 16 rows, the rest zero) and the tile's W
// rows as B. The k order inside a product is free, so lane (g, q) (g = lane / 4, q = lane % 4) feeds
// both operands from one 16-byte load each: x row g and W row g at k = 32c + 8q .. + 7 fill the
// fragments of two products. Warps split a slot's K; the block sums them per tile.
// x is staged in shared memory once per product and block with its prologue applied, rounded to T
// as the gemv kernels round their operands; RmsNorm's rsqrt is applied to the sums.
// Slots are 8 rows x 2048 of K (32 KB, eight 4 KB copies): TMA's cost is per copy and per slot, and
// bench/tma_stream_probe measured eight 2 KB copies per 16 KB slot at 70% of the copy bandwidth,
// eight 4 KB copies per 32 KB slot at 101% (bench/results/tma_stream_probe_h200.md).
// Floor and rate (bench/results/gemv_chain_h200.txt, H200): the LM head alone streams at the copy
// bandwidth; the 1.3B block tail (77.7 MB, 18.4 us at the copy bandwidth) takes 31.7 us at 1 row
// against 36.4 us as three launches in the same run, the rest being its two grid barriers with x
// staging and the launch. Every block stages all of a product's x, so SwiGLU's silu(a) * b is
// w1|w3's epilogue (silu_mul_out: a tile is 4 rows of each half of W): w2 then stages `hidden`
// plain values per row, not 2 x hidden with SiLU·mul applied by every block (180 KB per block at
// 8 rows).
// Launched as a programmatic dependent (the kernel before it may release it early: the GDN step
// and the other decode kernels do), so the producer streams weights while that kernel finishes.
#include <cuda/atomic>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "lt2/kernels/cuda/device_utils.cuh"
#include "lt2/kernels/cuda/tma.cuh"

namespace lt2::kernels {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kTileRows = 8;               // weight rows per tile: the mma's N
constexpr int kSliceK = 2048;              // K per ring slot
constexpr int kChunkK = 32;                // K per warp mma pair: 4 lanes x 8 elements
// Bytes between a slot's rows (and x's rows): 64 past a multiple of 128, so the 16-byte loads of
// lanes 0-7 (rows g = 0, 1, four lanes each) fall on distinct banks.
__host__ __device__ constexpr int padded_pitch(int bytes) { return (bytes + 127) / 128 * 128 + 64; }
constexpr int kSlotBytes = kTileRows * padded_pitch(kSliceK * 2);
constexpr int kSlotPitch = padded_pitch(kSliceK * 2);
constexpr int kMinSlots = 4, kMaxSlots = 12;  // 4 slots: 133 KB in flight per SM
constexpr int kMaxStreams = 64;               // grid barriers: one per (device, stream)

struct GridBarrier {
  unsigned count, generation;
};
__device__ GridBarrier g_grid_barriers[kMaxStreams];  // zero at module load; each use leaves count 0

// The consumer warps' own barrier (the producer warp never waits on the consumers).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

// Every consumer of every block has passed its earlier stores before any goes on. Self-resetting
// (count back to 0, generation advanced), so one barrier serves every launch on its stream.
__device__ void grid_sync(GridBarrier* bar) {
  consumer_sync();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<unsigned, cuda::thread_scope_device> count(bar->count), generation(bar->generation);
    __threadfence();
    const unsigned gen = generation.load(cuda::memory_order_relaxed);
    if (count.fetch_add(1, cuda::memory_order_acq_rel) == gridDim.x - 1) {
      count.store(0, cuda::memory_order_relaxed);
      generation.fetch_add(1, cuda::memory_order_release);
    } else {
      while (generation.load(cuda::memory_order_acquire) == gen) {
      }
    }
    __threadfence();
  }
  consumer_sync();
}

// Loads that see what other blocks wrote earlier in this kernel (L2, not the read-only path).
__device__ __forceinline__ uint4 load_coherent16(const void* base, int v) {
  return __ldcg(reinterpret_cast<const uint4*>(base) + v);
}
template <typename T>
__device__ __forceinline__ float load_coherent(const T* p) {
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  T value;
  memcpy(&value, &bits, sizeof(T));
  return to_float(value);
}

// The ring position both sides walk: slot index and the parity of its current use.
struct RingCursor {
  int slot = 0;
  uint32_t parity = 0;
  __device__ void advance(int slots) {
    if (++slot == slots) slot = 0, parity ^= 1u;
  }
};

// A tile is 8 weight rows, giving 8 columns of y; with the SiLU·mul epilogue it is 4 rows of each
// half of W, rows j and n / 2 + j giving column j of y.
__device__ __forceinline__ int tile_cols(const GemvParams& g) { return g.silu_mul_out ? kTileRows / 2 : kTileRows; }
__device__ __forceinline__ int64_t y_cols(const GemvParams& g) { return g.silu_mul_out ? g.n / 2 : g.n; }
__device__ __forceinline__ int64_t tile_count(const GemvParams& g) {
  return (y_cols(g) + tile_cols(g) - 1) / tile_cols(g);
}
// W's row of tile t's row r. Columns past y's read its last column's rows (in bounds); their
// outputs are not written.
__device__ __forceinline__ int64_t tile_row(const GemvParams& g, int64_t t, int r) {
  if (!g.silu_mul_out) return min(t * kTileRows + r, g.n - 1);
  constexpr int kHalf = kTileRows / 2;
  return (r < kHalf ? 0 : g.n / 2) + min(t * kHalf + r % kHalf, g.n / 2 - 1);
}

// Producer (one lane): every slice of every tile of every product this block computes, in order.
template <typename T>
__device__ void produce(const GemvChainParams& p, unsigned char* ring, uint64_t* full, uint64_t* empty, int slots) {
  RingCursor c;
  for (int i = 0; i < p.products; ++i) {
    const GemvParams& g = p.product[i];
    const T* w = static_cast<const T*>(g.w);
    for (int64_t t = blockIdx.x; t < tile_count(g); t += gridDim.x) {
      for (int k0 = 0; k0 < g.k; k0 += kSliceK) {
        const int len = min(kSliceK, g.k - k0);
        mbarrier_wait(&empty[c.slot], c.parity ^ 1u);  // the consumers are done with the slot's last use
        mbarrier_arrive_expect_tx(&full[c.slot], static_cast<uint32_t>(kTileRows * len * sizeof(T)));
        unsigned char* slot = ring + static_cast<size_t>(c.slot) * kSlotBytes;
        for (int r = 0; r < kTileRows; ++r)
          bulk_copy(slot + r * kSlotPitch, w + tile_row(g, t, r) * g.k + k0, static_cast<uint32_t>(len * sizeof(T)),
                    &full[c.slot]);
        c.advance(slots);
      }
    }
  }
}

// x of product g into shared memory ([rows, x_pitch bytes]) with its prologue applied; RmsNorm's
// rsqrt(mean(x^2) + eps) per row into s_rinv. Consumers only; ends with their barrier. At 8 rows
// staging is the consumers' largest cost (ncu puts 31% of the 8-row tail's warp samples here,
// instruction-bound with 8 warps per SM: bench/results/gemv_chain_sass8_h200.md), so:
// - without a prologue (w2's x after the SiLU·mul epilogue, o_proj's where the mixer has no output
//   gate) x is copied as it is by cp.async: every vector in flight at once, no registers held, no
//   unpacking, rounding or division per vector;
// - with one, each thread issues the loads of kStageBatch vectors before using any: x sits in L2,
//   one round trip per vector would cost ~15 us for 8 rows of a 2 x 5632 SiLU·mul input, and 12 at
//   a time take 8 rows of 5632 in two round trips. This path keeps a division per vector for its
//   (m, v): a division-free cursor, like a second copy path beside it, spills at the 9-warp
//   block's 168-register cap.
constexpr int kStageBatch = 12;
template <typename T>
__device__ void stage_x(const GemvParams& g, unsigned char* xs, int x_pitch, float (*s_sumsq)[kGemvMaxRows],
                        float* s_rinv) {
  const int vecs = g.k / 8, total = static_cast<int>(g.rows) * vecs;
  const T* x = static_cast<const T*>(g.x);
  if (g.prologue == GemvPrologue::None) {
    for (int m = 0; m < g.rows; ++m)
      for (int v = threadIdx.x; v < vecs; v += kConsumers)
        cp_async16(xs + m * x_pitch + v * 16, x + m * g.x_row_stride + v * 8);
    cp_async_commit();
    cp_async_wait<0>();
    consumer_sync();
    return;
  }
  float sumsq[kGemvMaxRows];
#pragma unroll
  for (int m = 0; m < kGemvMaxRows; ++m) sumsq[m] = 0.f;
  for (int base = threadIdx.x; base < total; base += kConsumers * kStageBatch) {
    uint4 raw[kStageBatch], aux[kStageBatch];  // x's vector and its prologue's operand
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = base + u * kConsumers;
      if (i >= total) break;
      const int m = i / vecs, v = i % vecs;
      const T* row = x + m * g.x_row_stride;
      raw[u] = load_coherent16(row, v);
      if (g.prologue == GemvPrologue::RmsNorm) aux[u] = __ldg(reinterpret_cast<const uint4*>(g.norm_weight) + v);
      else if (g.prologue == GemvPrologue::SiluMul) aux[u] = load_coherent16(row + g.k, v);
      else if (g.prologue == GemvPrologue::SigmoidGate)
        aux[u] = load_coherent16(static_cast<const T*>(g.x_gate) + m * g.x_gate_row_stride, v);
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = base + u * kConsumers;
      if (i >= total) break;
      const int m = i / vecs, v = i % vecs;
      float f[8], a[8];
      unpack16<T>(raw[u], f);
      unpack16<T>(aux[u], a);
      if (g.prologue == GemvPrologue::RmsNorm) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s), f[e] *= a[e];
#pragma unroll
        for (int r = 0; r < kGemvMaxRows; ++r)
          if (r == m) sumsq[r] += s;
      } else if (g.prologue == GemvPrologue::SiluMul) {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = silu(f[e]) * a[e];
      } else {  // SigmoidGate
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] *= sigmoid(a[e]);
      }
      uint4 packed;
      packed.x = pack2<T>(f[0], f[1]), packed.y = pack2<T>(f[2], f[3]);
      packed.z = pack2<T>(f[4], f[5]), packed.w = pack2<T>(f[6], f[7]);
      *reinterpret_cast<uint4*>(xs + m * x_pitch + v * 16) = packed;
    }
  }
  if (g.prologue == GemvPrologue::RmsNorm) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) {
      const float s = warp_sum(sumsq[m]);
      if (lane == 0) s_sumsq[warp][m] = s;
    }
    consumer_sync();
    if (threadIdx.x < g.rows) {
      float s = 0.f;
      for (int w = 0; w < kConsumerWarps; ++w) s += s_sumsq[w][threadIdx.x];
      s_rinv[threadIdx.x] = rsqrtf(s / static_cast<float>(g.k) + g.norm_eps);
    }
  }
  consumer_sync();
}

// y[m, n] = f(rinv_m sums[m][c]) + residual, rounded once: sums [warps][rows][8] are the warps'
// partial sums of the tile, c its column of y; f is the identity, or with the SiLU·mul epilogue
// silu(a) * b of the tile's rows c (a) and c + 4 (b).
template <typename T>
__device__ __forceinline__ void store_y(const GemvParams& g, const float (*sums)[kGemvMaxRows][kTileRows], int m,
                                        int c, int64_t n, float residual, const float* s_rinv) {
  float acc = 0.f, up = 0.f;
#pragma unroll
  for (int w = 0; w < kConsumerWarps; ++w) {
    acc += sums[w][m][c];
    if (g.silu_mul_out) up += sums[w][m][c + kTileRows / 2];
  }
  if (g.prologue == GemvPrologue::RmsNorm) acc *= s_rinv[m], up *= s_rinv[m];
  if (g.silu_mul_out) acc = silu(acc) * up;
  static_cast<T*>(g.y)[m * g.y_row_stride + n] = from_float<T>(acc + residual);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_chain_kernel(const GemvChainParams p, GridBarrier* barrier, int slots, int x_pitch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;                                      // [slots][kTileRows][kSlotPitch]
  unsigned char* xs = smem + static_cast<size_t>(slots) * kSlotBytes;  // [rows][x_pitch]
  __shared__ __align__(8) uint64_t full[kMaxSlots], empty[kMaxSlots];
  __shared__ float s_red[2][kConsumerWarps][kGemvMaxRows][kTileRows];  // per-warp sums, two tiles in turn
  __shared__ float s_sumsq[kConsumerWarps][kGemvMaxRows];
  __shared__ float s_rinv[kGemvMaxRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], kConsumerWarps);
    mbarrier_init_fence();
  }
  __syncthreads();
  if (warp == kConsumerWarps) {
    if (lane == 0) produce<T>(p, ring, full, empty, slots);
    return;
  }
  // Launched as a programmatic dependent: the producer streams weights (which no kernel writes)
  // while the kernel before this one finishes; the consumers wait for it before reading x, then
  // release the next launch (a chain's blocks take the SMs as this one's exit).
  dependent_kernel_start();

  const int g8 = lane / 4, q = lane % 4;
  RingCursor c;
  int tiles_done = 0;
  for (int i = 0; i < p.products; ++i) {
    const GemvParams& g = p.product[i];
    if (i > 0) grid_sync(barrier);  // product i - 1's y (this one's x or residual) is complete
    if (blockIdx.x >= tile_count(g)) continue;
    stage_x<T>(g, xs, x_pitch, s_sumsq, s_rinv);
    const bool has_x = g8 < g.rows;
    const unsigned char* x_row = xs + g8 * x_pitch;
    for (int64_t t = blockIdx.x; t < tile_count(g); t += gridDim.x) {
      // Output (m, c) of the tile is thread m * cols + c's; its residual is loaded now, so the L2
      // round trip overlaps the tile's slices instead of delaying the store.
      const int cols = tile_cols(g), out_m = threadIdx.x / cols, out_c = threadIdx.x % cols;
      const int64_t out_n = t * cols + out_c;
      const bool is_out = out_m < g.rows && out_n < y_cols(g);
      const float residual =
          is_out && g.residual
              ? load_coherent(static_cast<const T*>(g.residual) + out_m * g.residual_row_stride + out_n)
              : 0.f;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < g.k; k0 += kSliceK) {
        const int chunks = min(kSliceK, g.k - k0) / kChunkK;
        mbarrier_wait(&full[c.slot], c.parity);
        const unsigned char* w_row = ring + static_cast<size_t>(c.slot) * kSlotBytes + g8 * kSlotPitch;
        for (int ch = warp; ch < chunks; ch += kConsumerWarps) {
          const uint4 wv = *reinterpret_cast<const uint4*>(w_row + ch * (kChunkK * 2) + q * 16);
          uint4 xv = make_uint4(0u, 0u, 0u, 0u);
          if (has_x) xv = *reinterpret_cast<const uint4*>(x_row + (k0 + ch * kChunkK) * 2 + q * 16);
          mma_16816<T>(acc, xv.x, 0u, xv.y, 0u, wv.x, wv.y);
          mma_16816<T>(acc, xv.z, 0u, xv.w, 0u, wv.z, wv.w);
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[c.slot]);
        c.advance(slots);
      }
      // acc[0], acc[1] = C[x row g8][tile rows 2q, 2q + 1].
      float(*red)[kGemvMaxRows][kTileRows] = s_red[tiles_done++ & 1];
      red[warp][g8][2 * q] = acc[0];
      red[warp][g8][2 * q + 1] = acc[1];
      consumer_sync();  // (the other buffer's readers finished before this barrier, too)
      if (is_out) store_y<T>(g, red, out_m, out_c, out_n, residual, s_rinv);
    }
  }
#endif
}

// Shared memory of one launch: the ring and x's rows (the widest x of the chain).
struct ChainPlan {
  int slots = 0, x_pitch = 0, blocks = 0;
  size_t smem = 0;
};

size_t element_bytes(DType dtype) { return dtype == DType::Float32 ? 4 : 2; }

ChainPlan chain_plan(const GemvChainParams& p, int device) {
  ChainPlan plan;
  int64_t rows = 0, k = 0;
  for (int i = 0; i < p.products; ++i)
    rows = std::max(rows, p.product[i].rows), k = std::max<int64_t>(k, p.product[i].k);
  plan.x_pitch = padded_pitch(static_cast<int>(k * element_bytes(p.product[0].dtype)));
  const size_t x_bytes = static_cast<size_t>(rows) * plan.x_pitch;
  // What the kernel's static shared memory (mbarriers, sums; 4.5 KB, rounded up) leaves of the
  // per-block maximum (one block per SM).
  constexpr size_t kStaticBytes = 8 * 1024;
  const size_t optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device, "gemv_chain");
  const size_t room = optin > kStaticBytes + x_bytes ? optin - kStaticBytes - x_bytes : 0;
  // p.max_slots caps the ring (a benchmarking knob: how the rate depends on the bytes in flight per
  // SM).
  const int cap = p.max_slots > 0 ? std::max(kMinSlots, std::min(kMaxSlots, p.max_slots)) : kMaxSlots;
  plan.slots = static_cast<int>(std::min<size_t>(cap, room / kSlotBytes));
  plan.smem = static_cast<size_t>(plan.slots) * kSlotBytes + x_bytes;
  plan.blocks = device_attribute(cudaDevAttrMultiProcessorCount, device, "gemv_chain");
  return plan;
}

// The grid barrier of (device, stream): its own, so chains on different streams never share one.
GridBarrier* stream_barrier(int device, cudaStream_t stream) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int> slots;
  static std::map<int, GridBarrier*> base;
  std::lock_guard<std::mutex> lock(mutex);
  auto& b = base[device];
  if (!b) {
    void* address = nullptr;
    const cudaError_t err = cudaGetSymbolAddress(&address, g_grid_barriers);
    LT2_CHECK(err == cudaSuccess, "gemv_chain: cannot locate its grid barriers: ", cudaGetErrorString(err));
    b = static_cast<GridBarrier*>(address);
  }
  const auto key = std::make_pair(device, stream);
  auto it = slots.find(key);
  if (it == slots.end()) {
    int used = 0;
    for (const auto& [k, v] : slots) used += k.first == device;
    LT2_CHECK(used < kMaxStreams, "gemv_chain: more than ", kMaxStreams, " streams on device ", device);
    it = slots.emplace(key, used).first;
  }
  return b + it->second;
}

}  // namespace

namespace {

// Why gemv_chain cannot take p on `device` (empty when it can); *plan gets the launch's plan.
std::string chain_problem(const GemvChainParams& p, int device, ChainPlan* plan) {
  if (p.products < 1 || p.products > kGemvChainMaxProducts)
    return cat("1..", kGemvChainMaxProducts, " products, found ", p.products);
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, device, "gemv_chain") < 9)
    return "the chained GEMV needs an sm_90 device (TMA bulk copies)";
  const DType dtype = p.product[0].dtype;
  if (dtype == DType::Float32) return "the chained GEMV takes bf16 or fp16";
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  for (int i = 0; i < p.products; ++i) {
    const GemvParams& g = p.product[i];
    auto at = [i] { return cat("product ", i, ": "); };  // built only for an error
    if (g.dtype != dtype) return at() + "every product in one dtype";
    if (g.batch != 1 || g.y_gate) return at() + "one product per GemvParams (batch 1) and no y_gate";
    if (g.rows < 1 || g.rows > kGemvMaxRows || g.n < 1 || g.k < kChunkK || g.k % kChunkK != 0)
      return cat(at(), g.rows, " rows (1..", kGemvMaxRows, ") of K = ", g.k, " (a multiple of ", kChunkK, ") into N = ", g.n);
    const int64_t row_bytes = g.x_row_stride * 2, k_bytes = static_cast<int64_t>(g.k) * 2;
    if (!aligned(g.x) || !aligned(g.w) || row_bytes % 16 != 0 || (g.x_gate && (!aligned(g.x_gate) || g.x_gate_row_stride * 2 % 16 != 0)))
      return at() + "x, x_gate and W 16-byte aligned, rows too";
    if (k_bytes % 16 != 0) return at() + "rows of W a multiple of 16 bytes";
    if (g.prologue == GemvPrologue::RmsNorm && !g.norm_weight) return at() + "the RmsNorm prologue needs its weight";
    if (g.prologue == GemvPrologue::SigmoidGate && !g.x_gate) return at() + "the SigmoidGate prologue needs x_gate";
    if (g.silu_mul_out && g.n % 2 != 0) return cat(at(), "the SiLU·mul epilogue needs W's two halves, found N = ", g.n);
  }
  *plan = chain_plan(p, device);
  if (plan->slots < kMinSlots)
    return cat("x rows of the widest product leave room for ", plan->slots, " ring slots of shared memory (",
               kMinSlots, " needed)");
  return "";
}

}  // namespace

std::string gemv_chain_problem(const GemvChainParams& p, int device) {
  ChainPlan plan;
  return chain_problem(p, device, &plan);
}

void gemv_chain(const GemvChainParams& p, void* stream) {
  int device = 0;
  cudaGetDevice(&device);
  ChainPlan plan;
  const std::string problem = chain_problem(p, device, &plan);
  LT2_CHECK(problem.empty(), "gemv_chain: ", problem);
  const auto s = static_cast<cudaStream_t>(stream);
  // One product has no grid barrier to meet (gemv_fused's one-product chains run on any stream).
  GridBarrier* barrier = p.products > 1 ? stream_barrier(device, s) : nullptr;
  dispatch_dtype(p.product[0].dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, float>) {
      reserve_shared<gemv_chain_kernel<T>>(plan.smem, "gemv_chain");
      launch_dependent(p.pdl, "gemv_chain", gemv_chain_kernel<T>, dim3(static_cast<unsigned>(plan.blocks)), dim3(kThreads),
                       plan.smem, s, {cooperative_launch()}, p, barrier, plan.slots, plan.x_pitch);
    }
  });
}

}  // namespace lt2::kernels
