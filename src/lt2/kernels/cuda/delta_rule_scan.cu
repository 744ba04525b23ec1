// The chunked delta rule's kernels (prefill.h): the chunk preparation (delta_rule_prepare), the
// UT transform's triangular inverse, and the inter-chunk scan (delta_rule_scan), one launch for all
// chunks of all (sequence, head) pairs, where ops::delta_rule_chunked would otherwise loop on the
// host over ~8 libtorch kernels per chunk. The forward pass runs it in chunk order, the backward
// pass (the adjoint recurrence of the state gradients) in reverse order with an addend.
//
// Floor. The value columns of S [K, V] evolve independently, so a block owns S[:, v0 : v0 + VB]
// of one (sequence, head) in shared memory for the whole scan. Per chunk and block it reads W_n
// [C, K], Kt_n [K, C], U_n[:, slice] [C, VB] and carry_n [1 or K], writes S_n and V_new (the
// slices) and does 2 C K VB FMAs: at the 1.3B GDN head (K 96, V 192, C 64, VB 16) 49 KiB read
// (mostly L2 hits: the V / VB blocks of a head read the same matrices), 10 KiB written, 197k FMAs.
// The chunks of a block are sequential, so the scan is bound by each chunk's latency (its two
// products, two barriers and the loads in flight), not by the device's FLOPs. That is why the
// outputs O_n = Q_n S_n + A_n V_new, which do not feed the recurrence, stay out of the loop (the
// op computes them for all chunks with two batched GEMMs): inside it they would double each
// chunk's chain of products and barriers. A 4096-token lt2-gdn-1.3b prefill spends 0.63 ms per
// call here, 9.8 us per chunk (bench/results/prefill_profile_h200.md).
//
// Design.
// - Grid (V / VB, H, B), 256 threads. Thread t owns value column j = t % VB of the slice and the
//   rows rg + RG i (rg = t / VB, RG = 256 / VB row groups) of every [rows, VB] product, so each
//   phase is one primitive, rows_times_cols: acc[i] += sum_x L[row_i][x] R[x][j], the left matrix
//   read as 16-byte broadcasts (one row, or 32 / VB consecutive rows, per warp), the right one
//   ([x][VB] rows, S or V_new) as one conflict-free word per lane. Plain fp32 FMAs: TF32 tensor
//   cores would not hold the 1e-5 fp32 tolerance of the GPU tests (tests/gpu/gpu_testing.h).
// - Per chunk: store S_n (each thread its own entries); 1 V_new = U_n - W_n S (shared and
//   global); 2 S = carry_n * S + Kt_n V_new + Y_n (each thread updates its own entries, the
//   accumulator starting from the addend Y_n where one is given). Two barriers.
// - The chunk's matrices stream in with cp.async: the next chunk's Kt and carry (two buffers, taking
//   turns) are issued as chunk n starts and have the whole chunk to land; the next W is issued once
//   phase 1 is done with W_n and lands during phase 2. U_n is read into registers at the chunk
//   start. Shared memory at the 1.3B head with VB 16: 87 KiB (two blocks per SM; the launch
//   bounds cap registers at 128 for that: VB 8 / 16 use 96, VB 32 128 with 4 bytes spilled);
//   K 256 with C 64 fits with VB 8 or 16 only (226 KiB at 16).
// - Left-matrix rows sit `broadcast_pitch` floats apart (a multiple of 4 that is 4 mod 8), so the
//   2 or 4 rows a warp reads at once (VB 16 or 8) fall in distinct banks.
// - VB: the widest of 32, 16, 8 dividing V, narrowed while the grid has fewer blocks than SMs
//   (a B 1 prefill of 16 heads of 192 columns: VB 16, 192 blocks). Untuned.
// Requirements: K, C multiples of 4 (16-byte rows), K <= 256, C <= 64, V a multiple of 8.
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kThreads = 256;

// Shared-memory row pitch (floats) of a left matrix with `cols` columns: see the header comment.
__host__ __device__ constexpr int broadcast_pitch(int cols) { return round_up(cols, 8) + 4; }

// The block's shared memory, offsets in floats (all multiples of 4: 16-byte aligned).
struct ScanLayout {
  int pk, pc;     // row pitches of the [., K] and [., C] left matrices
  int s;          // S slice       [K, VB]
  int vn;         // V_new slice   [C, VB]
  int w;          // W_n [C, pk]
  int kt;         // Kt_n [K, pc], two buffers taking turns, kt_size apart
  int carry;      // carry_n [K] (or [1]), two buffers with them, carry_size apart
  int kt_size, carry_size;
  int total;
};
__host__ __device__ inline ScanLayout scan_layout(int K, int C, int VB) {
  ScanLayout l{};
  l.pk = broadcast_pitch(K);
  l.pc = broadcast_pitch(C);
  l.s = 0;
  l.vn = l.s + K * VB;
  l.w = l.vn + C * VB;
  l.kt = l.w + C * l.pk;
  l.kt_size = K * l.pc;
  l.carry = l.kt + 2 * l.kt_size;
  l.carry_size = round_up(K, 4);
  l.total = l.carry + 2 * l.carry_size;
  return l;
}

size_t scan_smem_bytes(int K, int C, int VB) { return sizeof(float) * scan_layout(K, C, VB).total; }

// rows x cols floats, rows `cols` apart in global memory (cols % 4 == 0, 16-byte aligned), to
// shared memory rows `pitch` apart; the whole block issues, one 16-byte copy per thread and step.
__device__ __forceinline__ void copy_rows_async(float* dst, int pitch, const float* src, int rows, int cols) {
  const int per_row = cols / 4;
  for (int i = threadIdx.x; i < rows * per_row; i += kThreads) {
    const int r = i / per_row, c = 4 * (i % per_row);
    cp_async16(dst + r * pitch + c, src + static_cast<int64_t>(r) * cols + c);
  }
}

// acc[i] += sum_{x < X} L[r_i][x] R[x][j] for the thread's rows r_i = rg + RG i that are < rows.
// L: row-major in shared memory, rows `lp` floats apart (16-byte aligned rows); R: [X, VB] in
// shared memory. X % 4 == 0. The rows go in groups of up to 8, each a pass over x that reads R
// once, and the passes stop at the first group without a row below `rows`: the register arrays
// are sized for the largest K and C, and predicated-off FMAs would still cost issue slots.
template <int VB, int Rows>
__device__ __forceinline__ void rows_times_cols(float (&acc)[Rows], const float* L, int lp, int rows,
                                                const float* R, int X, int rg, int j) {
  constexpr int RG = kThreads / VB;
  constexpr int kGroup = Rows < 8 ? Rows : 8;
  static_assert(Rows % kGroup == 0, "rows per thread must split into equal groups");
#pragma unroll
  for (int g = 0; g < Rows; g += kGroup) {
    if (rg + RG * g >= rows) break;
    for (int x = 0; x < X; x += 4) {
      const float r0 = R[(x + 0) * VB + j], r1 = R[(x + 1) * VB + j];
      const float r2 = R[(x + 2) * VB + j], r3 = R[(x + 3) * VB + j];
#pragma unroll
      for (int i = g; i < g + kGroup; ++i) {
        const int r = rg + RG * i;
        if (r < rows) {
          const float4 l = *reinterpret_cast<const float4*>(L + r * lp + x);
          acc[i] = fmaf(l.x, r0, acc[i]);
          acc[i] = fmaf(l.y, r1, acc[i]);
          acc[i] = fmaf(l.z, r2, acc[i]);
          acc[i] = fmaf(l.w, r3, acc[i]);
        }
      }
    }
  }
}

template <int VB>
__global__ void __launch_bounds__(kThreads, 2) delta_rule_scan_kernel(const DeltaRuleScanParams p) {
  constexpr int RG = kThreads / VB;                               // row groups
  constexpr int kChunkRows = (kMaxScanChunk + RG - 1) / RG;       // rows of [C, VB] per thread
  constexpr int kStateRows = (kMaxScanHeadK + RG - 1) / RG;       // rows of [K, VB] per thread
  const int K = p.head_k, V = p.head_v, C = p.chunk_size, N = p.chunks;
  const int j = threadIdx.x % VB, rg = threadIdx.x / VB;
  const int v0 = blockIdx.x * VB;
  const int64_t bh = static_cast<int64_t>(blockIdx.z) * p.heads + blockIdx.y;
  const ScanLayout lay = scan_layout(K, C, VB);
  extern __shared__ __align__(16) float smem[];
  float* sS = smem + lay.s;
  float* sVn = smem + lay.vn;
  float* sW = smem + lay.w;

  // The chunk processed at step i, and chunk n of (sequence, head) bh: the first element of each
  // per-chunk matrix.
  auto chunk_at = [&](int i) { return p.reverse ? N - 1 - i : i; };
  auto w_of = [&](int n) { return p.w + ((bh * N + n) * C) * K; };
  auto kt_of = [&](int n) { return p.kt + ((bh * N + n) * K) * C; };
  auto uv_offset = [&](int n, int c) { return ((bh * N + n) * C + c) * V + v0 + j; };  // u, v_new
  const int carry_dim = p.per_channel_carry ? K : 1;
  // Kt_n and carry_n into buffer `b`.
  auto load_kt_carry = [&](int n, int b) {
    copy_rows_async(smem + lay.kt + b * lay.kt_size, lay.pc, kt_of(n), K, C);
    const float* carry = p.carry + (bh * N + n) * carry_dim;
    float* dst = smem + lay.carry + b * lay.carry_size;
    if (p.per_channel_carry) copy_rows_async(dst, 0, carry, 1, K);
    else if (threadIdx.x == 0) cp_async4(dst, carry);
  };

  // Prologue: W_0, Kt_0 and carry_0 in flight, S from the initial state.
  if (N > 0) {
    copy_rows_async(sW, lay.pk, w_of(chunk_at(0)), C, K);
    load_kt_carry(chunk_at(0), 0);
  }
  cp_async_commit();
  const float* S0 = p.initial_state ? p.initial_state + bh * K * V + v0 : nullptr;
  for (int k = rg; k < K; k += RG) sS[k * VB + j] = S0 ? S0[static_cast<int64_t>(k) * V + j] : 0.f;

  for (int step = 0; step < N; ++step) {
    const int b = step & 1, n = chunk_at(step);
    // A document starts here (packed rows): S restarts from its state. Each thread replaces its
    // own entries, which only it reads before the next barrier.
    const int reset = p.resets ? __ldg(p.resets + n) : -1;
    if (reset >= 0) {
      const float* R = p.reset_states ? p.reset_states + (static_cast<int64_t>(reset) * p.heads + blockIdx.y) * K * V + v0
                                      : nullptr;
      for (int k = rg; k < K; k += RG) sS[k * VB + j] = R ? R[static_cast<int64_t>(k) * V + j] : 0.f;
    }
    // S_n: the thread's own entries (written by itself in the last phase 2, the prologue or the reset).
    float* Sn = p.states + (bh * N + n) * K * V + v0;
    for (int k = rg; k < K; k += RG) Sn[static_cast<int64_t>(k) * V + j] = sS[k * VB + j];
    float u[kChunkRows];  // U_n[c_i, j]
#pragma unroll
    for (int i = 0; i < kChunkRows; ++i) {
      const int c = rg + RG * i;
      u[i] = c < C ? __ldg(p.u + uv_offset(n, c)) : 0.f;
    }
    cp_async_wait<0>();  // W_n, Kt_n and carry_n landed
    __syncthreads();     // ... for every thread; the last phase 2 (S, reads of buffer b ^ 1) is done
    if (step + 1 < N) load_kt_carry(chunk_at(step + 1), b ^ 1);  // lands during this whole chunk
    cp_async_commit();

    // 1: V_new = U_n - W_n S.
    float ws[kChunkRows] = {};
    rows_times_cols<VB>(ws, sW, lay.pk, C, sS, K, rg, j);
#pragma unroll
    for (int i = 0; i < kChunkRows; ++i) {
      const int c = rg + RG * i;
      if (c < C) {
        const float v = u[i] - ws[i];
        sVn[c * VB + j] = v;
        p.v_new[uv_offset(n, c)] = v;
      }
    }
    __syncthreads();  // V_new complete; nobody reads W_n any more
    if (step + 1 < N) copy_rows_async(sW, lay.pk, w_of(chunk_at(step + 1)), C, K);  // the next W: lands during 2
    cp_async_commit();

    // 2: S = carry_n * S + Kt_n V_new + Y_n, each thread on its own entries of S.
    const float* sKt = smem + lay.kt + b * lay.kt_size;
    const float* sCarry = smem + lay.carry + b * lay.carry_size;
    float kv[kStateRows];  // starts from Y_n[k_i, j], the addend
    const float* Yn = p.addend ? p.addend + (bh * N + n) * K * V + v0 : nullptr;
#pragma unroll
    for (int i = 0; i < kStateRows; ++i) {
      const int k = rg + RG * i;
      kv[i] = Yn && k < K ? __ldg(Yn + static_cast<int64_t>(k) * V + j) : 0.f;
    }
    rows_times_cols<VB>(kv, sKt, lay.pc, K, sVn, C, rg, j);
#pragma unroll
    for (int i = 0; i < kStateRows; ++i) {
      const int k = rg + RG * i;
      if (k < K) {
        const float d = p.per_channel_carry ? sCarry[k] : sCarry[0];
        sS[k * VB + j] = fmaf(d, sS[k * VB + j], kv[i]);
      }
    }
  }
  cp_async_wait<0>();  // nothing real is left in flight (the last chunk's prefetches are empty)

  // Each thread wrote its own entries of S: no barrier needed before it reads them back.
  float* S1 = p.final_state + bh * K * V + v0;
  for (int k = rg; k < K; k += RG) S1[static_cast<int64_t>(k) * V + j] = sS[k * VB + j];
}

bool dims_in_bounds(int K, int V, int C) {
  return K >= 4 && K <= kMaxScanHeadK && K % 4 == 0 && C >= 4 && C <= kMaxScanChunk && C % 4 == 0 && V >= 8 &&
         V % 8 == 0;
}

size_t max_shared_bytes(int device) {
  return static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device, "delta_rule_scan"));
}

}  // namespace

int delta_rule_scan_value_block(int batch, int heads, int head_k, int head_v, int chunk_size, int device) {
  if (!dims_in_bounds(head_k, head_v, chunk_size)) return 0;
  const size_t smem_limit = max_shared_bytes(device);
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, device, "delta_rule_scan");
  int vb = 0;
  for (int cand : {32, 16, 8}) {
    if (head_v % cand != 0 || scan_smem_bytes(head_k, chunk_size, cand) > smem_limit) continue;
    if (vb == 0) vb = cand;  // the widest that fits
    else if (static_cast<int64_t>(head_v / vb) * heads * batch < sms) vb = cand;  // narrower: more blocks
  }
  return vb;
}

bool delta_rule_scan_supported(int head_k, int head_v, int chunk_size, int device) {
  return delta_rule_scan_value_block(1, 1, head_k, head_v, chunk_size, device) != 0;
}

void delta_rule_scan(const DeltaRuleScanParams& p, void* stream) {
  const int K = p.head_k, V = p.head_v, C = p.chunk_size;
  LT2_CHECK(dims_in_bounds(K, V, C), "delta_rule_scan: needs K a multiple of 4 in [4, ", kMaxScanHeadK,
            "], C a multiple of 4 in [4, ", kMaxScanChunk, "] and V a multiple of 8, found K ", K, ", V ", V,
            ", C ", C);
  LT2_CHECK(p.batch >= 0 && p.heads >= 0 && p.chunks >= 0 && p.batch <= 65535 && p.heads <= 65535,
            "delta_rule_scan: batch ", p.batch, " and heads ", p.heads, " must be in [0, 65535], chunks ",
            p.chunks, " >= 0");
  if (p.batch == 0 || p.heads == 0) return;
  LT2_CHECK(p.final_state && (p.chunks == 0 || (p.w && p.u && p.kt && p.carry && p.states && p.v_new)),
            "delta_rule_scan: every pointer but initial_state must be given (only final_state without chunks)");
  LT2_CHECK(!p.resets || p.batch == 1, "delta_rule_scan: resets (packed documents) need batch 1, found ", p.batch);
  LT2_CHECK(aligned16(p.w) && aligned16(p.kt) && (!p.per_channel_carry || aligned16(p.carry)),
            "delta_rule_scan: w, kt (and a per-channel carry) must be 16-byte aligned");
  int device = 0;
  cudaGetDevice(&device);
  const int vb = p.value_block != 0 ? p.value_block
                                    : delta_rule_scan_value_block(p.batch, p.heads, K, V, C, device);
  LT2_CHECK(vb == 8 || vb == 16 || vb == 32, "delta_rule_scan: value_block must be 0, 8, 16 or 32, found ",
            p.value_block, vb == 0 ? " (no value block fits this device's shared memory)" : "");
  LT2_CHECK(V % vb == 0, "delta_rule_scan: value_block ", vb, " must divide V ", V);
  const size_t smem = scan_smem_bytes(K, C, vb);
  LT2_CHECK(smem <= max_shared_bytes(device), "delta_rule_scan: value_block ", vb, " at K ", K, ", C ", C, " needs ",
            smem, " bytes of shared memory, the device gives ", max_shared_bytes(device));
  const dim3 grid(V / vb, p.heads, p.batch);
  auto launch = [&](auto kernel) {
    kernel<<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  };
  switch (vb) {
    case 32:
      reserve_shared<delta_rule_scan_kernel<32>>(smem, "delta_rule_scan");
      launch(delta_rule_scan_kernel<32>);
      break;
    case 16:
      reserve_shared<delta_rule_scan_kernel<16>>(smem, "delta_rule_scan");
      launch(delta_rule_scan_kernel<16>);
      break;
    default:
      reserve_shared<delta_rule_scan_kernel<8>>(smem, "delta_rule_scan");
      launch(delta_rule_scan_kernel<8>);
      break;
  }
  check_launch("delta_rule_scan");
}

// ---------------------------------------------------------------------------------------------
// unit_lower_inverse. Floor: C^3 / 6 multiply-adds a matrix (44k at C 64), 2 C^2 floats of traffic
// (32 KiB); at the 8 x 4096 x 16-head training shape (8,192 matrices) 0.27 GB, ~0.1 ms. Column c
// of T solves T[i][c] = [i == c] - sum_{j < i} L[i][j] T[j][c] top-down: thread c walks the rows,
// reading L's row i as a broadcast (every lane the same element) and its own column from shared
// memory (lane-indexed: conflict-free); the j < c terms are zeros, so every lane runs the same loop.

namespace {

__global__ void unit_lower_inverse_kernel(const UnitLowerInverseParams p) {
  extern __shared__ float inverse_smem[];
  const int C = p.size, c = threadIdx.x;
  float* sL = inverse_smem;          // [C][C]
  float* col = inverse_smem + C * C;  // [C][blockDim.x]: col[i * blockDim.x + c] = T[i][c]
  const float* L = p.l + blockIdx.x * static_cast<int64_t>(C) * C;
  for (int e = c; e < C * C; e += blockDim.x) sL[e] = L[e];
  __syncthreads();
  if (c >= C) return;
  for (int i = 0; i < C; ++i) {
    float acc = i == c ? 1.f : 0.f;
    for (int j = 0; j < i; ++j) acc = fmaf(-sL[i * C + j], col[j * blockDim.x + c], acc);
    col[i * blockDim.x + c] = acc;
  }
  float* T = p.t + blockIdx.x * static_cast<int64_t>(C) * C;
  for (int i = 0; i < C; ++i) T[i * C + c] = col[i * blockDim.x + c];
}

}  // namespace

void unit_lower_inverse(const UnitLowerInverseParams& p, void* stream) {
  LT2_CHECK(p.size >= 1 && p.size <= kMaxScanChunk, "unit_lower_inverse: C must be in [1, ", kMaxScanChunk,
            "], found ", p.size);
  LT2_CHECK(p.count >= 0 && p.count <= INT32_MAX, "unit_lower_inverse: count ", p.count, " outside [0, 2^31)");
  if (p.count == 0) return;
  LT2_CHECK(p.l && p.t, "unit_lower_inverse: l and t must be given");
  const int threads = round_up(p.size, 32);
  const size_t smem = sizeof(float) * (static_cast<size_t>(p.size) * p.size + static_cast<size_t>(p.size) * threads);
  unit_lower_inverse_kernel<<<static_cast<unsigned>(p.count), threads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("unit_lower_inverse");
}

// ---------------------------------------------------------------------------------------------
// delta_rule_prepare and delta_rule_prepare_backward (prefill.h): the chunk preparation of the
// chunked delta rule with one decay per head or none, forward and backward, one block per chunk of
// one (sequence, head), C = 64.
//
// Floor, per chunk-head at the 1.3B GDN head (K 96, V 192). Forward: K K^T and Q K^T 2 C^2 K FMAs
// (0.79 M), the substitution for [U | W] C^2 (V + K) / 2 (0.59 M): 1.4 M FMAs; reads 2 C K + C V
// inputs (bf16: 48 KiB), writes C (2 K + V + C) + K C fp32 (139 KiB). Backward: T (C^3 / 6),
// M = dUW R^T and dR = T^T dUW (C^2 (V + K) and half of it), T^T M T^T (C^3), K K^T and Q K^T again,
// dQ and dK (4 C^2 K): ~4.3 M FMAs; reads the six gradients (~190 KiB) and the inputs, writes
// dq, dk, dv in fp32. At 8 x 4096 x 16 heads (8,192 chunk-heads): forward 11.5 G FMAs (0.35 ms at
// the 67 TFLOP/s fp32 peak) and 1.5 GB (0.3 ms); backward 35 G FMAs (1.05 ms) and ~2.3 GB (0.5 ms).
// Both are FMA-bound at the floor; the libtorch form they replace spends ~15 ms of elementwise
// passes and batched products on the same work (bench/notes/training.md).
//
// Design. Every [64, n] product of two shared-memory operands is `tile_product`: thread (ti, tj)
// of a 16 x 16 grid owns rows ti + 16 r (r < 4) and columns tj + 16 s, so a warp reads 16
// consecutive columns of the right operand (rows at odd pitches K + 1, 65 or 17: distinct banks)
// and two broadcast rows of the left one. T = (I + L)^{-1} is formed explicitly (one column per
// thread for 64 threads, its values in registers), so the UT transform is a product, T times the
// columns of [beta V | beta exp(G) K] streamed through shared memory in panels of 16 (v never
// staged whole: two blocks fit an SM), and the backward's dR = T^T dUW and dL = -T^T (dUW R^T) T^T
// are products too. Recomputed in the backward, not stored: L, T, K K^T and Q K^T (cheaper than
// reading them back: 4 C^2 floats a chunk-head against ~0.5 M FMAs). Plain fp32 FMAs, as the scan:
// the GPU tests' fp32 tolerance.

namespace {

constexpr int kPrepChunk = 64;      // C
constexpr int kPrepMaxK = 128;      // the [C, K + 1] tiles of q and k in shared memory
constexpr int kPrepThreads = 256;    // the 16 x 16 grid of tile_product
constexpr int kPrepPanel = 16;      // the backward's columns per panel; K and V multiples of it
constexpr int kMatPitch = kPrepChunk + 1;
constexpr int kPanelPitch = kPrepPanel + 1;

// acc[r][s] += sum_{x < n} A(ti + 16 r, x) B(x, tj + 16 s) over the columns tj + 16 s < cols, with
// A(i, x) = a[i * a_i + x * a_x] and B(x, j) = b[x * b_x + j * b_j] in shared memory (the strides
// let either operand be read transposed).
template <int S>
__device__ __forceinline__ void tile_product(float (&acc)[4][S], const float* a, int a_i, int a_x, const float* b,
                                             int b_x, int b_j, int n, int cols, int ti, int tj) {
  for (int x = 0; x < n; ++x) {
    float av[4], bv[S];
#pragma unroll
    for (int r = 0; r < 4; ++r) av[r] = a[(ti + 16 * r) * a_i + x * a_x];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int j = tj + 16 * s;
      bv[s] = j < cols ? b[x * b_x + j * b_j] : 0.f;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int s = 0; s < S; ++s) acc[r][s] = fmaf(av[r], bv[s], acc[r][s]);
  }
}

// Sum over the 16 lanes of a half-warp (the tj of one ti).
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o, 16);
  return x;
}

// The chunk's rows of q and k (fp32, rows pitch K + 1; zeros past the sequence), beta, and G the
// inclusive cumulative sum of g over the chunk (zeros without a gate). Ends with a barrier.
template <typename In>
__device__ void load_chunk(const DeltaRulePrepareParams& p, int b, int h, int t0, int rows, float* sQ, float* sK,
                           float* sB, float* sG) {
  const int K = p.head_k, H = p.heads, T = p.seq, P = K + 1;
  const In* q = static_cast<const In*>(p.q);
  const In* k = static_cast<const In*>(p.k);
  for (int e = threadIdx.x; e < kPrepChunk * K; e += blockDim.x) {
    const int i = e / K, d = e - i * K;
    const int64_t at = ((static_cast<int64_t>(b) * T + t0 + i) * H + h) * K + d;
    sQ[i * P + d] = i < rows ? to_float(q[at]) : 0.f;
    sK[i * P + d] = i < rows ? to_float(k[at]) : 0.f;
  }
  if (threadIdx.x < kPrepChunk) {
    const int i = threadIdx.x;
    const int64_t at = (static_cast<int64_t>(b) * T + t0 + i) * H + h;
    sB[i] = i < rows ? p.beta[at] : 0.f;
    sG[i] = i < rows && p.g ? p.g[at] : 0.f;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // one warp, two rows a lane
    const int l = threadIdx.x;
    const float a = sG[2 * l], pair = a + sG[2 * l + 1];
    float incl = pair;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (l >= o) incl += y;
    }
    sG[2 * l] = incl - pair + a;
    sG[2 * l + 1] = incl;
  }
  __syncthreads();
}

// T = (I + L)^{-1} for L strictly lower in sL (row pitch kMatPitch), into sT: column c by thread
// c < C, forward substitution on the identity's column in registers, L's column read as broadcasts.
__device__ __forceinline__ void unit_lower_inverse_block(const float* sL, float* sT) {
  constexpr int C = kPrepChunk;
  if (threadIdx.x >= C) return;
  const int c = threadIdx.x;
  float t[C];
#pragma unroll
  for (int i = 0; i < C; ++i) t[i] = i == c ? 1.f : 0.f;
#pragma unroll
  for (int j = 0; j < C - 1; ++j) {
    const float tj = t[j];
#pragma unroll
    for (int i = j + 1; i < C; ++i) t[i] = fmaf(-sL[i * kMatPitch + j], tj, t[i]);
  }
#pragma unroll
  for (int i = 0; i < C; ++i) sT[i * kMatPitch + c] = t[i];
}

// Columns c0 .. c0 + kPrepPanel - 1 of the chunk's [V | K] rows into sP (row pitch kPanelPitch):
// v (zeros past the sequence) times value_scale[i], or k (from sK) times key_scale[i] (nullptr: 1).
// K and V are multiples of the panel, so a panel is all values or all keys.
template <typename In>
__device__ __forceinline__ void load_panel(const DeltaRulePrepareParams& p, int b, int h, int t0, int rows, int c0,
                                           const float* sK, const float* value_scale, const float* key_scale,
                                           float* sP) {
  const int K = p.head_k, V = p.head_v, P = K + 1;
  const In* v = static_cast<const In*>(p.v);
  for (int e = threadIdx.x; e < kPrepChunk * kPrepPanel; e += blockDim.x) {
    const int i = e / kPrepPanel, c = e - i * kPrepPanel, col = c0 + c;
    float x;
    if (col < V) {
      x = i < rows ? to_float(v[((static_cast<int64_t>(b) * p.seq + t0 + i) * p.heads + h) * V + col]) : 0.f;
      if (value_scale) x *= value_scale[i];
    } else {
      x = sK[i * P + col - V];
      if (key_scale) x *= key_scale[i];
    }
    sP[i * kPanelPitch + c] = x;
  }
}

struct PrepareShared {  // offsets in floats
  int q, k, l, t, panel, g, beta, f, total;
};
__host__ __device__ inline PrepareShared prepare_shared(int K) {
  const int tile = kPrepChunk * (K + 1), mat = kPrepChunk * kMatPitch;
  PrepareShared s{};
  s.q = 0;
  s.k = s.q + tile;
  s.l = s.k + tile;
  s.t = s.l + mat;
  s.panel = s.t + mat;
  s.g = s.panel + kPrepChunk * kPanelPitch;
  s.beta = s.g + kPrepChunk;
  s.f = s.beta + kPrepChunk;
  s.total = s.f + kPrepChunk;
  return s;
}

template <typename In>
__global__ void __launch_bounds__(kPrepThreads, 2) delta_rule_prepare_kernel(const DeltaRulePrepareParams p) {
  constexpr int C = kPrepChunk;
  const int K = p.head_k, V = p.head_v, T = p.seq, H = p.heads, P = K + 1;
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = n * C, rows = min(C, T - t0);
  const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
  const PrepareShared lay = prepare_shared(K);
  extern __shared__ __align__(16) float prep_smem[];
  float *sQ = prep_smem + lay.q, *sK = prep_smem + lay.k, *sL = prep_smem + lay.l, *sT = prep_smem + lay.t;
  float *sP = prep_smem + lay.panel, *sG = prep_smem + lay.g, *sB = prep_smem + lay.beta, *sF = prep_smem + lay.f;
  load_chunk<In>(p, b, h, t0, rows, sQ, sK, sB, sG);
  if (tid < C) sF[tid] = sB[tid] * __expf(sG[tid]);
  const int64_t chunk = (static_cast<int64_t>(b) * H + h) * gridDim.x + n;

  // A_qk (global) and L (shared) from K K^T and Q K^T.
  {
    float kk[4][4] = {}, qk[4][4] = {};
    tile_product(kk, sK, P, 1, sK, 1, P, K, C, ti, tj);
    tile_product(qk, sQ, P, 1, sK, 1, P, K, C, ti, tj);
    float* A = p.a_qk + chunk * C * C;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int i = ti + 16 * r, j = tj + 16 * s;
        const float decay = j <= i ? __expf(sG[i] - sG[j]) : 0.f;
        A[i * C + j] = p.scale * qk[r][s] * decay;
        sL[i * kMatPitch + j] = j < i ? sB[i] * kk[r][s] * decay : 0.f;
      }
  }
  // Q_start, Kt and carry.
  const float g_last = sG[C - 1];
  float* Qs = p.q_start + chunk * C * K;
  for (int e = tid; e < C * K; e += blockDim.x) {
    const int i = e / K, d = e - i * K;
    Qs[e] = sQ[i * P + d] * __expf(sG[i]) * p.scale;
  }
  float* Kt = p.kt + chunk * K * C;
  for (int e = tid; e < K * C; e += blockDim.x) {
    const int d = e / C, i = e - d * C;
    Kt[e] = sK[i * P + d] * __expf(g_last - sG[i]);
  }
  if (tid == 0) p.carry[chunk] = __expf(g_last);
  __syncthreads();
  unit_lower_inverse_block(sL, sT);

  // [U | W] = T [beta V | beta exp(G) K], a panel of columns at a time; thread (ti, tj) the rows
  // ti + 16 r of column tj.
  for (int c0 = 0; c0 < V + K; c0 += kPrepPanel) {
    __syncthreads();  // T is complete; the panel before is consumed
    load_panel<In>(p, b, h, t0, rows, c0, sK, sB, sF, sP);
    __syncthreads();
    float acc[4] = {};
    for (int j = 0; j < C; ++j) {
      const float x = sP[j * kPanelPitch + tj];
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[r] = fmaf(sT[(ti + 16 * r) * kMatPitch + j], x, acc[r]);
    }
    const int col = c0 + tj;
    float* out = col < V ? p.u + chunk * C * V + col : p.w + chunk * C * K + (col - V);
    const int pitch = col < V ? V : K;
#pragma unroll
    for (int r = 0; r < 4; ++r) out[(ti + 16 * r) * pitch] = acc[r];
  }
}

struct PrepareBackwardShared {  // offsets in floats
  int q, k, t, m, x, dp, rp, g, beta, exp_g, db, dg, total;
};
__host__ __device__ inline PrepareBackwardShared prepare_backward_shared(int K) {
  const int tile = kPrepChunk * (K + 1), mat = kPrepChunk * kMatPitch, panel = kPrepChunk * kPanelPitch;
  PrepareBackwardShared s{};
  s.q = 0;
  s.k = s.q + tile;
  s.t = s.k + tile;
  s.m = s.t + mat;
  s.x = s.m + mat;
  s.dp = s.x + mat;
  s.rp = s.dp + panel;
  s.g = s.rp + panel;
  s.beta = s.g + kPrepChunk;
  s.exp_g = s.beta + kPrepChunk;
  s.db = s.exp_g + kPrepChunk;
  s.dg = s.db + kPrepChunk;
  s.total = s.dg + kPrepChunk;
  return s;
}

// The backward (prefill.h). Phases: 1 L (shared) and (K K^T) * decay (registers); 2 T; 3 the
// panels of [dU | dW]: M = dUW R^T, dR = T^T dUW and what dR gives dv, dk (partial), dbeta, dG;
// 4 dL = -StrictTril(T^T M T^T), then what dL and dA_qk give dbeta and dG, with dS = beta dL decay
// and P = scale dA_qk decay kept for 5 dQ = P K + ..., dK = (dS + dS^T) K + P^T Q + ...; 6 dg from dG.
template <typename In>
__global__ void __launch_bounds__(kPrepThreads, 2)
    delta_rule_prepare_backward_kernel(const DeltaRulePrepareBackwardParams bp) {
  constexpr int C = kPrepChunk, S = kPrepMaxK / 16;
  const DeltaRulePrepareParams& p = bp.forward;
  const int K = p.head_k, V = p.head_v, T = p.seq, H = p.heads, P = K + 1;
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = n * C, rows = min(C, T - t0);
  const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
  const PrepareBackwardShared lay = prepare_backward_shared(K);
  extern __shared__ __align__(16) float prep_bwd_smem[];
  float* const base = prep_bwd_smem;
  float *sQ = base + lay.q, *sK = base + lay.k, *sT = base + lay.t, *sM = base + lay.m, *sX = base + lay.x;
  float *sDP = base + lay.dp, *sRP = base + lay.rp, *sG = base + lay.g, *sB = base + lay.beta;
  float *sEG = base + lay.exp_g, *sDB = base + lay.db, *sDG = base + lay.dg;
  if (tid < C) sDB[tid] = sDG[tid] = 0.f;
  load_chunk<In>(p, b, h, t0, rows, sQ, sK, sB, sG);
  if (tid < C) sEG[tid] = __expf(sG[tid]);
  const int64_t chunk = (static_cast<int64_t>(b) * H + h) * gridDim.x + n;
  auto token = [&](int i) { return (static_cast<int64_t>(b) * T + t0 + i) * H + h; };
  auto decay = [&](int i, int j) { return __expf(sG[i] - sG[j]); };

  // 1: kke = (K K^T) * decay below the diagonal (zeros elsewhere); L = beta_i kke into sX.
  float kke[4][4] = {};
  tile_product(kke, sK, P, 1, sK, 1, P, K, C, ti, tj);
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int i = ti + 16 * r, j = tj + 16 * s;
      kke[r][s] = j < i ? kke[r][s] * decay(i, j) : 0.f;
      sX[i * kMatPitch + j] = sB[i] * kke[r][s];
    }
  __syncthreads();

  // 2: T = (I + L)^{-1}.
  unit_lower_inverse_block(sX, sT);
  __syncthreads();

  // 3: the columns of [dU | dW] and of the raw [V | K] in panels.
  const float* du = bp.du + chunk * C * V;
  const float* dw = bp.dw + chunk * C * K;
  float mv[4][4] = {}, mk[4][4] = {};  // sum_c dU_i[c] v_j[c] and sum_c dW_i[c] k_j[c]
  float row_db[4] = {}, row_w[4] = {};  // sum_c dR_V[i][c] v_i[c] and sum_c dR_W[i][c] k_i[c]
  for (int c0 = 0; c0 < V + K; c0 += kPrepPanel) {
    const bool value_panel = c0 < V;
    load_panel<In>(p, b, h, t0, rows, c0, sK, nullptr, nullptr, sRP);
    for (int e = tid; e < C * kPrepPanel; e += blockDim.x) {
      const int i = e / kPrepPanel, c = e - i * kPrepPanel, col = c0 + c;
      sDP[i * kPanelPitch + c] = value_panel ? du[i * V + col] : dw[i * K + col - V];
    }
    __syncthreads();
    if (value_panel) tile_product(mv, sDP, kPanelPitch, 1, sRP, 1, kPanelPitch, kPrepPanel, C, ti, tj);
    else tile_product(mk, sDP, kPanelPitch, 1, sRP, 1, kPanelPitch, kPrepPanel, C, ti, tj);
    float dr[4] = {};  // dR[i][c0 + tj] = sum_{j >= i} T[j][i] dUW[j][c0 + tj]
    for (int j = 0; j < C; ++j) {
      const float d = sDP[j * kPanelPitch + tj];
#pragma unroll
      for (int r = 0; r < 4; ++r) dr[r] = fmaf(sT[j * kMatPitch + ti + 16 * r], d, dr[r]);
    }
    const int col = c0 + tj;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = ti + 16 * r;
      const float x = sRP[i * kPanelPitch + tj];
      if (value_panel) {
        if (i < rows) bp.dv[token(i) * V + col] = sB[i] * dr[r];
        row_db[r] = fmaf(dr[r], x, row_db[r]);
      } else {
        if (i < rows) bp.dk[token(i) * K + col - V] = sB[i] * sEG[i] * dr[r];
        row_w[r] = fmaf(dr[r], x, row_w[r]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = ti + 16 * r;
    const float db = half_warp_sum(row_db[r]), w = half_warp_sum(row_w[r]);
    if (tj == 0) {
      sDB[i] += db + sEG[i] * w;
      sDG[i] += sB[i] * sEG[i] * w;
    }
  }

  // 4: M = dUW R^T into sM, X = T^T M into sX, dL = -(X T^T) below the diagonal.
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int i = ti + 16 * r, j = tj + 16 * s;
      sM[i * kMatPitch + j] = sB[j] * (mv[r][s] + sEG[j] * mk[r][s]);
    }
  __syncthreads();
  {
    float x[4][4] = {};
    tile_product(x, sT, 1, kMatPitch, sM, kMatPitch, 1, C, C, ti, tj);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int s = 0; s < 4; ++s) sX[(ti + 16 * r) * kMatPitch + tj + 16 * s] = x[r][s];
  }
  __syncthreads();
  float ds[4][4] = {}, pq[4][4] = {}, qk[4][4] = {};
  tile_product(ds, sX, kMatPitch, 1, sT, 1, kMatPitch, C, C, ti, tj);  // X T^T
  tile_product(qk, sQ, P, 1, sK, 1, P, K, C, ti, tj);
  const float* dA = bp.da_qk + chunk * C * C;
  float row_g[4] = {}, row_b[4] = {}, col_g[4] = {};
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int i = ti + 16 * r, j = tj + 16 * s;
      const float e = j <= i ? decay(i, j) : 0.f;
      const float dl = j < i ? -ds[r][s] : 0.f;
      const float da = j <= i ? dA[i * C + j] : 0.f;
      const float w = dl * sB[i] * kke[r][s] + da * p.scale * qk[r][s] * e;  // dL L + dA A
      row_b[r] = fmaf(dl, kke[r][s], row_b[r]);
      row_g[r] += w;
      col_g[s] -= w;
      ds[r][s] = sB[i] * dl * e;
      pq[r][s] = p.scale * da * e;
    }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = ti + 16 * r;
    const float g = half_warp_sum(row_g[r]), db = half_warp_sum(row_b[r]);
    if (tj == 0) {
      atomicAdd(sDG + i, g);
      atomicAdd(sDB + i, db);
    }
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) atomicAdd(sDG + tj + 16 * s, col_g[s]);
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int at = (ti + 16 * r) * kMatPitch + tj + 16 * s;
      sX[at] = ds[r][s];
      sM[at] = pq[r][s];
    }
  __syncthreads();

  // 5: dQ = P K + scale exp(G) dQ_start; dK = (dS + dS^T) K + P^T Q + dKt^T exp(G_l - G) + the
  // partial from phase 3; and the row terms of dG they carry.
  {
    float dq[4][S] = {}, dk[4][S] = {};
    tile_product(dq, sM, kMatPitch, 1, sK, P, 1, C, K, ti, tj);
    tile_product(dk, sX, kMatPitch, 1, sK, P, 1, C, K, ti, tj);
    tile_product(dk, sX, 1, kMatPitch, sK, P, 1, C, K, ti, tj);
    tile_product(dk, sM, 1, kMatPitch, sQ, P, 1, C, K, ti, tj);
    const float* dQs = bp.dq_start + chunk * C * K;
    const float* dKt = bp.dkt + chunk * K * C;
    const float g_last = sG[C - 1];
    float row_q[4] = {}, row_z[4] = {};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = ti + 16 * r;
      const float to_last = __expf(g_last - sG[i]);
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int c = tj + 16 * s;
        if (c >= K) continue;
        const float dqs = dQs[i * K + c], dkt = dKt[c * C + i], q = sQ[i * P + c], k = sK[i * P + c];
        row_q[r] = fmaf(dqs, q, row_q[r]);
        row_z[r] = fmaf(dkt * to_last, k, row_z[r]);
        if (i < rows) {
          bp.dq[token(i) * K + c] = dq[r][s] + p.scale * sEG[i] * dqs;
          float* dk_out = bp.dk + token(i) * K + c;
          *dk_out += dk[r][s] + dkt * to_last;
        }
      }
    }
    float last = 0.f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = ti + 16 * r;
      const float q = half_warp_sum(row_q[r]), z = half_warp_sum(row_z[r]);
      last += z;
      if (tj == 0) atomicAdd(sDG + i, p.scale * sEG[i] * q - z);
    }
    if (tj == 0) atomicAdd(sDG + C - 1, last);
    if (tid == 0) atomicAdd(sDG + C - 1, bp.dcarry[chunk] * __expf(g_last));
  }
  __syncthreads();

  // 6: dbeta, and dg_i = sum_{s >= i} dG_s (G is g's inclusive cumulative sum over the chunk).
  if (tid < C && tid < rows) {
    bp.dbeta[token(tid)] = sDB[tid];
    if (bp.dg) {
      float sum = 0.f;
      for (int s = tid; s < C; ++s) sum += sDG[s];
      bp.dg[token(tid)] = sum;
    }
  }
}

bool prepare_dims_in_bounds(int K, int V, int C) {
  return C == kPrepChunk && K >= kPrepPanel && K <= kPrepMaxK && K % kPrepPanel == 0 && V >= kPrepPanel &&
         V % kPrepPanel == 0;
}

void check_prepare(const DeltaRulePrepareParams& p, const char* op) {
  LT2_CHECK(prepare_dims_in_bounds(p.head_k, p.head_v, p.chunk_size), op, ": needs C ", kPrepChunk,
            ", K and V multiples of ", kPrepPanel, " with K <= ", kPrepMaxK, ", found K ", p.head_k, ", V ",
            p.head_v, ", C ", p.chunk_size);
  LT2_CHECK(p.batch >= 0 && p.heads >= 0 && p.seq >= 0 && p.batch <= 65535 && p.heads <= 65535, op, ": batch ",
            p.batch, " and heads ", p.heads, " must be in [0, 65535], seq ", p.seq, " >= 0");
  LT2_CHECK(p.dtype == DType::Float32 || p.dtype == DType::BFloat16, op, ": q, k and v must be fp32 or bf16");
}

}  // namespace

bool delta_rule_prepare_supported(int head_k, int head_v, int chunk_size, int device) {
  return prepare_dims_in_bounds(head_k, head_v, chunk_size) &&
         sizeof(float) * static_cast<size_t>(prepare_backward_shared(head_k).total) <= max_shared_bytes(device);
}

void delta_rule_prepare(const DeltaRulePrepareParams& p, void* stream) {
  check_prepare(p, "delta_rule_prepare");
  const int chunks = ceil_div(p.seq, kPrepChunk);
  if (p.batch == 0 || p.heads == 0 || chunks == 0) return;
  LT2_CHECK(p.q && p.k && p.v && p.beta && p.w && p.u && p.kt && p.carry && p.q_start && p.a_qk,
            "delta_rule_prepare: every pointer but g must be given");
  const size_t smem = sizeof(float) * prepare_shared(p.head_k).total;
  const dim3 grid(chunks, p.heads, p.batch);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::BFloat16) {
    reserve_shared<delta_rule_prepare_kernel<__nv_bfloat16>>(smem, "delta_rule_prepare");
    delta_rule_prepare_kernel<__nv_bfloat16><<<grid, kPrepThreads, smem, s>>>(p);
  } else {
    reserve_shared<delta_rule_prepare_kernel<float>>(smem, "delta_rule_prepare");
    delta_rule_prepare_kernel<float><<<grid, kPrepThreads, smem, s>>>(p);
  }
  check_launch("delta_rule_prepare");
}

void delta_rule_prepare_backward(const DeltaRulePrepareBackwardParams& bp, void* stream) {
  const DeltaRulePrepareParams& p = bp.forward;
  check_prepare(p, "delta_rule_prepare_backward");
  const int chunks = ceil_div(p.seq, kPrepChunk);
  if (p.batch == 0 || p.heads == 0 || chunks == 0) return;
  LT2_CHECK(p.q && p.k && p.v && p.beta && bp.dw && bp.du && bp.dkt && bp.dcarry && bp.dq_start && bp.da_qk &&
                bp.dq && bp.dk && bp.dv && bp.dbeta && (bp.dg != nullptr) == (p.g != nullptr),
            "delta_rule_prepare_backward: every pointer must be given (dg exactly when g is)");
  int device = 0;
  cudaGetDevice(&device);
  const size_t smem = sizeof(float) * prepare_backward_shared(p.head_k).total;
  LT2_CHECK(smem <= max_shared_bytes(device), "delta_rule_prepare_backward: K ", p.head_k, " needs ", smem,
            " bytes of shared memory, the device gives ", max_shared_bytes(device));
  const dim3 grid(chunks, p.heads, p.batch);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::BFloat16) {
    reserve_shared<delta_rule_prepare_backward_kernel<__nv_bfloat16>>(smem, "delta_rule_prepare_backward");
    delta_rule_prepare_backward_kernel<__nv_bfloat16><<<grid, kPrepThreads, smem, s>>>(bp);
  } else {
    reserve_shared<delta_rule_prepare_backward_kernel<float>>(smem, "delta_rule_prepare_backward");
    delta_rule_prepare_backward_kernel<float><<<grid, kPrepThreads, smem, s>>>(bp);
  }
  check_launch("delta_rule_prepare_backward");
}

}  // namespace lt2::kernels
