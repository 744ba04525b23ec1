// The inter-chunk scan of the chunked delta rule (prefill.h: delta_rule_scan), one launch for all
// chunks of all (sequence, head) pairs, replacing ops::delta_rule_chunked's host loop of ~8
// libtorch kernels per chunk.
//
// Floor. The value columns of S [K, V] evolve independently, so a block owns S[:, v0 : v0 + VB]
// of one (sequence, head) in shared memory for the whole scan. Per chunk and block it reads
// Q_n, W_n [C, K], Kt_n [K, C], A_n [C, C], U_n[:, slice] [C, VB] and carry_n [1 or K] and
// writes O_n[:, slice] [C, VB]; it does (3 C K + C^2) VB FMAs. At the 1.3B GDN head (K 96, V 192,
// C 64, VB 32): 97 KiB read (mostly L2 hits: the V / VB blocks of a head read the same matrices),
// 8 KiB written, 721k FMAs (1.44 MFLOP, ~15 FLOP per byte read). For a whole chunk of B 1, H 16:
// 138 MFLOP, ~2 us at the H200's ~67 TFLOP/s fp32 (non-tensor) peak, against ~3 MB of HBM traffic
// (0.6 us): compute bound, ~1 ms for the 512 chunks of a 32k-token call. The loop it replaces
// runs 8 launch-bound kernels per chunk (3-5 us each, S [B, H, K, V] through HBM each time):
// ~30 us per chunk, ~15 ms per call.
//
// Design.
// - Grid (V / VB, H, B), 256 threads. Thread t owns value column j = t % VB of the slice and the
//   rows rg + RG i (rg = t / VB, RG = 256 / VB row groups) of every [rows, VB] product, so each
//   phase is one primitive, rows_times_cols: acc[i] += sum_x L[row_i][x] R[x][j], the left matrix
//   read as 16-byte broadcasts (one row, or 32 / VB consecutive rows, per warp), the right one
//   ([x][VB] rows, S or V_new) as one conflict-free word per lane. Plain fp32 FMAs: TF32 tensor
//   cores would not hold the 1e-5 fp32 tolerance (DESIGN.md invariant 5).
// - Per chunk: 1a P = Q_n S (registers); 1b V_new = U_n - W_n S (shared); 2 O_n = P + A_n V_new
//   (straight to global); 3 S = carry_n * S + Kt_n V_new (each thread updates its own entries).
// - The chunk's matrices stream in with cp.async into single buffers that rotate, so every load
//   overlaps another phase and K 256 with C 64 still fits (W_n and Kt_n share one buffer):
//     W_n      issued at the chunk start             lands during 1a
//     Kt_n     issued after 1b (W_n done)            lands during 2
//     Q_n+1    issued after 1b (Q_n done)            lands during 2, 3
//     A_n+1    issued after 2 (A_n done)             lands during 3 and the next 1a
//   U_n is read into registers at the chunk start and consumed at the end of 1b. Four barriers
//   per chunk. Shared memory: 88 KiB at the 1.3B head with VB 32 (two blocks per SM; the launch
//   bounds cap registers at 128 for that), 191 KiB at K 256, C 64, VB 32.
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

// cp.async: 4- and 16-byte global -> shared copies, committed in groups, waited for in order.
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `Pending` of this thread's committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}
// end of the cp.async helpers

__host__ __device__ constexpr int round_up(int a, int b) { return (a + b - 1) / b * b; }

// Shared-memory row pitch (floats) of a left matrix with `cols` columns: see the header comment.
__host__ __device__ constexpr int broadcast_pitch(int cols) { return round_up(cols, 8) + 4; }

// The block's shared memory, offsets in floats (all multiples of 4: 16-byte aligned).
struct ScanLayout {
  int pk, pc;  // row pitches of the [., K] and [., C] left matrices
  int s;       // S slice       [K, VB]
  int vn;      // V_new slice   [C, VB]
  int b0;      // W_n [C, pk], then Kt_n [K, pc]
  int q;       // Q_n [C, pk]
  int a;       // A_n [C, pc]
  int carry;   // carry_n [K] (or [1])
  int total;
};
__host__ __device__ inline ScanLayout scan_layout(int K, int C, int VB) {
  ScanLayout l{};
  l.pk = broadcast_pitch(K);
  l.pc = broadcast_pitch(C);
  l.s = 0;
  l.vn = l.s + K * VB;
  l.b0 = l.vn + C * VB;
  const int b0_size = C * l.pk > K * l.pc ? C * l.pk : K * l.pc;
  l.q = l.b0 + b0_size;
  l.a = l.q + C * l.pk;
  l.carry = l.a + C * l.pc;
  l.total = l.carry + round_up(K, 4);
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
  float* sB0 = smem + lay.b0;
  float* sQ = smem + lay.q;
  float* sA = smem + lay.a;
  float* sCarry = smem + lay.carry;

  // Chunk n of (sequence, head) bh: the first element of each per-chunk matrix.
  auto q_of = [&](int n) { return p.q + ((bh * N + n) * C) * K; };
  auto w_of = [&](int n) { return p.w + ((bh * N + n) * C) * K; };
  auto kt_of = [&](int n) { return p.kt + ((bh * N + n) * K) * C; };
  auto a_of = [&](int n) { return p.a + ((bh * N + n) * C) * C; };
  auto uo_offset = [&](int n, int c) { return ((bh * N + n) * C + c) * V + v0 + j; };  // u, o
  const int carry_dim = p.per_channel_carry ? K : 1;

  // Prologue: Q_0 and A_0 in flight (the loop's state at a chunk start), S from the initial state.
  if (N > 0) copy_rows_async(sQ, lay.pk, q_of(0), C, K);
  cp_async_commit();
  if (N > 0) copy_rows_async(sA, lay.pc, a_of(0), C, C);
  cp_async_commit();
  const float* S0 = p.initial_state ? p.initial_state + bh * K * V + v0 : nullptr;
  for (int k = rg; k < K; k += RG) sS[k * VB + j] = S0 ? S0[static_cast<int64_t>(k) * V + j] : 0.f;

  for (int n = 0; n < N; ++n) {
    cp_async_wait<1>();  // Q_n landed (A_n may still be in flight)
    __syncthreads();     // ... for every thread; the previous chunk's S update and Kt reads are done
    copy_rows_async(sB0, lay.pk, w_of(n), C, K);  // W_n: lands during 1a
    cp_async_commit();
    float u[kChunkRows];  // U_n[c_i, j], consumed at the end of 1b
#pragma unroll
    for (int i = 0; i < kChunkRows; ++i) {
      const int c = rg + RG * i;
      u[i] = c < C ? __ldg(p.u + uo_offset(n, c)) : 0.f;
    }

    // 1a: P = Q_n S.
    float o[kChunkRows] = {};
    rows_times_cols<VB>(o, sQ, lay.pk, C, sS, K, rg, j);
    cp_async_wait<0>();  // W_n and A_n landed
    __syncthreads();

    // 1b: V_new = U_n - W_n S.
    float ws[kChunkRows] = {};
    rows_times_cols<VB>(ws, sB0, lay.pk, C, sS, K, rg, j);
#pragma unroll
    for (int i = 0; i < kChunkRows; ++i) {
      const int c = rg + RG * i;
      if (c < C) sVn[c * VB + j] = u[i] - ws[i];
    }
    __syncthreads();  // V_new complete; nobody reads W_n or Q_n any more
    copy_rows_async(sB0, lay.pc, kt_of(n), K, C);  // Kt_n and carry_n: land during 2
    const float* carry = p.carry + (bh * N + n) * carry_dim;
    if (p.per_channel_carry) copy_rows_async(sCarry, 0, carry, 1, K);
    else if (threadIdx.x == 0) cp_async4(sCarry, carry);
    cp_async_commit();
    if (n + 1 < N) copy_rows_async(sQ, lay.pk, q_of(n + 1), C, K);  // Q_n+1: lands during 2, 3
    cp_async_commit();

    // 2: O_n = P + A_n V_new.
    rows_times_cols<VB>(o, sA, lay.pc, C, sVn, C, rg, j);
#pragma unroll
    for (int i = 0; i < kChunkRows; ++i) {
      const int c = rg + RG * i;
      if (c < C) p.o[uo_offset(n, c)] = o[i];
    }
    cp_async_wait<1>();  // Kt_n and carry_n landed (Q_n+1 may still be in flight)
    __syncthreads();     // ... for every thread; nobody reads A_n any more
    if (n + 1 < N) copy_rows_async(sA, lay.pc, a_of(n + 1), C, C);  // A_n+1: lands during 3, 1a
    cp_async_commit();

    // 3: S = carry_n * S + Kt_n V_new, each thread on its own entries of S.
    float kv[kStateRows] = {};
    rows_times_cols<VB>(kv, sB0, lay.pc, K, sVn, C, rg, j);
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
  LT2_CHECK(p.final_state && (p.chunks == 0 || (p.q && p.w && p.u && p.a && p.kt && p.carry && p.o)),
            "delta_rule_scan: every pointer but initial_state must be given (only final_state without chunks)");
  LT2_CHECK(aligned16(p.q) && aligned16(p.w) && aligned16(p.a) && aligned16(p.kt) &&
                (!p.per_channel_carry || aligned16(p.carry)),
            "delta_rule_scan: q, w, a, kt (and a per-channel carry) must be 16-byte aligned");
  int device = 0;
  cudaGetDevice(&device);
  const int vb = p.value_block != 0 ? p.value_block
                                    : delta_rule_scan_value_block(p.batch, p.heads, K, V, C, device);
  LT2_CHECK(vb == 8 || vb == 16 || vb == 32, "delta_rule_scan: value_block must be 0, 8, 16 or 32, found ",
            p.value_block, vb == 0 ? " (no value block fits this device's shared memory)" : "");
  LT2_CHECK(V % vb == 0, "delta_rule_scan: value_block ", vb, " must divide V ", V);
  const size_t smem = scan_smem_bytes(K, C, vb);
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

}  // namespace lt2::kernels
