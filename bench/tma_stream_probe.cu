// How fast can blocks stream HBM into shared memory with TMA bulk copies, against plain register
// loads? The chained decode GEMV (src/lt2/kernels/cuda/gemv_chain.cu) streams its weights at 86%
// of the copy bandwidth where the register GEMV reaches 100%, whatever its ring depth, its mma
// chain or how many lanes issue its copies (bench/results/gemv_chain_h200.txt). This probe takes the
// GEMV out: every block streams its share of a 1 GiB buffer, the consumers only touch each slot,
// and the read rate is reported for
//   register  each thread reads 16-byte vectors (ld.global.cs, 4 in flight), as gemv_decode does
//   tma       a ring of ~128 KB per block (slots of `slot` bytes), each slot filled by `pieces`
//             cp.async.bulk copies issued by 1 or 8 producer lanes, with 1 or 2 blocks per SM and
//             8 consumer warps waiting on each slot's mbarrier. gemv_chain's own stream is slot
//             16384, 8 pieces, 1 lane, 12 slots
// next to a device-to-device copy of the same buffer (read + write) measured in the same run.
//   tma_stream_probe [--reps 20]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lt2/kernels/cuda/tma.cuh"

namespace {

using namespace lt2::kernels;

#define CHECK(call)                                                                       \
  do {                                                                                    \
    const cudaError_t err_ = (call);                                                      \
    if (err_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "tma_stream_probe: %s: %s\n", #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;
constexpr int kMaxSlots = 64;
constexpr int kRingBytes = 128 * 1024;  // the same bytes in flight per block for every slot size

// Register loads: each thread streams 16-byte vectors of its block's range, 4 in flight.
__global__ void __launch_bounds__(256) register_stream(const uint4* src, size_t vecs_per_block, unsigned* sink) {
  const uint4* p = src + blockIdx.x * vecs_per_block;
  unsigned acc = 0;
  for (size_t v = threadIdx.x; v < vecs_per_block; v += 4 * blockDim.x) {
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const size_t i = v + u * blockDim.x;
      r[u] = i < vecs_per_block ? __ldcs(p + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= r[u].x ^ r[u].w;
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // keeps the loads; practically never taken
}

// TMA ring: slot after slot of the block's range, each slot as `pieces` bulk copies issued by the
// first `lanes` lanes of warp kConsumerWarps (lane l copies pieces l, l + lanes, ...); the
// consumers touch one 16-byte vector per thread of each slot and release it.
__global__ void __launch_bounds__(kThreads) tma_stream(const unsigned char* src, size_t bytes_per_block, int copy,
                                                       int slots, int pieces, int lanes, unsigned* sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[kMaxSlots], empty[kMaxSlots];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kConsumerWarps);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const size_t n_slots = bytes_per_block / copy;
  const unsigned char* base = src + blockIdx.x * bytes_per_block;
  if (warp == kConsumerWarps) {
    if (lane >= lanes) return;
    const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    const int piece = copy / pieces;
    for (size_t j = 0; j < n_slots; ++j) {
      const int s = static_cast<int>(j % slots);
      const uint32_t parity = static_cast<uint32_t>((j / slots) & 1);
      if (lane == 0) {
        mbarrier_wait(&empty[s], parity ^ 1u);
        mbarrier_arrive_expect_tx(&full[s], static_cast<uint32_t>(copy));
      }
      __syncwarp(mask);
      for (int k = lane; k < pieces; k += lanes)
        bulk_copy(ring + static_cast<size_t>(s) * copy + k * piece, base + j * copy + k * piece,
                  static_cast<uint32_t>(piece), &full[s]);
    }
    return;
  }
  unsigned acc = 0;
  for (size_t j = 0; j < n_slots; ++j) {
    const int s = static_cast<int>(j % slots);
    mbarrier_wait(&full[s], static_cast<uint32_t>((j / slots) & 1));
    const int v = threadIdx.x % (copy / 16);
    acc ^= reinterpret_cast<const uint4*>(ring + static_cast<size_t>(s) * copy)[v].x;
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&empty[s]);
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
#endif
}

template <typename F>
double median_ms(int reps, F&& launch) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  launch();  // warm-up
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(start));
    launch();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&ms[r], start, stop));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: tma_stream_probe [--reps N]\n");
      return std::strcmp(argv[i], "--help") == 0 ? 0 : 1;
    }
  }
  int device = 0, sms = 0, major = 0, smem_per_sm = 0, smem_optin = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (major < 9) {
    std::fprintf(stderr, "tma_stream_probe: needs an sm_90 device (TMA bulk copies)\n");
    return 1;
  }
  const size_t bytes = size_t(1) << 30;
  unsigned char *src = nullptr, *dst = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMalloc(&sink, sizeof(unsigned) * 4 * sms));
  CHECK(cudaMemset(src, 1, bytes));
  const double copy_ms = median_ms(reps, [&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * bytes / (copy_ms * 1e-3) / 1e9;
  std::printf("device-to-device copy: %.0f GB/s (read + write), %d SMs\n\n", copy_gbs, sms);
  std::printf("| stream | slot bytes | slots | copies per slot | issuing lanes | blocks per SM | GB/s read | %% copy BW |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|\n");
  // streamed: the bytes the blocks read (their shares rounded down to whole slots or vectors).
  auto report = [&](const char* name, int slot, int slots, int pieces, int lanes, int bps, double streamed, double ms) {
    const double gbs = streamed / (ms * 1e-3) / 1e9;
    std::printf("| %s | %d | %d | %d | %d | %d | %.0f | %.1f |\n", name, slot, slots, pieces, lanes, bps, gbs,
                100 * gbs / copy_gbs);
    std::fflush(stdout);
  };
  for (int bps : {1, 2, 4}) {
    const int blocks = bps * sms;
    const size_t vecs = bytes / 16 / blocks;
    report("register", 16, 0, 0, 0, bps, 16.0 * vecs * blocks,
           median_ms(reps, [&] { register_stream<<<blocks, 256>>>(reinterpret_cast<const uint4*>(src), vecs, sink); }));
  }
  CHECK(cudaFuncSetAttribute(tma_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin - 2048));
  struct Issue {
    int pieces, lanes;
  };
  for (int bps : {1, 2})
    for (int slot : {2048, 4096, 8192, 16384, 32768})
      for (Issue is : {Issue{1, 1}, Issue{8, 1}, Issue{8, 8}}) {
        const int budget = std::min({smem_optin, smem_per_sm / bps, kRingBytes + 2048}) - 2048;  // static mbarriers
        const int slots = std::min(kMaxSlots, budget / slot);
        if (slots < 2 || slot / is.pieces < 16) continue;
        const int blocks = bps * sms;
        const size_t per_block = bytes / blocks / slot * slot;
        const size_t smem = static_cast<size_t>(slots) * slot;
        report("tma", slot, slots, is.pieces, is.lanes, bps, double(per_block) * blocks, median_ms(reps, [&] {
                 tma_stream<<<blocks, kThreads, smem>>>(src, per_block, slot, slots, is.pieces, is.lanes, sink);
               }));
      }
  // gemv_chain's own configuration: 12 slots of 16 KB (192 KB in flight), 8 copies, 1 lane.
  {
    const int slot = 16384, slots = 12, blocks = sms;
    const size_t per_block = bytes / blocks / slot * slot;
    report("tma (chain's ring)", slot, slots, 8, 1, 1, double(per_block) * blocks, median_ms(reps, [&] {
             tma_stream<<<blocks, kThreads, size_t(slots) * slot>>>(src, per_block, slot, slots, 8, 1, sink);
           }));
  }
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  CHECK(cudaFree(sink));
  return 0;
}
