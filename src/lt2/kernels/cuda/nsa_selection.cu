// NSA's selection in training and prefill (prefill.h): the top-n blocks of each query row
// (nsa_select_blocks) and the selection branch's additive masks (selection_bias).
//
// Floor. The selection reads a row's NS importances and writes NS flags: at lt-100m's 2048 x 16 (B 16,
// 12 kv heads, NS 32) 50 MB read and 12.6 MB written a layer application, ~0.02 ms at ~3 TB/s; the
// ranking (NS shuffles a row, each compared with a lane's entries: one at NS 32) ~0.05 ms. The
// libtorch form it replaces builds int64 keys and runs a radix top-k over 393k rows of 32 (~1.5 ms a
// layer application on an H100). The masks are pure writes: [B, H, n, keys] in the attention's dtype,
// ~1.07 GB a layer application for three row blocks at that shape, ~0.35 ms at ~3 TB/s, where
// libtorch's broadcast `where` over six dims took ~1.5 ms.
//
// Design.
// - Selection: a warp a row, a lane holding the row's entries lane, lane + 32, ... (NS <= 256: up to eight
//   a lane, the instance with the fewest slots that hold the row). Each entry's key is the reference's
//   (ops/sparse_attention: topk_indices, device_utils.cuh: order_key): the fp32 value's order-preserving
//   bits, then the lower index first; forced blocks (block 0, the n_local ending at the query's) score +inf,
//   invisible ones -inf. An entry is selected when it is visible and fewer than n entries of its row have a
//   larger key: its rank, counted against every entry broadcast by shuffles. Exactly the reference's set,
//   ties included.
// - Masks: 8 columns a thread (one 16-byte store in bf16 or fp16, two in fp32); a selection block is a
//   multiple of 8 keys, so the 8 share one flag. Grid (rows, column groups of 1,024).
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kSelectWarps = 8;
constexpr int kBiasThreads = 128;
constexpr int kBiasColumns = 8;  // a thread's columns

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}

// kSlots entries a lane: NS <= 32 kSlots.
template <typename T, int kSlots>
__global__ void __launch_bounds__(32 * kSelectWarps) nsa_select_blocks_kernel(const NsaSelectParams p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.kv_heads * p.length;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSelectWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32, NS = p.blocks;
  const int t = static_cast<int>(row % p.length);
  const int64_t bh = row / p.length;
  const int h = static_cast<int>(bh % p.kv_heads), b = static_cast<int>(bh / p.kv_heads);
  const int64_t own = floor_div(p.positions[b * p.pos_stride_b + h * p.pos_stride_h + t * p.pos_stride_t], p.block);
  const T* importance = static_cast<const T*>(p.importance) + row * NS;
  // (ordered value, complement of the index): larger means earlier in the reference's top-k order.
  uint64_t key[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int j = lane + 32 * i;
    key[i] = 0;
    if (j >= NS) continue;
    float v = -INFINITY;  // invisible
    if (j <= own) v = (j == 0 || j > own - p.n_local) ? INFINITY : to_float(importance[j]);
    key[i] = (static_cast<uint64_t>(order_key(v)) << 32) | (0xffffffffu - static_cast<uint32_t>(j));
  }
  int rank[kSlots] = {};
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int sources = min(32, NS - 32 * i);  // the row's entries 32 i .. 32 i + 31 that exist
    for (int src = 0; src < sources; ++src) {
      const uint64_t other = __shfl_sync(0xffffffffu, key[i], src);
#pragma unroll
      for (int m = 0; m < kSlots; ++m) rank[m] += other > key[m];
    }
  }
  const int n = min(p.n_select, NS);
  bool* selected = p.selected + row * NS;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int j = lane + 32 * i;
    if (j < NS) selected[j] = j <= own && rank[i] < n;
  }
}

template <typename T>
struct alignas(16) Pack8 {
  T v[kBiasColumns];
};

template <typename T>
__global__ void __launch_bounds__(kBiasThreads) selection_bias_kernel(const SelectionBiasParams p) {
  const int col0 = kBiasColumns * (blockIdx.y * kBiasThreads + threadIdx.x);
  if (col0 >= p.cols) return;
  const int64_t row = blockIdx.x;  // (b, h, i) of [B, H, n]
  const int i = static_cast<int>(row % p.rows);
  const int64_t bh = row / p.rows;
  const int h = static_cast<int>(bh % p.heads), b = static_cast<int>(bh / p.heads);
  const int groups = p.heads / p.kv_heads;
  const int64_t sel_row = (static_cast<int64_t>(b) * p.kv_heads + h / groups) * p.selected_rows + p.row0 + i;
  const bool selected = p.selected[sel_row * p.selected_blocks + col0 / p.block];
  const int64_t last_key = p.first_position + i;  // the row's query position: keys up to it are visible
  Pack8<T> out;
#pragma unroll
  for (int e = 0; e < kBiasColumns; ++e)
    out.v[e] = from_float<T>(selected && col0 + e <= last_key ? 0.f : -INFINITY);
  T* dst = static_cast<T*>(p.bias) + row * p.pitch + col0;
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&out);
  } else {
    reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(&out)[0];
    reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(&out)[1];
  }
}

}  // namespace

bool nsa_select_blocks_supported(int64_t rows, int64_t blocks) {
  return rows >= 0 && rows <= int64_t{kSelectWarps} * INT32_MAX && blocks >= 1 && blocks <= kNsaSelectMaxBlocks;
}

void nsa_select_blocks(const NsaSelectParams& p, void* stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.kv_heads * p.length;
  LT2_CHECK(nsa_select_blocks_supported(rows, p.blocks) && p.block >= 1 && p.n_select >= 0,
            "nsa_select_blocks: ", rows, " rows of ", p.blocks, " blocks of ", p.block, " (at most ",
            kNsaSelectMaxBlocks, " blocks a row), ", p.n_select, " selected");
  LT2_CHECK(p.importance && p.positions && p.selected,
            "nsa_select_blocks: importance, positions and selected must be given");
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>((rows + kSelectWarps - 1) / kSelectWarps);
  dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const auto kernel = p.blocks <= 32    ? nsa_select_blocks_kernel<T, 1>
                        : p.blocks <= 64  ? nsa_select_blocks_kernel<T, 2>
                        : p.blocks <= 128 ? nsa_select_blocks_kernel<T, 4>
                                          : nsa_select_blocks_kernel<T, kNsaSelectMaxBlocks / 32>;
    kernel<<<grid, 32 * kSelectWarps, 0, s>>>(p);
  });
  check_launch("nsa_select_blocks");
}

bool selection_bias_supported(int64_t rows, int64_t cols, int64_t block) {
  return rows >= 0 && rows <= INT32_MAX && cols >= 0 && cols <= int64_t{65535} * kBiasThreads * kBiasColumns &&
         block >= kBiasColumns && block % kBiasColumns == 0 && cols % block == 0;
}

void selection_bias(const SelectionBiasParams& p, void* stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.rows;
  LT2_CHECK(selection_bias_supported(rows, p.cols, p.block) && p.kv_heads >= 1 && p.heads % p.kv_heads == 0 &&
                p.pitch >= p.cols && p.pitch % kBiasColumns == 0,
            "selection_bias: ", rows, " rows of ", p.cols, " columns (pitch ", p.pitch, "), blocks of ", p.block,
            " keys (a multiple of ", kBiasColumns, " dividing the columns), ", p.heads, " heads over ", p.kv_heads);
  LT2_CHECK(p.selected && p.bias && aligned16(p.bias),
            "selection_bias: selected and a 16-byte aligned bias must be given");
  if (rows == 0 || p.cols == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(ceil_div(p.cols / kBiasColumns, kBiasThreads)));
  dispatch_dtype(p.dtype, [&](auto t) { selection_bias_kernel<decltype(t)><<<grid, kBiasThreads, 0, s>>>(p); });
  check_launch("selection_bias");
}

}  // namespace lt2::kernels
