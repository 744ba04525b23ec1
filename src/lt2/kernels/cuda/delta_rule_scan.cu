// The chunked delta rule's kernels (prefill.h): the UT transform's triangular inverse, and the
// inter-chunk scan (delta_rule_scan), one launch for all
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

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

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

}  // namespace lt2::kernels
