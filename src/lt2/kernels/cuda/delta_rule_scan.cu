// The chunked delta rule's kernels (prefill.h): the chunk preparation (delta_rule_prepare), the
// UT transform's triangular inverse, the inter-chunk scan (delta_rule_scan) and the chunk outputs
// (delta_rule_output), each one launch for all chunks of all (sequence, head) pairs, where
// ops::delta_rule_chunked would otherwise loop on the host over ~8 libtorch kernels per chunk. The
// forward pass runs the scan in chunk order, the backward pass (the adjoint recurrence of the state
// gradients) in reverse order with an addend.
//
// Floor. The value columns of S [K, V] evolve independently, so a block owns S[:, v0 : v0 + VB]
// of one (sequence, head) for the whole scan. Per chunk and block it reads W_n [C, K], Kt_n [K, C],
// U_n[:, slice] [C, VB] and carry_n [1 or K], writes S_n and V_new (the slices) and does 2 C K VB
// multiply-adds: at the 1.3B GDN head (K 96, V 192, C 64, VB 16) 49 KiB read (mostly L2 hits: the
// V / VB blocks of a head read the same matrices), 10 KiB written, 197k multiply-adds. The chunks
// of a block are sequential, and a B 1 prefill has only ~1.5 blocks an SM, so the scan is bound by
// each chunk's chain of dependent instructions, not by the device's FLOPs or bytes: every
// instruction in a chunk's loop costs latency (bench/notes/prefill.md has the Nsight Compute
// counts). Hence tensor cores for the products, operand splits by bit operations, copies placed
// once, and loops that stop at a warp's own tile count.
// The outputs O_n = Q_n S_n + A_n V_new, which do not feed the recurrence, stay out of the loop
// (delta_rule_output computes them for all chunks at once): inside it they would lengthen each chain.
//
// Design.
// - Grid (V / VB, H, B), 8 warps. Both products run on tensor cores as 3xTF32 mma.sync m16n8k8:
//   each operand x = big + small (split_tf32: bit operations, no conversion instruction) and
//   A B ~ A_big B_big + A_big B_small + A_small B_big, which keeps fp32's accuracy (the dropped
//   term is 2^-22 of the product) where one TF32 product would lose 2^-11 and fail the 1e-5 fp32
//   tolerance of the GPU tests; the corrections go to a second accumulator, so each product's
//   dependent chain is as long as one TF32 product's. With `tf32` (the caller runs its fp32 matmuls
//   on TF32: training and the engine under bf16) one TF32 product of rounded operands instead, a
//   third of the mma and none of the splits, at cuBLAS-under-TF32's precision.
// - Warp w owns the n-tile (8 value columns) w % (VB / 8) and every (8 / (VB / 8))-th m-tile
//   (16 rows) from w / (VB / 8): in phase 1 of V_new's [C, VB], in phase 2 of S's [K, VB]. Its S
//   tiles stay in registers (mma accumulator fragments) for the whole scan.
// - Per chunk: store S_n (registers to global) and S to shared memory (phase 1's B operand);
//   1 V_new = U_n - W_n S, to shared memory (phase 2's B operand) and global; 2 S = carry_n * S +
//   Y_n + Kt_n V_new in registers. Two barriers.
// - The chunk's matrices stream in with cp.async, each thread's pieces placed once per kernel
//   (plan_row_copy): the next chunk's Kt and carry (two buffers, taking turns) are issued as chunk n
//   starts and have the whole chunk to land; the next W is issued once phase 1 is done with W_n and
//   lands during phase 2. U and Y go to registers a phase ahead of their use: U_{n+1} once phase 1
//   is done with U_n (in flight during phase 2), Y_n at the chunk start (during phase 1). The A operands
//   (W, Kt) load as ldmatrix.x4 (an 8 x 8 b16 matrix is 8 rows of 4 fp32: lane 4 g + t gets row g's
//   float t, the m16n8k8 TF32 A fragment). Shared memory is zeroed first, so K and C pad to
//   multiples of 16 with zeros the copies never overwrite. At the 1.3B head with VB 16: 94 KiB (two
//   blocks an SM); K 256 with C 64 fits with VB 8 (218 KiB).
// - A operands' rows sit round_up(cols, 16) + 4 floats apart (4 or 20 mod 32): ldmatrix's 8 rows
//   and the fragments' 8 rows g fall in distinct banks. B operands ([rows, VB]: S, V_new) read
//   B[t][g] across a warp: rows 8 or 24 mod 32 floats apart make those 32 words distinct banks.
// - VB: the widest of 32, 16, 8 dividing V, narrowed while the grid has fewer blocks than SMs
//   (a B 1 prefill of 16 heads of 192 columns: VB 16, 192 blocks). Untuned.
// Requirements: K, C multiples of 4 (16-byte rows), K <= 256, C <= 64, V a multiple of 8.
#include "lt2/kernels/prefill.h"

#include "lt2/kernels/cuda/device_utils.cuh"

namespace lt2::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

// f(T{}, std::bool_constant<kTf32>{}) with T the CUDA type of dtype (BFloat16, else Float32) and
// kTf32 = tf32: the kernels' instantiation by their runtime dtype and precision.
template <typename F>
void dispatch_dtype_tf32(DType dtype, bool tf32, F&& f) {
  auto with_precision = [&](auto t) {
    if (tf32) f(t, std::true_type{});
    else f(t, std::false_type{});
  };
  if (dtype == DType::BFloat16) with_precision(__nv_bfloat16{});
  else with_precision(float{});
}

// Row pitches (floats): of an A operand with `cols` columns, and of a [rows, VB] B operand.
__host__ __device__ constexpr int a_pitch(int cols) { return round_up(cols, 16) + 4; }
__host__ __device__ constexpr int b_pitch(int vb) { return vb == 8 ? 8 : vb + 8; }

// The block's shared memory, offsets in floats (all multiples of 4: 16-byte aligned). Rows and
// columns pad to multiples of 16 (Kp, Cp).
struct ScanLayout {
  int pk, pc, pv;  // row pitches of [., K] and [., C] A operands and of [., VB] B operands
  int s;           // S slice       [Kp, pv]
  int vn;          // V_new slice   [Cp, pv]
  int w;           // W_n [Cp, pk]
  int kt;          // Kt_n [Kp, pc], two buffers taking turns, kt_size apart
  int carry;       // carry_n [Kp] (or [1]), two buffers with them, carry_size apart
  int kt_size, carry_size;
  int total;
};
__host__ __device__ inline ScanLayout scan_layout(int K, int C, int VB) {
  const int Kp = round_up(K, 16), Cp = round_up(C, 16);
  ScanLayout l{};
  l.pk = a_pitch(K);
  l.pc = a_pitch(C);
  l.pv = b_pitch(VB);
  l.s = 0;
  l.vn = l.s + Kp * l.pv;
  l.w = l.vn + Cp * l.pv;
  l.kt = l.w + Cp * l.pk;
  l.kt_size = Kp * l.pc;
  l.carry = l.kt + 2 * l.kt_size;
  l.carry_size = Kp;
  l.total = l.carry + 2 * l.carry_size;
  return l;
}

size_t scan_smem_bytes(int K, int C, int VB) { return sizeof(float) * scan_layout(K, C, VB).total; }

// A block-wide copy of [rows, cols] floats (cols % 4 == 0, cols <= 4 kThreads) in 16-byte pieces:
// thread tid takes piece tid % (cols / 4) of every (kThreads / (cols / 4))-th row from
// tid / (cols / 4); threads past a whole number of rows idle. Planned once per kernel: the integer
// divisions cost more than the copies they place.
struct RowCopy {
  int row0, col, row_step;
};
__device__ __forceinline__ RowCopy plan_row_copy(int cols) {
  const int per_row = cols / 4;
  RowCopy c;
  c.row_step = kThreads / per_row;
  c.row0 = threadIdx.x / per_row;
  c.col = 4 * (threadIdx.x - c.row0 * per_row);
  if (c.row0 >= c.row_step) c.row0 = 1 << 30;  // idle
  return c;
}
// rows x cols floats, rows `cols` apart in global memory (16-byte aligned), to shared memory rows
// `pitch` apart, by cp.async as `c` (planned for these cols) places them.
__device__ __forceinline__ void copy_rows_async(const RowCopy& c, float* dst, int pitch, const float* src, int rows,
                                                int cols) {
  for (int r = c.row0; r < rows; r += c.row_step)
    cp_async16(dst + r * pitch + c.col, src + static_cast<int64_t>(r) * cols + c.col);
}

// hi += lo over the first `tiles` tiles: the 3xTF32 corrections into the result (none with kTf32).
template <int Tiles, bool kTf32>
__device__ __forceinline__ void fold_corrections(float (&hi)[Tiles][4], const float (&lo)[Tiles][4], int tiles) {
  if constexpr (!kTf32) {
#pragma unroll
    for (int i = 0; i < Tiles; ++i) {
      if (i >= tiles) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) hi[i][e] += lo[i][e];
    }
  }
}

// hi + lo += A[m0 : m0 + 16, :X] B[:X, n0 : n0 + 8] for the warp's tiles: m0 = 16 (mt0 + step i)
// for i < tiles, one n0. A: rows `ap` floats apart in shared memory, X % 8 == 0 columns; B: [X, .]
// rows `bp` apart, from column n0. In 3xTF32 (hi: the big products, lo: the corrections), or with
// kTf32 one TF32 product of rounded operands (hi only).
template <int Tiles, bool kTf32>
__device__ __forceinline__ void tiles_times_cols(float (&hi)[Tiles][4], float (&lo)[Tiles][4], const float* A, int ap,
                                                 int mt0, int step, int tiles, const float* B, int bp, int n0,
                                                 int X) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // ldmatrix.x4: lanes 8q .. 8q + 7 address the rows of matrix q (rows + 8 for q odd, columns + 4 for q >= 2).
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1), lcol = 4 * (lane >> 4);
#pragma unroll 2
  for (int x = 0; x < X; x += 8) {
    const float b0 = B[(x + t) * bp + n0 + g], b1 = B[(x + t + 4) * bp + n0 + g];
    const SplitTf32 s0 = split_tf32(b0), s1 = split_tf32(b1);  // unused with kTf32: compiled out
#pragma unroll
    for (int i = 0; i < Tiles; ++i) {
      if (i >= tiles) break;
      uint32_t a[4];
      ldmatrix_x4(a, A + (16 * (mt0 + step * i) + lrow) * ap + x + lcol);
      if constexpr (kTf32) {
        round_fragment_tf32(a);
        mma_tf32(hi[i], a, tf32_round(b0), tf32_round(b1));
      } else {
        uint32_t big[4], small[4];
        split_fragment_tf32(a, big, small);
        mma_3xtf32(hi[i], lo[i], big, small, s0, s1);
      }
    }
  }
}

// f(i, r, row) for the thread's rows of a warp's tiles: row r (g or g + 8) of its i-th tile (m-tile
// mt0 + step i), `row` its index in the product. Stops at `tiles` (`break`: predicated-off
// iterations would still cost their address arithmetic); MaxTiles sizes the unrolled loop.
template <int MaxTiles, typename F>
__device__ __forceinline__ void for_warp_rows(int tiles, int mt0, int step, int g, F&& f) {
#pragma unroll
  for (int i = 0; i < MaxTiles; ++i) {
    if (i >= tiles) break;
#pragma unroll
    for (int r = 0; r < 2; ++r) f(i, r, 16 * (mt0 + step * i) + g + 8 * r);
  }
}

template <int VB, bool kTf32>
__global__ void __launch_bounds__(kThreads) delta_rule_scan_kernel(const DeltaRuleScanParams p) {
  constexpr int NT = VB / 8;                                       // n-tiles of the slice
  constexpr int kMtStep = kWarps / NT;                             // m-tiles between a warp's tiles
  constexpr int kChunkTiles = ceil_div(kMaxScanChunk / 16, kMtStep);  // V_new tiles per warp, at most
  constexpr int kStateTiles = ceil_div(kMaxScanHeadK / 16, kMtStep);  // S tiles per warp, at most
  const int K = p.head_k, V = p.head_v, C = p.chunk_size, N = p.chunks;
  const int Kp = round_up(K, 16), Cp = round_up(C, 16);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = 8 * (warp % NT), mt0 = warp / NT;
  const int chunk_tiles = ceil_div(Cp / 16 - mt0, kMtStep), state_tiles = ceil_div(Kp / 16 - mt0, kMtStep);
  const int v0 = blockIdx.x * VB, col = n0 + 2 * t;  // the thread's accumulator columns: col, col + 1
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
  auto uv_offset = [&](int n, int c) { return ((bh * N + n) * C + c) * V + v0 + col; };  // u, v_new
  const int carry_dim = p.per_channel_carry ? K : 1;
  const RowCopy copy_k = plan_row_copy(K), copy_c = plan_row_copy(C);  // of [., K] and [., C] rows
  // Kt_n and carry_n into buffer `b`.
  auto load_kt_carry = [&](int n, int b) {
    if (p.kt) copy_rows_async(copy_c, smem + lay.kt + b * lay.kt_size, lay.pc, kt_of(n), K, C);
    const float* carry = p.carry + (bh * N + n) * carry_dim;
    float* dst = smem + lay.carry + b * lay.carry_size;
    if (p.per_channel_carry) copy_rows_async(copy_k, dst, 0, carry, 1, K);
    else if (threadIdx.x == 0) cp_async4(dst, carry);
  };
  // The thread's entries of S (k: past K in the pad) and of V_new (c: past C in the pad). Tiles past
  // state_tiles stay zero, never read.
  float s[kStateTiles][4] = {};
  auto for_state_rows = [&](auto&& f) { for_warp_rows<kStateTiles>(state_tiles, mt0, kMtStep, g, f); };
  auto for_chunk_rows = [&](auto&& f) { for_warp_rows<kChunkTiles>(chunk_tiles, mt0, kMtStep, g, f); };
  // The thread's S entries of a [K, V] matrix (rows V apart, from column v0) into `dst`: S itself or
  // Y_n; rows past K, or all without src, as zeros.
  auto load_state_entries = [&](const float* src, float (&dst)[kStateTiles][4]) {
    for_state_rows([&](int i, int r, int k) {
      const float2 v = src && k < K ? *reinterpret_cast<const float2*>(src + int64_t{k} * V + col)
                                    : make_float2(0.f, 0.f);
      dst[i][2 * r] = v.x, dst[i][2 * r + 1] = v.y;
    });
  };
  // U_n at the thread's V_new entries (rows past C: zeros).
  auto load_u = [&](int n, float (&u)[kChunkTiles][4]) {
    for_chunk_rows([&](int i, int r, int c) {
      const float2 v = c < C ? __ldg(reinterpret_cast<const float2*>(p.u + uv_offset(n, c))) : make_float2(0.f, 0.f);
      u[i][2 * r] = v.x, u[i][2 * r + 1] = v.y;
    });
  };
  auto store_state = [&](float* dst) {
    for_state_rows([&](int i, int r, int k) {
      if (k < K) *reinterpret_cast<float2*>(dst + int64_t{k} * V + col) = make_float2(s[i][2 * r], s[i][2 * r + 1]);
    });
  };

  // Prologue: the pads zeroed, then W_0, Kt_0 and carry_0 in flight, S from the initial state.
  for (int i = threadIdx.x; i < lay.total; i += kThreads) smem[i] = 0.f;
  __syncthreads();
  if (N > 0) {
    if (p.w) copy_rows_async(copy_k, sW, lay.pk, w_of(chunk_at(0)), C, K);
    load_kt_carry(chunk_at(0), 0);
  }
  cp_async_commit();
  load_state_entries(p.initial_state ? p.initial_state + bh * K * V + v0 : nullptr, s);
  // U (and Y) are read into registers a phase before their use, so their loads are in flight
  // meanwhile: U_{n+1} during chunk n's phase 2, Y_n during its phase 1.
  float u[kChunkTiles][4] = {};
  if (N > 0) load_u(chunk_at(0), u);

  for (int step = 0; step < N; ++step) {
    const int b = step & 1, n = chunk_at(step);
    // A document starts here (packed rows): S restarts from its state.
    const int reset = p.resets ? __ldg(p.resets + n) : -1;
    if (reset >= 0)
      load_state_entries(
          p.reset_states ? p.reset_states + (int64_t{reset} * p.heads + blockIdx.y) * K * V + v0 : nullptr, s);
    store_state(p.states + (bh * N + n) * K * V + v0);  // S_n
    // S to shared memory for phase 1 (its last readers, the previous phase 1, passed a barrier since).
    for_state_rows([&](int i, int r, int k) {
      *reinterpret_cast<float2*>(sS + k * lay.pv + col) = make_float2(s[i][2 * r], s[i][2 * r + 1]);
    });
    float y[kStateTiles][4];  // Y_n, for phase 2
    load_state_entries(p.addend ? p.addend + (bh * N + n) * K * V + v0 : nullptr, y);
    cp_async_wait<0>();  // W_n, Kt_n and carry_n landed
    __syncthreads();     // ... for every thread; S is in shared memory; the last phase 2 is done with buffer b ^ 1
    if (step + 1 < N) load_kt_carry(chunk_at(step + 1), b ^ 1);  // lands during this whole chunk
    cp_async_commit();

    // 1: V_new = U_n - W_n S (U_n without W).
    {
      float hi[kChunkTiles][4] = {}, lo[kChunkTiles][4] = {};
      if (p.w) {
        tiles_times_cols<kChunkTiles, kTf32>(hi, lo, sW, lay.pk, mt0, kMtStep, chunk_tiles, sS, lay.pv, n0, Kp);
        fold_corrections<kChunkTiles, kTf32>(hi, lo, chunk_tiles);
      }
      for_chunk_rows([&](int i, int r, int c) {
        const float2 v = make_float2(u[i][2 * r] - hi[i][2 * r], u[i][2 * r + 1] - hi[i][2 * r + 1]);
        *reinterpret_cast<float2*>(sVn + c * lay.pv + col) = v;  // rows past C: zeros
        if (p.v_new && c < C) *reinterpret_cast<float2*>(p.v_new + uv_offset(n, c)) = v;
      });
    }
    __syncthreads();  // V_new complete; nobody reads W_n any more
    if (p.w && step + 1 < N) copy_rows_async(copy_k, sW, lay.pk, w_of(chunk_at(step + 1)), C, K);  // lands during 2
    cp_async_commit();
    if (step + 1 < N) load_u(chunk_at(step + 1), u);  // phase 1 is done with U_n

    // 2: S = carry_n * S + Y_n + Kt_n V_new, on the warp's own tiles.
    {
      const float* sCarry = smem + lay.carry + b * lay.carry_size;
      float lo[kStateTiles][4] = {};
      for_state_rows([&](int i, int r, int k) {
        const float d = p.per_channel_carry ? sCarry[k] : sCarry[0];  // rows past K: zeros
        s[i][2 * r] = fmaf(d, s[i][2 * r], y[i][2 * r]);
        s[i][2 * r + 1] = fmaf(d, s[i][2 * r + 1], y[i][2 * r + 1]);
      });
      if (p.kt) {
        tiles_times_cols<kStateTiles, kTf32>(s, lo, smem + lay.kt + b * lay.kt_size, lay.pc, mt0, kMtStep, state_tiles,
                                             sVn, lay.pv, n0, Cp);
        fold_corrections<kStateTiles, kTf32>(s, lo, state_tiles);
      }
    }
  }
  cp_async_wait<0>();  // nothing real is left in flight (the last chunk's prefetches are empty)
  store_state(p.final_state + bh * K * V + v0);
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
  const bool outputs_given = p.u && p.carry && p.states && (p.v_new != nullptr) == (p.w != nullptr);
  LT2_CHECK(p.final_state && (p.chunks == 0 || outputs_given),
            "delta_rule_scan: final_state, u, carry and states must be given (only final_state without chunks), and "
            "v_new exactly with w (without w, V_n is U_n)");
  LT2_CHECK(!p.resets || p.batch == 1, "delta_rule_scan: resets (packed documents) need batch 1, found ", p.batch);
  auto aligned = [](const void* ptr) { return !ptr || aligned16(ptr); };
  LT2_CHECK(aligned(p.w) && aligned(p.kt) && (!p.per_channel_carry || aligned(p.carry)) && aligned(p.u) &&
                aligned(p.v_new) && aligned(p.states) && aligned(p.final_state) && aligned(p.initial_state) &&
                aligned(p.addend) && aligned(p.reset_states),
            "delta_rule_scan: every matrix (and a per-channel carry) must be 16-byte aligned");
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
  auto launch_vb = [&](auto tf32) {
    constexpr bool kTf32 = decltype(tf32)::value;
    switch (vb) {
      case 32:
        reserve_shared<delta_rule_scan_kernel<32, kTf32>>(smem, "delta_rule_scan");
        launch(delta_rule_scan_kernel<32, kTf32>);
        break;
      case 16:
        reserve_shared<delta_rule_scan_kernel<16, kTf32>>(smem, "delta_rule_scan");
        launch(delta_rule_scan_kernel<16, kTf32>);
        break;
      default:
        reserve_shared<delta_rule_scan_kernel<8, kTf32>>(smem, "delta_rule_scan");
        launch(delta_rule_scan_kernel<8, kTf32>);
        break;
    }
  };
  if (p.tf32) launch_vb(std::true_type{});
  else launch_vb(std::false_type{});
  check_launch("delta_rule_scan");
}

// ---------------------------------------------------------------------------------------------
// delta_rule_output: O_n = Q_n S_n + A_n V_n for every chunk-head, written in the token layout.
//
// Floor. Per chunk-head it reads Q_n [C, K], A_n [C, C], S_n [K, V] and V_n [C, V] in fp32, writes
// O_n [C, V] in the output dtype and does 2 C V (K + C) FLOPs: at the 1.3B GDN head (K 96, V 192,
// C 64) 160 KiB read, 24 KiB written in bf16, 3.9 MFLOP. An 8k-token prefill (2,048 chunk-heads a
// layer) moves 0.38 GB, ~0.11 ms at ~3.3 TB/s; its 8 GFLOP are ~0.02 ms in TF32 (~0.06 in 3xTF32).
// As batched GEMMs (chunk_outputs, the fallback) the outputs would cross memory twice more: fp32 O
// written in chunks, read, and written again in the token layout and dtype.
//
// Design.
// - Grid (N, H, B), 8 warps; a block computes one chunk-head's [C, V] (C 64): warp w rows
//   16 (w % 4) .. + 15 and value columns (w / 4) V / 2 .. + V / 2 - 1 (V / 16 n-tiles) as mma.sync
//   m16n8k8: one TF32 product with `tf32`, else 3xTF32 into the same accumulator.
// - Q_n and A_n (the A operands) sit whole in shared memory; the B operand [S_n ; V_n] (K + C rows)
//   streams through kOutStages buffers of 16 rows by cp.async, kOutStages - 1 panels ahead of the
//   one in use. A_n is causal: a warp skips the V_n panels past its rows.
// - The result passes through shared memory (over the operands' space) to leave in 16-byte stores
//   along each token's row.
// - Pitches as the scan's: A operands round_up(cols, 16) + 4 floats (ldmatrix rows in distinct
//   banks), B rows V + 8 (8 or 24 mod 32: B[t][g] across a warp in distinct banks).
// Requirements: C 64, K and V multiples of 16 in [16, 256].

namespace {

constexpr int kOutChunk = 64;
constexpr int kOutMaxDim = 256;
constexpr int kOutStages = 3;
constexpr int kOutPanelRows = 16;

struct OutputShared {  // offsets and pitches in floats
  int pk, pc, pv, po;  // row pitches: Q_n, A_n, the B panels, the staged result
  int q, a, panels, panel_size, total;
};
__host__ __device__ inline OutputShared output_shared(int K, int V) {
  OutputShared l{};
  l.pk = a_pitch(K);
  l.pc = a_pitch(kOutChunk);
  l.pv = b_pitch(V);
  l.po = V + 4;
  l.q = 0;
  l.a = l.q + kOutChunk * l.pk;
  l.panels = l.a + kOutChunk * l.pc;
  l.panel_size = kOutPanelRows * l.pv;
  l.total = max(l.panels + kOutStages * l.panel_size, kOutChunk * l.po);
  return l;
}

bool output_dims_in_bounds(int K, int V, int C) {
  return C == kOutChunk && K >= 16 && K <= kOutMaxDim && K % 16 == 0 && V >= 16 && V <= kOutMaxDim && V % 16 == 0;
}

template <typename Out, bool kTf32>
__global__ void __launch_bounds__(kThreads, 2) delta_rule_output_kernel(const DeltaRuleOutputParams p) {
  constexpr int C = kOutChunk, kMaxTiles = kOutMaxDim / 16;
  const int K = p.head_k, V = p.head_v, T = p.seq, H = p.heads;
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = n * C, rows = min(C, T - t0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int mt = warp % 4, tiles = V / 16, c0 = (warp / 4) * (V / 2);
  const OutputShared lay = output_shared(K, V);
  extern __shared__ __align__(16) float out_smem[];
  const float *sQ = out_smem + lay.q, *sA = out_smem + lay.a;
  const int64_t chunk = (static_cast<int64_t>(b) * H + h) * gridDim.x + n;
  const float* state = p.states + chunk * K * V;
  const float* v_new = p.v_new + chunk * C * V;
  const int panels = (K + C) / kOutPanelRows;
  const RowCopy copy_v = plan_row_copy(V);
  // Panel i (rows 16 i .. of [S_n ; V_n]) into buffer i % kOutStages; a group per panel, empty
  // past the last, so every wait counts the same.
  auto load_panel = [&](int i) {
    if (i < panels) {
      const int r0 = kOutPanelRows * i;
      const float* src = r0 < K ? state + int64_t{r0} * V : v_new + int64_t{r0 - K} * V;
      copy_rows_async(copy_v, out_smem + lay.panels + (i % kOutStages) * lay.panel_size, lay.pv, src, kOutPanelRows, V);
    }
    cp_async_commit();
  };
  copy_rows_async(plan_row_copy(K), out_smem + lay.q, lay.pk, p.q_start + chunk * C * K, C, K);
  copy_rows_async(plan_row_copy(C), out_smem + lay.a, lay.pc, p.a_qk + chunk * C * C, C, C);
  for (int i = 0; i < kOutStages - 1; ++i) load_panel(i);  // Q_n and A_n land with panel 0

  float acc[kMaxTiles][4] = {};
  // ldmatrix.x4: lanes 8q .. 8q + 7 address the rows of matrix q (rows + 8 for q odd, columns + 4 for q >= 2).
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1), lcol = 4 * (lane >> 4);
  for (int i = 0; i < panels; ++i) {
    cp_async_wait<kOutStages - 2>();  // panel i landed (this thread's pieces) ...
    __syncthreads();                  // ... everyone's; panel i - 1's buffer is free
    load_panel(i + kOutStages - 1);
    const int r0 = kOutPanelRows * i;
    const bool values = r0 >= K;            // a V_n panel: A_n's columns, else S_n's: Q_n's
    const int x0 = values ? r0 - K : r0;    // the A operand's first column for this panel
    if (values && x0 > 16 * mt) continue;   // A_n is zero there for the warp's rows
    const float* A = (values ? sA : sQ) + (16 * mt + lrow) * (values ? lay.pc : lay.pk) + x0 + lcol;
    const float* B = out_smem + lay.panels + (i % kOutStages) * lay.panel_size + c0 + g;
#pragma unroll
    for (int ks = 0; ks < kOutPanelRows / 8; ++ks) {
      uint32_t a[4], big[4], small[4];
      ldmatrix_x4(a, A + 8 * ks);
      if constexpr (kTf32) round_fragment_tf32(a);
      else split_fragment_tf32(a, big, small);
      const float* Bk = B + 8 * ks * lay.pv;
#pragma unroll
      for (int j = 0; j < kMaxTiles; ++j) {
        if (j >= tiles) break;
        const float b0 = Bk[t * lay.pv + 8 * j], b1 = Bk[(t + 4) * lay.pv + 8 * j];
        if constexpr (kTf32) mma_tf32(acc[j], a, tf32_round(b0), tf32_round(b1));
        else mma_3xtf32(acc[j], acc[j], big, small, split_tf32(b0), split_tf32(b1));
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the operands: their space takes the result
  float* sO = out_smem;
#pragma unroll
  for (int j = 0; j < kMaxTiles; ++j) {
    if (j >= tiles) break;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(sO + (16 * mt + g + 8 * r) * lay.po + c0 + 8 * j + 2 * t) =
          make_float2(acc[j][2 * r], acc[j][2 * r + 1]);
  }
  __syncthreads();
  // 16-byte pieces along each token's row of V values.
  constexpr int kPiece = 16 / sizeof(Out);
  const int per_row = V / kPiece;
  Out* out = static_cast<Out*>(p.out) + ((static_cast<int64_t>(b) * T + t0) * H + h) * V;
  for (int e = threadIdx.x; e < rows * per_row; e += kThreads) {
    const int i = e / per_row, c = (e - i * per_row) * kPiece;
    const float* src = sO + i * lay.po + c;
    Out* dst = out + static_cast<int64_t>(i) * H * V + c;
    if constexpr (std::is_same_v<Out, float>) {
      *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
    } else {
      const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
      *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<Out>(lo.x, lo.y), pack2<Out>(lo.z, lo.w),
                                                  pack2<Out>(hi.x, hi.y), pack2<Out>(hi.z, hi.w));
    }
  }
}

}  // namespace

bool delta_rule_output_supported(int head_k, int head_v, int chunk_size, int device) {
  return output_dims_in_bounds(head_k, head_v, chunk_size) &&
         sizeof(float) * static_cast<size_t>(output_shared(head_k, head_v).total) <= max_shared_bytes(device);
}

void delta_rule_output(const DeltaRuleOutputParams& p, void* stream) {
  const char* op = "delta_rule_output";
  LT2_CHECK(output_dims_in_bounds(p.head_k, p.head_v, p.chunk_size), op, ": needs C ", kOutChunk,
            ", K and V multiples of 16 in [16, ", kOutMaxDim, "], found K ", p.head_k, ", V ", p.head_v, ", C ",
            p.chunk_size);
  LT2_CHECK(p.batch >= 0 && p.heads >= 0 && p.seq >= 0 && p.batch <= 65535 && p.heads <= 65535, op, ": batch ",
            p.batch, " and heads ", p.heads, " must be in [0, 65535], seq ", p.seq, " >= 0");
  LT2_CHECK(p.dtype == DType::Float32 || p.dtype == DType::BFloat16, op, ": out must be fp32 or bf16");
  const int chunks = ceil_div(p.seq, kOutChunk);
  if (p.batch == 0 || p.heads == 0 || chunks == 0) return;
  LT2_CHECK(p.q_start && p.states && p.a_qk && p.v_new && p.out, op, ": every pointer must be given");
  LT2_CHECK(aligned16(p.q_start) && aligned16(p.states) && aligned16(p.a_qk) && aligned16(p.v_new) &&
                aligned16(p.out),
            op, ": every tensor must be 16-byte aligned");
  int device = 0;
  cudaGetDevice(&device);
  const size_t smem = sizeof(float) * output_shared(p.head_k, p.head_v).total;
  LT2_CHECK(smem <= max_shared_bytes(device), op, ": K ", p.head_k, ", V ", p.head_v, " need ", smem,
            " bytes of shared memory, the device gives ", max_shared_bytes(device));
  const dim3 grid(chunks, p.heads, p.batch);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype_tf32(p.dtype, p.tf32, [&](auto out, auto tf32) {
    constexpr auto kernel = delta_rule_output_kernel<decltype(out), decltype(tf32)::value>;
    reserve_shared<kernel>(smem, op);
    kernel<<<grid, kThreads, smem, s>>>(p);
  });
  check_launch(op);
}

// ---------------------------------------------------------------------------------------------
// row_dots: one warp per row in 16-byte loads (a row of the 1.3B head's states is 192 floats: a
// warp's 32 lanes take 128 of them a step). Floor: the two matrices read once, 1.2 GB at the 8 x
// 4096 training shape, ~0.37 ms; the product-then-sum it replaces moves 1.8 GB more.

namespace {

constexpr int kRowDotWarps = 8;

__global__ void __launch_bounds__(32 * kRowDotWarps) row_dots_kernel(const RowDotsParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowDotWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const float* x = p.x + row * p.cols;
  const float* y = p.y + row * p.cols;
  float sum = 0.f;
  for (int c = 4 * lane; c < p.cols; c += 128) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x + c)), b = __ldg(reinterpret_cast<const float4*>(y + c));
    sum = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, sum))));
  }
  sum = warp_sum(sum);
  if (lane == 0) p.out[row] = sum;
}

}  // namespace

void row_dots(const RowDotsParams& p, void* stream) {
  LT2_CHECK(p.rows >= 0 && p.cols >= 0 && p.cols % 4 == 0, "row_dots: ", p.rows, " rows of ", p.cols,
            " columns (a multiple of 4)");
  if (p.rows == 0) return;
  LT2_CHECK(p.x && p.y && p.out && aligned16(p.x) && aligned16(p.y), "row_dots: x, y and out must be given, x and y "
            "16-byte aligned");
  const int64_t blocks = (p.rows + kRowDotWarps - 1) / kRowDotWarps;
  LT2_CHECK(blocks <= INT32_MAX, "row_dots: ", p.rows, " rows is too many");
  row_dots_kernel<<<static_cast<unsigned>(blocks), 32 * kRowDotWarps, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("row_dots");
}

// ---------------------------------------------------------------------------------------------
// scan_backward_products. Floor: each input read once. At lt2-gdn-100m's training shape (16 x 2048
// tokens, 6 heads, K 96, V 192, C 64: 3,072 chunks) G and S are 226 MB each, X and dU 151 MB each, dKt
// and dW 75 MB each: 0.90 GB a call, ~0.3 ms at ~3 TB/s, where the two batched products and row_dots
// moved 1.36 GB (0.45 ms measured at 42a4424). The products are 2 x 1.18 M multiply-adds a chunk
// (7.2 G a call): on tensor cores they hide under the loads, in SIMT fp32 they would not.
//
// Design. One block per chunk, 8 warps; V in tiles of 32 columns through shared memory, two stages
// by cp.async (tile i + 1 lands while the warps multiply tile i). A stage stacks the tile's rows of
// G (K), S (K), X (C) and dU (C, with W) 36 floats apart (4 mod 32: the fragments' 8 rows x 4 columns
// fall in distinct banks, as A and as B operand). dKt: warp w owns columns 8w .. 8w + 7 of C and every
// 16-row tile of K; dW: warp w owns rows 16 (w % 4) .. + 15 of C and half of K's 8-column tiles; the
// accumulators stay in registers across the tiles (at most 2 x 32 floats a thread). dcarry: thread t
// sums row t / 2's half t % 2 of each tile. At K 96, C 64: 92 KiB of shared memory, two blocks an SM.

namespace {

constexpr int kProdThreads = 256;
constexpr int kProdTile = 32;                // V columns a tile
constexpr int kProdPitch = kProdTile + 4;    // shared row pitch (floats)
constexpr int kProdMaxK = 128, kProdMaxC = 64;

// Rows of one stage: G, S, X, then dU (with W).
__host__ __device__ constexpr int prod_stage_rows(int K, int C, bool with_w) { return 2 * K + (with_w ? 2 : 1) * C; }

template <bool kTf32>
__global__ void __launch_bounds__(kProdThreads) scan_backward_products_kernel(const ScanBackwardProductsParams p) {
  extern __shared__ __align__(16) float smem[];
  const int K = p.head_k, V = p.head_v, C = p.chunk_size, warp = threadIdx.x / 32;
  const bool with_w = p.dw != nullptr;
  const int rows = prod_stage_rows(K, C, with_w), stage_size = rows * kProdPitch;
  const int64_t chunk = blockIdx.x;
  const float* G = p.g_next + chunk * K * V;
  const float* S = p.states + chunk * K * V;
  const float* X = p.values + chunk * C * V;
  const float* dU = with_w ? p.du + chunk * C * V : nullptr;
  // Tile columns v0 .. v0 + 31 (fewer at V's end: V is a multiple of 8) of every stacked row into `stage`.
  auto issue = [&](int v0, float* stage) {
    const int pieces = min(kProdTile, V - v0) / 4;
    for (int e = threadIdx.x; e < rows * pieces; e += kProdThreads) {
      const int r = e / pieces, c = 4 * (e - r * pieces);
      const float* src = r < K ? G + r * V : r < 2 * K ? S + (r - K) * V : r < 2 * K + C ? X + (r - 2 * K) * V
                                                                                          : dU + (r - 2 * K - C) * V;
      cp_async16(stage + r * kProdPitch + c, src + v0 + c);
    }
    cp_async_commit();
  };
  float kt_acc[kProdMaxK / 16][1][4] = {};  // dKt: rows 16 m .. of K, columns 8 warp .. of C
  float w_acc[kProdMaxK / 16][4] = {};      // dW: rows 16 (warp % 4) .. of C, columns 8 (half + j) .. of K
  float dot = 0.f;
  const int tiles = (V + kProdTile - 1) / kProdTile, half = (warp / 4) * (K / 16), dot_row = threadIdx.x / 2,
            dot_col = (threadIdx.x % 2) * (kProdTile / 2);
  issue(0, smem);
  for (int i = 0; i < tiles; ++i) {
    const float* stage = smem + (i % 2) * stage_size;
    if (i + 1 < tiles) {
      issue((i + 1) * kProdTile, smem + ((i + 1) % 2) * stage_size);  // its stage was read before the last barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int cols = min(kProdTile, V - i * kProdTile);
    const float *sG = stage, *sS = stage + K * kProdPitch, *sX = stage + 2 * K * kProdPitch,
                *sU = sX + C * kProdPitch;
    if (8 * warp < C) {
#pragma unroll
      for (int m = 0; m < kProdMaxK / 16; ++m) {
        if (16 * m >= K) break;
        warp_product<1, kTf32>(kt_acc[m], sG, kProdPitch, 1, sX, 1, kProdPitch, 16 * m, warp, 1, 0, cols);
      }
    }
    if (with_w && 16 * (warp % 4) < C)
      warp_product<kProdMaxK / 16, kTf32>(w_acc, sU, kProdPitch, 1, sS, 1, kProdPitch, 16 * (warp % 4), half, K / 16,
                                          0, cols);
    if (dot_row < K)
      for (int c = dot_col; c < min(dot_col + kProdTile / 2, cols); ++c)
        dot = fmaf(sG[dot_row * kProdPitch + c], sS[dot_row * kProdPitch + c], dot);
    __syncthreads();  // the stage is read before the next iteration's copies overwrite it
  }
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (8 * warp < C) {  // fragment: acc0, 1 = [g][2t, 2t + 1], acc2, 3 = [g + 8][..]
    float* out = p.dkt + chunk * K * C + 8 * warp + 2 * t;
#pragma unroll
    for (int m = 0; m < kProdMaxK / 16; ++m) {
      if (16 * m >= K) break;
      *reinterpret_cast<float2*>(out + (16 * m + g) * C) = make_float2(kt_acc[m][0][0], kt_acc[m][0][1]);
      *reinterpret_cast<float2*>(out + (16 * m + g + 8) * C) = make_float2(kt_acc[m][0][2], kt_acc[m][0][3]);
    }
  }
  if (with_w && 16 * (warp % 4) < C) {
    float* out = p.dw + chunk * C * K + (16 * (warp % 4) + g) * K + 2 * t;
#pragma unroll
    for (int j = 0; j < kProdMaxK / 16; ++j) {
      if (j >= K / 16) break;
      const int col = 8 * (half + j);
      *reinterpret_cast<float2*>(out + col) = make_float2(-w_acc[j][0], -w_acc[j][1]);
      *reinterpret_cast<float2*>(out + 8 * K + col) = make_float2(-w_acc[j][2], -w_acc[j][3]);
    }
  }
  if (p.per_head_carry) {
    __shared__ float scratch[32];
    const float total = block_sum(dot, scratch);
    if (threadIdx.x == 0) p.dcarry[chunk] = total;
  } else {
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);  // the row's two halves
    if (threadIdx.x % 2 == 0 && dot_row < K) p.dcarry[chunk * K + dot_row] = dot;
  }
}

// ---------------------------------------------------------------------------------------------
// negated_transpose: a block per 32 x 32 tile of a matrix (blocks of z walk the matrices), 32 x 8
// threads; the tile's rows read as 32-float runs, written back as columns' 32-float runs, the
// shared rows padded to 33 floats (the column reads in distinct banks). Floor: one read and one
// write of each matrix, 151 MB a call at lt2-gdn-100m's training shape (~0.05 ms).
constexpr int kTransposeTile = 32, kTransposeRowsStep = 8;

__global__ void __launch_bounds__(kTransposeTile * kTransposeRowsStep)
    negated_transpose_kernel(const NegatedTransposeParams p) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const int r0 = blockIdx.y * kTransposeTile, c0 = blockIdx.x * kTransposeTile, tx = threadIdx.x, ty = threadIdx.y;
  const int64_t size = int64_t{p.rows} * p.cols;
  for (int64_t m = blockIdx.z; m < p.count; m += gridDim.z) {
    const float* x = p.x + m * size;
    for (int i = ty; i < kTransposeTile; i += kTransposeRowsStep)
      if (r0 + i < p.rows && c0 + tx < p.cols) tile[i][tx] = x[int64_t{r0 + i} * p.cols + c0 + tx];
    __syncthreads();
    float* out = p.out + m * size;
    for (int i = ty; i < kTransposeTile; i += kTransposeRowsStep)
      if (c0 + i < p.cols && r0 + tx < p.rows) out[int64_t{c0 + i} * p.rows + r0 + tx] = -tile[tx][i];
    __syncthreads();  // the tile is read before the next matrix overwrites it
  }
}

}  // namespace

void negated_transpose(const NegatedTransposeParams& p, void* stream) {
  LT2_CHECK(p.count >= 0 && p.rows >= 0 && p.cols >= 0, "negated_transpose: count, rows and cols must be >= 0");
  if (p.count == 0 || p.rows == 0 || p.cols == 0) return;
  LT2_CHECK(p.x && p.out, "negated_transpose: x and out must be given");
  const dim3 grid(ceil_div(p.cols, kTransposeTile), ceil_div(p.rows, kTransposeTile),
                  static_cast<unsigned>(std::min<int64_t>(p.count, 65535)));
  negated_transpose_kernel<<<grid, dim3(kTransposeTile, kTransposeRowsStep), 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("negated_transpose");
}

bool scan_backward_products_supported(int head_k, int head_v, int chunk_size) {
  return head_k >= 16 && head_k <= kProdMaxK && head_k % 16 == 0 && chunk_size >= 16 && chunk_size <= kProdMaxC &&
         chunk_size % 16 == 0 && head_v >= 8 && head_v % 8 == 0;
}

void scan_backward_products(const ScanBackwardProductsParams& p, void* stream) {
  const char* op = "scan_backward_products";
  LT2_CHECK(scan_backward_products_supported(p.head_k, p.head_v, p.chunk_size), op, ": needs K and C multiples of 16 ",
            "with K <= ", kProdMaxK, " and C <= ", kProdMaxC, ", V a multiple of 8; found K ", p.head_k, ", V ",
            p.head_v, ", C ", p.chunk_size);
  LT2_CHECK(p.count >= 0 && p.count <= INT32_MAX, op, ": ", p.count, " chunks (at most 2^31 - 1)");
  if (p.count == 0) return;
  LT2_CHECK(p.g_next && p.states && p.values && p.dkt && p.dcarry && (!p.dw || p.du), op,
            ": g_next, states, values, dkt and dcarry must be given, and du with dw");
  LT2_CHECK(aligned16(p.g_next) && aligned16(p.states) && aligned16(p.values) && (!p.dw || aligned16(p.du)) &&
                aligned16(p.dkt) && (!p.dw || aligned16(p.dw)),
            op, ": the matrices must be 16-byte aligned");
  const size_t smem = 2 * sizeof(float) * kProdPitch * prod_stage_rows(p.head_k, p.chunk_size, p.dw != nullptr);
  const auto s = static_cast<cudaStream_t>(stream);
  auto launch = [&](auto tf32) {
    constexpr auto kernel = scan_backward_products_kernel<decltype(tf32)::value>;
    reserve_shared<kernel>(smem, op);
    kernel<<<static_cast<unsigned>(p.count), kProdThreads, smem, s>>>(p);
  };
  if (p.tf32) launch(std::true_type{});
  else launch(std::false_type{});
  check_launch(op);
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
// In scalar fp32 FMAs both are FMA-bound at the floor; on tensor cores (3xTF32: ~3x the multiply-
// adds at ~7x the rate) the forward's floor is its bytes. The libtorch form they replace spends
// ~15 ms of elementwise passes and batched products on the same work (bench/notes/training.md).
// The additive mode (DeltaRulePrepareParams::additive: the gated linear family, no UT transform) keeps
// Q K^T alone (C^2 K FMAs) and writes U = V in fp32; its backward Q K^T again, dQ = P K and P^T Q
// (C^2 K each, P triangular) and dv = dU: both bound by their bytes (forward reads 2 C K + C V
// inputs and writes C (K + V + C) + K C floats; backward reads the five gradients and the inputs).
//
// Design. The forward's three products run on tensor cores (delta_rule_prepare_kernel says how), and
// so do all of the backward's (warp_product: mma.sync m16n8k8 with operands read from shared memory
// in either layout, 3xTF32, or TF32 with DeltaRulePrepareParams::tf32; one TF32 product for K K^T
// and Q K^T from bf16 inputs, exact): warp w owns rows 16 (w % 4) .. + 15 of each product and half
// of its columns, and the triangular operands' zero blocks are skipped. Rows sit 4 mod 16 floats
// apart in shared memory (tile_pitch, kMatPitch, kPanelPitch): the fragment reads A[g][t] of a
// row-major operand (and B[g][t] of a transposed one) then fall in 32 distinct banks, and the reads
// B[t][g] of the others in at most two ways (odd pitches put 8 x 4 such reads in up to four ways).
// T = (I + L)^{-1} is formed explicitly (one column per thread for 64 threads, its values in
// registers), so the UT transform is a product, T times the columns of [beta V | beta exp(G) K]
// streamed through shared memory in panels of 16 (v never staged whole: two blocks fit an SM), and
// the backward's dR = T^T dUW and dL = -T^T (dUW R^T) T^T are products too. Recomputed in the
// backward, not stored: L, T, K K^T and Q K^T (cheaper than reading them back: 4 C^2 floats a
// chunk-head against ~0.5 M FMAs). fp32 accuracy (3xTF32 where TF32 alone would round), as the GPU
// tests' fp32 tolerance asks, unless the caller asks for TF32 (DeltaRulePrepareParams::tf32).

namespace {

constexpr int kPrepChunk = 64;      // C
constexpr int kPrepMaxK = 128;      // the [C, K] tiles of q and k in shared memory
constexpr int kPrepThreads = 256;    // 8 warps
constexpr int kPrepPanel = 16;      // the backward's columns per panel; K and V multiples of it
constexpr int kMatPitch = kPrepChunk + 4;   // [C, C] matrices
constexpr int kPanelPitch = kPrepPanel + 4;  // the backward's panels

// The chunk's rows of q and k (fp32, rows P floats apart; zeros past the sequence), beta, and G the
// inclusive cumulative sum of g over the chunk (zeros without a gate). Ends with a barrier. q and k
// arrive in 16-byte loads, every load of a thread issued before the first is used (a load consumed
// before the next is issued costs one memory latency each: ~24 a thread at K 96).
template <typename In>
__device__ void load_chunk(const DeltaRulePrepareParams& p, int b, int h, int t0, int rows, int P, float* sQ,
                           float* sK, float* sB, float* sG) {
  constexpr int E = 16 / sizeof(In);                                 // elements a load
  constexpr int kLoads = kPrepChunk * kPrepMaxK / E / kPrepThreads;  // loads a thread and tensor, at most
  const int K = p.head_k, H = p.heads, T = p.seq, per_row = K / E;
  // The chunk's first row of each, then rows q_row (k_row) apart: 32-bit offsets within the chunk.
  const int64_t token0 = static_cast<int64_t>(b) * T + t0;
  const In* q = static_cast<const In*>(p.q) + token0 * p.q_row + int64_t{h} * K;
  const In* k = static_cast<const In*>(p.k) + token0 * p.k_row + int64_t{h} * K;
  const int q_row = static_cast<int>(p.q_row), k_row = static_cast<int>(p.k_row);
  uint4 rq[kLoads], rk[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int e = threadIdx.x + l * kPrepThreads, i = e / per_row, d = E * (e - i * per_row);
    rq[l] = i < rows ? __ldg(reinterpret_cast<const uint4*>(q + i * q_row + d)) : make_uint4(0, 0, 0, 0);
    rk[l] = i < rows ? __ldg(reinterpret_cast<const uint4*>(k + i * k_row + d)) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int e = threadIdx.x + l * kPrepThreads, i = e / per_row, d = E * (e - i * per_row);
    if (i >= kPrepChunk) break;
    float fq[E], fk[E];
    unpack16<In>(rq[l], fq);
    unpack16<In>(rk[l], fk);
#pragma unroll
    for (int x = 0; x < E; ++x) {
      sQ[i * P + d + x] = fq[x];
      sK[i * P + d + x] = fk[x];
    }
  }
  if (threadIdx.x < kPrepChunk) {
    const int i = threadIdx.x;
    const int64_t at = (static_cast<int64_t>(b) * T + t0 + i) * H + h;
    sB[i] = i < rows && p.beta ? p.beta[at] : 0.f;
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

// A panel is columns c0 .. c0 + kPrepPanel - 1 of the chunk's [V | K] rows; K and V are multiples
// of it, so a panel is all values or all keys. Thread tid holds its elements e = tid + kPrepThreads m
// (row e / kPrepPanel, column e % kPrepPanel). The value panels come from global memory: fetched a
// panel ahead into registers, so their loads are in flight during the panel before.
constexpr int kPanelLoads = kPrepChunk * kPrepPanel / kPrepThreads;
template <typename In>
__device__ __forceinline__ void fetch_values(const DeltaRulePrepareParams& p, int b, int h, int t0, int rows, int c0,
                                             float (&x)[kPanelLoads]) {
  const In* v = static_cast<const In*>(p.v) + (static_cast<int64_t>(b) * p.seq + t0) * p.v_row + int64_t{h} * p.head_v;
  const int v_row = static_cast<int>(p.v_row);
#pragma unroll
  for (int m = 0; m < kPanelLoads; ++m) {
    const int e = threadIdx.x + m * kPrepThreads, i = e / kPrepPanel, col = c0 + e % kPrepPanel;
    x[m] = c0 < p.head_v && i < rows ? to_float(v[i * v_row + col]) : 0.f;
  }
}
// The panel at c0 into sP (rows `pitch` floats apart): the fetched values times value_scale[i], or
// k (from sK, rows kp floats apart) times key_scale[i] (nullptr: 1) and, with a per-channel gate
// (key_gate: the chunk's G [C, K] in global memory, rows K apart), exp(key_gate[i][d]).
__device__ __forceinline__ void put_panel(const float (&x)[kPanelLoads], int V, int K, int c0, const float* sK,
                                          int kp, const float* value_scale, const float* key_scale,
                                          const float* key_gate, float* sP, int pitch) {
#pragma unroll
  for (int m = 0; m < kPanelLoads; ++m) {
    const int e = threadIdx.x + m * kPrepThreads, i = e / kPrepPanel, c = e % kPrepPanel;
    float y;
    if (c0 < V) {
      y = value_scale ? x[m] * value_scale[i] : x[m];
    } else {
      const int d = c0 + c - V;
      y = key_scale ? sK[i * kp + d] * key_scale[i] : sK[i * kp + d];
      if (key_gate) y *= __expf(key_gate[i * K + d]);
    }
    sP[i * pitch + c] = y;
  }
}

// Gradients in the inputs' dtype T: two (four) adjacent values at element `at` of `base`.
template <typename T>
__device__ __forceinline__ void store_pair(void* base, int64_t at, float a, float b) {
  if constexpr (std::is_same_v<T, float>) *reinterpret_cast<float2*>(static_cast<float*>(base) + at) = make_float2(a, b);
  else *reinterpret_cast<uint32_t*>(static_cast<T*>(base) + at) = pack2<T>(a, b);
}
template <typename T>
__device__ __forceinline__ void store_quad(void* base, int64_t at, float4 v) {
  if constexpr (std::is_same_v<T, float>) *reinterpret_cast<float4*>(static_cast<float*>(base) + at) = v;
  else *reinterpret_cast<uint2*>(static_cast<T*>(base) + at) = make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
}

// The tiles of q and k sit K + 4 floats apart (4 mod 16: ldmatrix's 8 rows in distinct banks), the
// forward's panel rows kFwdPanelPitch apart (8 mod 16: the B fragments' B[t][g] in distinct banks).
constexpr int kFwdPanelPitch = kPrepPanel + 8;
__host__ __device__ constexpr int tile_pitch(int K) { return K + 4; }

struct PrepareShared {  // offsets in floats
  int q, k, l, t, panel, g, beta, f, total;
};
__host__ __device__ inline PrepareShared prepare_shared(int K) {
  const int tile = kPrepChunk * tile_pitch(K), mat = kPrepChunk * kMatPitch;
  PrepareShared s{};
  s.q = 0;
  s.k = s.q + tile;
  s.l = s.k + tile;
  s.t = s.l + mat;
  s.panel = s.t + mat;
  s.g = s.panel + kPrepChunk * kFwdPanelPitch;
  s.beta = s.g + kPrepChunk;
  s.f = s.beta + kPrepChunk;
  s.total = s.f + kPrepChunk;
  return s;
}

// The forward's products run on tensor cores (m16n8k8 TF32): K K^T and Q K^T from bf16 inputs in
// one TF32 product each (a bf16 value is exact in TF32), from fp32 inputs in 3xTF32; T [V | K] in
// 3xTF32 (T and the scaled panel are arbitrary fp32), skipping T's zero blocks above the diagonal.
// With kTf32 (DeltaRulePrepareParams::tf32) every product is one TF32 product of rounded operands.
// Warp w owns rows 16 (w / 2) .. + 15 of each product: columns 32 (w % 2) .. + 31 of the [C, C]
// products, columns 8 (w % 2) .. + 7 of each panel.
// kChannel: one decay per key channel (p.channel_gate), a variant of its own so that the other gates'
// code keeps its registers.
template <typename In, bool kTf32, bool kChannel>
__global__ void __launch_bounds__(kPrepThreads, 2) delta_rule_prepare_kernel(const DeltaRulePrepareParams p) {
  constexpr int C = kPrepChunk;
  constexpr bool kExactInTf32 = !std::is_same_v<In, float>;  // bf16 q and k: one TF32 product is exact
  const int K = p.head_k, V = p.head_v, T = p.seq, H = p.heads, P = tile_pitch(K);
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = n * C, rows = min(C, T - t0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int mt = warp / 2, m0 = 16 * mt;  // the warp's rows
  const PrepareShared lay = prepare_shared(K);
  extern __shared__ __align__(16) float prep_smem[];
  float *sQ = prep_smem + lay.q, *sK = prep_smem + lay.k, *sL = prep_smem + lay.l, *sT = prep_smem + lay.t;
  float *sP = prep_smem + lay.panel, *sG = prep_smem + lay.g, *sB = prep_smem + lay.beta, *sF = prep_smem + lay.f;
  const bool delta = !p.additive;
  load_chunk<In>(p, b, h, t0, rows, P, sQ, sK, sB, sG);  // sG zeros with a per-channel gate
  if (tid < C) sF[tid] = sB[tid] * __expf(sG[tid]);
  const int64_t chunk = (static_cast<int64_t>(b) * H + h) * gridDim.x + n;
  // One decay per key channel: the chunk's G [C, K] (read where used: each element once or twice).
  const float* gate = kChannel ? p.channel_gate + chunk * C * K : nullptr;

  if (kChannel) {  // L = diag(beta) scores_kk from the given scores (A_qk is the caller's: scale scores_qk)
    if (delta) {
      const float* s_kk = p.scores_kk + chunk * C * C;
      for (int e = 4 * tid; e < C * C; e += 4 * kPrepThreads) {
        const int i = e / C, j = e - i * C;
        const float4 l = *reinterpret_cast<const float4*>(s_kk + e);
        const float lv[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
        for (int x = 0; x < 4; ++x) sL[i * kMatPitch + j + x] = j + x < i ? sB[i] * lv[x] : 0.f;
      }
    }
  } else {  // A_qk (global) and L (shared) from K K^T and Q K^T: the warp's four n-tiles from column n0.
    const int n0 = 32 * (warp % 2);
    // ldmatrix.x4 lanes: A's four matrices are rows (+ 8) x columns (+ 4); a B pair (two n-tiles of
    // K's rows) is rows x columns (+ 4), then the next 8 rows.
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 4 * (lane >> 4);
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_col = 4 * ((lane >> 3) & 1);
    float kk[4][4] = {}, qk[4][4] = {}, kk_lo[4][4] = {}, qk_lo[4][4] = {};
    for (int x = 0; x < K; x += 8) {
      uint32_t ak[4], aq[4], bk[2][4];
      ldmatrix_x4(ak, sK + (m0 + a_row) * P + x + a_col);
      ldmatrix_x4(aq, sQ + (m0 + a_row) * P + x + a_col);
      ldmatrix_x4(bk[0], sK + (n0 + b_row) * P + x + b_col);
      ldmatrix_x4(bk[1], sK + (n0 + 16 + b_row) * P + x + b_col);
      if constexpr (kExactInTf32) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t b0 = bk[q / 2][2 * (q % 2)], b1 = bk[q / 2][2 * (q % 2) + 1];
          if (delta) mma_tf32(kk[q], ak, b0, b1);
          mma_tf32(qk[q], aq, b0, b1);
        }
      } else if constexpr (kTf32) {
        round_fragment_tf32(ak);
        round_fragment_tf32(aq);
        round_fragment_tf32(bk[0]);
        round_fragment_tf32(bk[1]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t b0 = bk[q / 2][2 * (q % 2)], b1 = bk[q / 2][2 * (q % 2) + 1];
          if (delta) mma_tf32(kk[q], ak, b0, b1);
          mma_tf32(qk[q], aq, b0, b1);
        }
      } else {
        uint32_t k_big[4], k_small[4], q_big[4], q_small[4];
        split_fragment_tf32(ak, k_big, k_small);
        split_fragment_tf32(aq, q_big, q_small);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const SplitTf32 s0 = split_tf32(__uint_as_float(bk[q / 2][2 * (q % 2)]));
          const SplitTf32 s1 = split_tf32(__uint_as_float(bk[q / 2][2 * (q % 2) + 1]));
          if (delta) mma_3xtf32(kk[q], kk_lo[q], k_big, k_small, s0, s1);
          mma_3xtf32(qk[q], qk_lo[q], q_big, q_small, s0, s1);
        }
      }
    }
    if constexpr (!kExactInTf32 && !kTf32) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[q][e] += kk_lo[q][e], qk[q][e] += qk_lo[q][e];
    }
    float* A = p.a_qk + chunk * C * C;
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + g + 8 * r, j = n0 + 8 * q + 2 * t;
        float a[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float decay = j + e <= i ? __expf(sG[i] - sG[j + e]) : 0.f;
          a[e] = p.scale * qk[q][2 * r + e] * decay;
          sL[i * kMatPitch + j + e] = j + e < i ? sB[i] * kk[q][2 * r + e] * decay : 0.f;
        }
        *reinterpret_cast<float2*>(A + i * C + j) = make_float2(a[0], a[1]);
      }
  }
  // Q_start, Kt and carry (per channel: G [C, K], its last row G_l).
  const float g_last = sG[C - 1];
  float* Qs = p.q_start + chunk * C * K;
  for (int e = tid; e < C * K; e += blockDim.x) {
    const int i = e / K, d = e - i * K;
    Qs[e] = sQ[i * P + d] * __expf(gate ? gate[e] : sG[i]) * p.scale;
  }
  float* Kt = p.kt + chunk * K * C;
  for (int e = tid; e < K * C; e += blockDim.x) {
    const int d = e / C, i = e - d * C;
    Kt[e] = sK[i * P + d] * __expf(gate ? gate[(C - 1) * K + d] - gate[i * K + d] : g_last - sG[i]);
  }
  if (gate) {
    for (int d = tid; d < K; d += kPrepThreads) p.carry[chunk * K + d] = __expf(gate[(C - 1) * K + d]);
  } else if (tid == 0) {
    p.carry[chunk] = __expf(g_last);
  }
  if (!delta) {  // U = V: the value rows in fp32 (16-byte pieces), zeros past the sequence
    constexpr int E = 16 / sizeof(In);
    const In* v = static_cast<const In*>(p.v) + (static_cast<int64_t>(b) * T + t0) * p.v_row + int64_t{h} * V;
    const int v_row = static_cast<int>(p.v_row);
    float* U = p.u + chunk * C * V;
    const int per_row = V / E;
    for (int e = tid; e < C * per_row; e += kPrepThreads) {
      const int i = e / per_row, d = E * (e - i * per_row);
      float f[E] = {};
      if (i < rows) unpack16<In>(__ldg(reinterpret_cast<const uint4*>(v + i * v_row + d)), f);
#pragma unroll
      for (int x = 0; x < E; x += 4)
        *reinterpret_cast<float4*>(U + i * V + d + x) = make_float4(f[x], f[x + 1], f[x + 2], f[x + 3]);
    }
    return;
  }
  __syncthreads();
  unit_lower_inverse_block(sL, sT);
  __syncthreads();

  // [U | W] = T [beta V | beta exp(G) K], a panel of columns at a time. The warp's rows of T as A
  // fragments, held for every panel: k-step s covers T's columns 8 s .. 8 s + 7.
  const int k_steps = 2 * (mt + 1);  // T's columns past the warp's last row are zeros
  uint32_t ta[C / 8][4];  // raw, or rounded to TF32 with kTf32
  const auto operand = [](float x) { return kTf32 ? tf32_round(x) : __float_as_uint(x); };
#pragma unroll
  for (int s = 0; s < C / 8; ++s) {
    ta[s][0] = operand(sT[(m0 + g) * kMatPitch + 8 * s + t]);
    ta[s][1] = operand(sT[(m0 + g + 8) * kMatPitch + 8 * s + t]);
    ta[s][2] = operand(sT[(m0 + g) * kMatPitch + 8 * s + t + 4]);
    ta[s][3] = operand(sT[(m0 + g + 8) * kMatPitch + 8 * s + t + 4]);
  }
  const int pn0 = 8 * (warp % 2);  // the warp's columns of a panel
  float values[kPanelLoads];
  fetch_values<In>(p, b, h, t0, rows, 0, values);
  for (int c0 = 0; c0 < V + K; c0 += kPrepPanel) {
    __syncthreads();  // the panel before is consumed
    put_panel(values, V, K, c0, sK, P, sB, sF, gate, sP, kFwdPanelPitch);
    __syncthreads();
    if (c0 + kPrepPanel < V) fetch_values<In>(p, b, h, t0, rows, c0 + kPrepPanel, values);
    float hi[4] = {}, lo[4] = {};
#pragma unroll
    for (int s = 0; s < C / 8; ++s) {
      if (s >= k_steps) break;
      const float b0 = sP[(8 * s + t) * kFwdPanelPitch + pn0 + g], b1 = sP[(8 * s + t + 4) * kFwdPanelPitch + pn0 + g];
      if constexpr (kTf32) {
        mma_tf32(hi, ta[s], tf32_round(b0), tf32_round(b1));
      } else {
        uint32_t big[4], small[4];
        split_fragment_tf32(ta[s], big, small);
        mma_3xtf32(hi, lo, big, small, split_tf32(b0), split_tf32(b1));
      }
    }
    if constexpr (!kTf32) {
#pragma unroll
      for (int e = 0; e < 4; ++e) hi[e] += lo[e];
    }
    const int col = c0 + pn0 + 2 * t;  // a panel is all values or all keys
    float* out = c0 < V ? p.u + chunk * C * V + col : p.w + chunk * C * K + (col - V);
    const int pitch = c0 < V ? V : K;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(out + (m0 + g + 8 * r) * pitch) = make_float2(hi[2 * r], hi[2 * r + 1]);
  }
}

struct PrepareBackwardShared {  // offsets in floats
  int q, k, t, m, x, dp, rp, g, beta, exp_g, db, dg, total;
};
__host__ __device__ inline PrepareBackwardShared prepare_backward_shared(int K) {
  const int tile = kPrepChunk * tile_pitch(K), mat = kPrepChunk * kMatPitch, panel = kPrepChunk * kPanelPitch;
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
template <typename In, bool kTf32, bool kChannel>
__global__ void __launch_bounds__(kPrepThreads, 2)
    delta_rule_prepare_backward_kernel(const DeltaRulePrepareBackwardParams bp) {
  constexpr int C = kPrepChunk;
  const DeltaRulePrepareParams& p = bp.forward;
  const int K = p.head_k, V = p.head_v, T = p.seq, H = p.heads, P = tile_pitch(K);
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = n * C, rows = min(C, T - t0);
  const int tid = threadIdx.x;
  const PrepareBackwardShared lay = prepare_backward_shared(K);
  extern __shared__ __align__(16) float prep_bwd_smem[];
  float* const base = prep_bwd_smem;
  float *sQ = base + lay.q, *sK = base + lay.k, *sT = base + lay.t, *sM = base + lay.m, *sX = base + lay.x;
  float *sDP = base + lay.dp, *sRP = base + lay.rp, *sG = base + lay.g, *sB = base + lay.beta;
  float *sEG = base + lay.exp_g, *sDB = base + lay.db, *sDG = base + lay.dg;
  const bool delta = !p.additive;
  if (tid < C) sDB[tid] = sDG[tid] = 0.f;
  load_chunk<In>(p, b, h, t0, rows, P, sQ, sK, sB, sG);  // sG zeros with a per-channel gate: sEG ones
  if (tid < C) sEG[tid] = __expf(sG[tid]);
  const int64_t chunk = (static_cast<int64_t>(b) * H + h) * gridDim.x + n;
  // One decay per key channel: G [C, K] and its gradient's elementwise terms, both in global memory.
  const float* gate = kChannel ? p.channel_gate + chunk * C * K : nullptr;
  float* d_gate = kChannel ? bp.d_channel_gate + chunk * C * K : nullptr;
  auto token = [&](int i) { return (static_cast<int64_t>(b) * T + t0 + i) * H + h; };
  // Head h's part of row i of the chunk in a token-row tensor whose rows are `row` elements apart (at
  // most kMaxRow: 32-bit) and whose heads `width` wide. q's and k's gradients are written in their
  // inputs' layouts (dk_partial in k's), v's dv_row apart.
  auto at = [&](int i, int64_t row, int width) {
    return (static_cast<int64_t>(b) * T + t0 + i) * static_cast<int>(row) + h * width;
  };
  auto decay = [&](int i, int j) { return __expf(sG[i] - sG[j]); };

  // Warp w owns rows m0 .. m0 + 15 of every product; of a [C, C] product the columns of n-tiles
  // nsq .. nsq + 3 (warp_product's layout: for_square_entries visits them).
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, m0 = 16 * (warp % 4), nsq = 4 * (warp / 4);
  auto for_square_entries = [&](auto&& f) {  // f(j, r, e, i, col): entry [j][2 r + e] is (i, col)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) f(j, r, e, m0 + g + 8 * r, 8 * (nsq + j) + 2 * t + e);
  };
  constexpr bool kExactInTf32 = !std::is_same_v<In, float>;  // bf16 q and k: one TF32 product is exact

  // Additive (the gated linear family: T = I, no W, dv = dU): phases 1 to 4 reduce to dv and the
  // dA_qk terms (none per channel); kke and dS stay zero.
  float kke[4][4] = {}, ds[4][4] = {};
  if (!delta) {
    const float* du = bp.du + chunk * C * V;
    for (int e = tid; e < C * V / 4; e += kPrepThreads) {
      const int i = (4 * e) / V, c = 4 * e - i * V;
      if (i < rows) store_quad<In>(bp.dv, at(i, bp.dv_row, V) + c, *reinterpret_cast<const float4*>(du + 4 * e));
    }
  } else {
    // 1: kke = (K K^T) * decay below the diagonal (zeros elsewhere; per channel: the given scores_kk);
    // L = beta_i kke into sX.
    if (!gate) warp_product<4, kTf32 || kExactInTf32>(kke, sK, P, 1, sK, 1, P, m0, nsq, 4, 0, K);
    const float* s_kk = gate ? p.scores_kk + chunk * C * C : nullptr;
    for_square_entries([&](int j, int r, int e, int i, int col) {
      float& v = kke[j][2 * r + e];
      v = col >= i ? 0.f : gate ? s_kk[i * C + col] : v * decay(i, col);
      sX[i * kMatPitch + col] = sB[i] * v;
    });
    __syncthreads();

    // 2: T = (I + L)^{-1}.
    unit_lower_inverse_block(sX, sT);
    __syncthreads();

    // 3: the columns of [dU | dW] and of the raw [V | K] in panels. On tensor cores: warp w owns rows
    // 16 (w % 4) .. + 15 of M's [C, C] (columns 32 (w / 4) .. + 31) and of each panel's dR (columns
    // 8 (w / 4) .. + 7); T^T is upper triangular, so dR's product starts at row m0.
    const float* du = bp.du + chunk * C * V;
    const float* dw = bp.dw + chunk * C * K;
    float mv[4][4] = {}, mk[4][4] = {};  // sum_c dU_i[c] v_j[c] and sum_c dW_i[c] k_j[c]
    float row_db[2] = {}, row_w[2] = {};  // sum_c dR_V[i][c] v_i[c] and sum_c dR_W[i][c] k_i[c], rows m0 + g + 8 r
    // The panel's raw [V | K] columns and its [dU | dW] columns, fetched a panel ahead.
    float values[kPanelLoads], grads[kPanelLoads];
    auto fetch_grads = [&](int c0) {
  #pragma unroll
      for (int m = 0; m < kPanelLoads; ++m) {
        const int e = tid + m * kPrepThreads, i = e / kPrepPanel, col = c0 + e % kPrepPanel;
        grads[m] = col < V ? du[i * V + col] : dw[i * K + col - V];
      }
    };
    fetch_values<In>(p, b, h, t0, rows, 0, values);
    fetch_grads(0);
    for (int c0 = 0; c0 < V + K; c0 += kPrepPanel) {
      const bool value_panel = c0 < V;
      put_panel(values, V, K, c0, sK, P, nullptr, nullptr, gate, sRP, kPanelPitch);
  #pragma unroll
      for (int m = 0; m < kPanelLoads; ++m) {
        const int e = tid + m * kPrepThreads;
        sDP[(e / kPrepPanel) * kPanelPitch + e % kPrepPanel] = grads[m];
      }
      __syncthreads();
      if (c0 + kPrepPanel < V + K) {
        if (c0 + kPrepPanel < V) fetch_values<In>(p, b, h, t0, rows, c0 + kPrepPanel, values);
        fetch_grads(c0 + kPrepPanel);
      }
      // M += dUW_panel R_panel^T: A(i, x) = dP[i][x], B(x, j) = R[j][x].
      if (value_panel) warp_product<4, kTf32>(mv, sDP, kPanelPitch, 1, sRP, 1, kPanelPitch, m0, nsq, 4, 0, kPrepPanel);
      else warp_product<4, kTf32>(mk, sDP, kPanelPitch, 1, sRP, 1, kPanelPitch, m0, nsq, 4, 0, kPrepPanel);
      float dr[1][4] = {};  // dR[i][c0 + c] = sum_{j >= i} T[j][i] dUW[j][c0 + c]
      warp_product<1, kTf32>(dr, sT, 1, kMatPitch, sDP, kPanelPitch, 1, m0, warp / 4, 1, m0, C);
  #pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + g + 8 * r, c = 8 * (warp / 4) + 2 * t, col = c0 + c;
        const float x0 = sRP[i * kPanelPitch + c], x1 = sRP[i * kPanelPitch + c + 1];
        const float d0 = dr[0][2 * r], d1 = dr[0][2 * r + 1];
        if (value_panel) {
          if (i < rows) store_pair<In>(bp.dv, at(i, bp.dv_row, V) + col, sB[i] * d0, sB[i] * d1);
          row_db[r] = fmaf(d0, x0, fmaf(d1, x1, row_db[r]));
        } else {
          const int d = col - V;
          float2 key_scale = make_float2(sB[i] * sEG[i], sB[i] * sEG[i]);
          if (gate) {  // R = K * exp(G): dG gets beta dR_W * R here
            key_scale = make_float2(sB[i] * __expf(gate[i * K + d]), sB[i] * __expf(gate[i * K + d + 1]));
            *reinterpret_cast<float2*>(d_gate + i * K + d) = make_float2(sB[i] * d0 * x0, sB[i] * d1 * x1);
          }
          if (i < rows)
            *reinterpret_cast<float2*>(bp.dk_partial + at(i, p.k_row, K) + d) =
                make_float2(key_scale.x * d0, key_scale.y * d1);
          row_w[r] = fmaf(d0, x0, fmaf(d1, x1, row_w[r]));
        }
      }
      __syncthreads();
    }
  #pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = m0 + g + 8 * r;
      float db = row_db[r], w = row_w[r];
  #pragma unroll
      for (int o = 1; o < 4; o <<= 1) {  // over the 4 lanes t of row g; the two warps of a row add atomically
        db += __shfl_xor_sync(0xffffffffu, db, o);
        w += __shfl_xor_sync(0xffffffffu, w, o);
      }
      if (t == 0) {
        atomicAdd(sDB + i, db + sEG[i] * w);
        atomicAdd(sDG + i, sB[i] * sEG[i] * w);
      }
    }

    // 4: M = dUW R^T into sM, X = T^T M into sX, dL = -(X T^T) below the diagonal.
    for_square_entries([&](int j, int r, int e, int i, int col) {
      sM[i * kMatPitch + col] = sB[col] * (mv[j][2 * r + e] + sEG[col] * mk[j][2 * r + e]);
    });
    __syncthreads();
    {
      float x[4][4] = {};  // T^T M: T^T is upper triangular, rows x >= i
      warp_product<4, kTf32>(x, sT, 1, kMatPitch, sM, kMatPitch, 1, m0, nsq, 4, m0, C);
      for_square_entries([&](int j, int r, int e, int i, int col) { sX[i * kMatPitch + col] = x[j][2 * r + e]; });
    }
    __syncthreads();
    warp_product<4, kTf32>(ds, sX, kMatPitch, 1, sT, 1, kMatPitch, m0, nsq, 4, 0, C);  // X T^T
  }
  // Per channel dA_qk is the caller's (A_qk is its scaled scores) and scores_kk's gradient leaves as it is
  // (the dG and dq, dk terms they give are ops::decayed_scores'): the sums below over qk and the products
  // of phase 5 are skipped.
  float pq[4][4] = {}, qk[4][4] = {};
  if (!gate) warp_product<4, kTf32 || kExactInTf32>(qk, sQ, P, 1, sK, 1, P, m0, nsq, 4, 0, K);
  const float* dA = kChannel ? nullptr : bp.da_qk + chunk * C * C;
  float* d_kk = gate && delta ? bp.d_scores_kk + chunk * C * C : nullptr;
  float row_g[2] = {}, row_b[2] = {}, col_g[4][2] = {};
  for_square_entries([&](int j, int r, int e, int i, int col) {
    const int at = 2 * r + e;
    const float decayed = col <= i ? decay(i, col) : 0.f;
    const float dl = col < i ? -ds[j][at] : 0.f;
    const float da = !kChannel && col <= i ? dA[i * C + col] : 0.f;
    const float w = dl * sB[i] * kke[j][at] + da * p.scale * qk[j][at] * decayed;  // dL L + dA A
    row_b[r] = fmaf(dl, kke[j][at], row_b[r]);
    row_g[r] += w;
    col_g[j][e] -= w;
    ds[j][at] = sB[i] * dl * decayed;
    pq[j][at] = p.scale * da * decayed;
    if (d_kk) d_kk[i * C + col] = sB[i] * dl;
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // a row's sums: over its 4 lanes t here, over its two warps by atomics
    float dg = row_g[r], db = row_b[r];
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      dg += __shfl_xor_sync(0xffffffffu, dg, o);
      db += __shfl_xor_sync(0xffffffffu, db, o);
    }
    if (t == 0) {
      atomicAdd(sDG + m0 + g + 8 * r, dg);
      atomicAdd(sDB + m0 + g + 8 * r, db);
    }
  }
  if (!gate) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // a column's: over the 8 lanes g here, over the four warps of its rows by atomics
        float c = col_g[j][e];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
        if (g == 0) atomicAdd(sDG + 8 * (nsq + j) + 2 * t + e, c);
      }
  }
  // Per channel: G_l's terms, summed over the rows into sLast [K] (the panel space, free since phase 3).
  float* sLast = sDP;
  if (gate)
    for (int d = tid; d < K; d += kPrepThreads) sLast[d] = 0.f;
  __syncthreads();
  if (!gate)  // phase 5's products read dS and P
    for_square_entries([&](int j, int r, int e, int i, int col) {
      sX[i * kMatPitch + col] = ds[j][2 * r + e];
      sM[i * kMatPitch + col] = pq[j][2 * r + e];
    });
  __syncthreads();

  // 5: dQ = P K + scale exp(G) dQ_start; dK = (dS + dS^T) K + P^T Q + dKt^T exp(G_l - G) + the
  // partial from phase 3; and the row terms of dG they carry. On tensor cores: warp w owns rows
  // 16 (w % 4) .. + 15 and half the key columns (w / 4); P and dS are lower triangular (P with its
  // diagonal), so the products skip their zero blocks: rows x <= i for P K and dS K, x >= i for the
  // transposed ones.
  {
    constexpr int kTiles = kPrepMaxK / 16;  // n-tiles a warp, at most
    const int tiles = K / 16, nt0 = (warp / 4) * tiles;
    const float* dQs = bp.dq_start + chunk * C * K;
    const float* dKt = bp.dkt + chunk * K * C;
    const float g_last = sG[C - 1];
    // f(j, r, i, c) at the thread's accumulator entries: n-tile j, row half r, row i, columns c, c + 1.
    auto for_entries = [&](auto&& f) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          if (j >= tiles) break;
          f(j, r, m0 + g + 8 * r, 8 * (nt0 + j) + 2 * t);
        }
    };
    float row_q[2] = {}, row_z[2] = {};
    {  // dq, one product at a time: two accumulator sets would spill
      float acc[kTiles][4] = {};
      if (!gate) warp_product<kTiles, kTf32>(acc, sM, kMatPitch, 1, sK, P, 1, m0, nt0, tiles, 0, m0 + 16);
      for_entries([&](int j, int r, int i, int c) {
        const float2 dqs = *reinterpret_cast<const float2*>(dQs + i * K + c);
        float2 e = make_float2(p.scale * sEG[i], p.scale * sEG[i]);
        if (gate) {  // dG += scale exp(G) * dQ_start * Q, onto phase 3's term
          e = make_float2(p.scale * __expf(gate[i * K + c]), p.scale * __expf(gate[i * K + c + 1]));
          float2* dg = reinterpret_cast<float2*>(d_gate + i * K + c);
          const float2 prior = delta ? *dg : make_float2(0.f, 0.f);
          *dg = make_float2(fmaf(e.x * dqs.x, sQ[i * P + c], prior.x), fmaf(e.y * dqs.y, sQ[i * P + c + 1], prior.y));
        } else {
          row_q[r] = fmaf(dqs.x, sQ[i * P + c], fmaf(dqs.y, sQ[i * P + c + 1], row_q[r]));
        }
        if (i < rows)
          store_pair<In>(bp.dq, at(i, p.q_row, K) + c, acc[j][2 * r] + e.x * dqs.x, acc[j][2 * r + 1] + e.y * dqs.y);
      });
    }
    {
      float acc[kTiles][4] = {};
      if (delta && !gate) {
        warp_product<kTiles, kTf32>(acc, sX, kMatPitch, 1, sK, P, 1, m0, nt0, tiles, 0, m0 + 16);
        warp_product<kTiles, kTf32>(acc, sX, 1, kMatPitch, sK, P, 1, m0, nt0, tiles, m0, C);
      }
      if (!gate) warp_product<kTiles, kTf32>(acc, sM, 1, kMatPitch, sQ, P, 1, m0, nt0, tiles, m0, C);
      for_entries([&](int j, int r, int i, int c) {
        float2 to_last = make_float2(__expf(g_last - sG[i]), __expf(g_last - sG[i]));
        if (gate)
          to_last = make_float2(__expf(gate[(C - 1) * K + c] - gate[i * K + c]),
                                __expf(gate[(C - 1) * K + c + 1] - gate[i * K + c + 1]));
        const float dkt0 = dKt[c * C + i] * to_last.x, dkt1 = dKt[(c + 1) * C + i] * to_last.y;
        if (gate) {  // dG_i -= z, dG_l += z summed over the rows
          const float z0 = dkt0 * sK[i * P + c], z1 = dkt1 * sK[i * P + c + 1];
          float2* dg = reinterpret_cast<float2*>(d_gate + i * K + c);
          const float2 prior = *dg;
          *dg = make_float2(prior.x - z0, prior.y - z1);
          atomicAdd(sLast + c, z0);
          atomicAdd(sLast + c + 1, z1);
        } else {
          row_z[r] = fmaf(dkt0, sK[i * P + c], fmaf(dkt1, sK[i * P + c + 1], row_z[r]));
        }
        if (i < rows) {
          const float2 partial =  // phase 3's
              delta ? *reinterpret_cast<const float2*>(bp.dk_partial + at(i, p.k_row, K) + c) : make_float2(0.f, 0.f);
          store_pair<In>(bp.dk, at(i, p.k_row, K) + c, partial.x + acc[j][2 * r] + dkt0, partial.y + acc[j][2 * r + 1] + dkt1);
        }
      });
    }
    float last = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = m0 + g + 8 * r;
      float q = row_q[r], z = row_z[r];
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {  // over the 4 lanes t of row g
        q += __shfl_xor_sync(0xffffffffu, q, o);
        z += __shfl_xor_sync(0xffffffffu, z, o);
      }
      last += z;
      if (t == 0) atomicAdd(sDG + i, p.scale * sEG[i] * q - z);
    }
    if (t == 0) atomicAdd(sDG + C - 1, last);
    if (gate) {
      for (int d = tid; d < K; d += kPrepThreads)
        atomicAdd(sLast + d, bp.dcarry[chunk * K + d] * __expf(gate[(C - 1) * K + d]));
    } else if (tid == 0) {
      atomicAdd(sDG + C - 1, bp.dcarry[chunk] * __expf(g_last));
    }
  }
  __syncthreads();
  if (gate)
    for (int d = tid; d < K; d += kPrepThreads) d_gate[(C - 1) * K + d] += sLast[d];

  // 6: dbeta, and dg_i = sum_{s >= i} dG_s (G is g's inclusive cumulative sum over the chunk).
  if (tid < C && tid < rows) {
    if (bp.dbeta) bp.dbeta[token(tid)] = sDB[tid];
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

constexpr int64_t kMaxRow = INT32_MAX / kPrepChunk;  // a chunk's row offsets are 32-bit

void check_prepare(const DeltaRulePrepareParams& p, const char* op) {
  LT2_CHECK(prepare_dims_in_bounds(p.head_k, p.head_v, p.chunk_size), op, ": needs C ", kPrepChunk,
            ", K and V multiples of ", kPrepPanel, " with K <= ", kPrepMaxK, ", found K ", p.head_k, ", V ",
            p.head_v, ", C ", p.chunk_size);
  LT2_CHECK(p.batch >= 0 && p.heads >= 0 && p.seq >= 0 && p.batch <= 65535 && p.heads <= 65535, op, ": batch ",
            p.batch, " and heads ", p.heads, " must be in [0, 65535], seq ", p.seq, " >= 0");
  LT2_CHECK(p.dtype == DType::Float32 || p.dtype == DType::BFloat16, op, ": q, k and v must be fp32 or bf16");
  const int64_t bytes = p.dtype == DType::BFloat16 ? 2 : 4;
  LT2_CHECK(p.q_row >= int64_t{p.heads} * p.head_k && p.k_row >= int64_t{p.heads} * p.head_k &&
                p.v_row >= int64_t{p.heads} * p.head_v && p.q_row <= kMaxRow && p.k_row <= kMaxRow &&
                p.v_row <= kMaxRow,
            op, ": q_row and k_row must be in [heads x head_k, ", kMaxRow, "] and v_row in [heads x head_v, ",
            kMaxRow, "], found ", p.q_row, ", ", p.k_row, " and ", p.v_row);
  LT2_CHECK(aligned16(p.q) && aligned16(p.k) && p.q_row * bytes % 16 == 0 && p.k_row * bytes % 16 == 0 &&
                (!p.additive || (aligned16(p.v) && p.v_row * bytes % 16 == 0)),
            op, ": q's and k's rows (and v's in the additive mode) must start 16-byte aligned (they are read in "
            "16-byte loads)");
}

// A per-channel gate comes with scores_kk (unless additive), without g and without A_qk (the caller's);
// the score blocks are read in 16-byte pieces.
void check_channel_gate(const DeltaRulePrepareParams& p, const char* op) {
  if (!p.channel_gate) {
    LT2_CHECK(!p.scores_kk, op, ": scores_kk is given only with channel_gate");
    return;
  }
  LT2_CHECK(!p.g && !p.a_qk && p.additive == !p.scores_kk, op,
            ": channel_gate takes scores_kk exactly unless additive, no g and no a_qk");
  LT2_CHECK(!p.scores_kk || aligned16(p.scores_kk), op, ": scores_kk must be 16-byte aligned");
}

// ---------------------------------------------------------------------------------------------
// delta_rule_output_backward (prefill.h): the chunk outputs' four gradients for every chunk-head.
//
// Floor. Per chunk-head it reads dO [C, V] (the output dtype, token layout), Q_n [C, K], S_n [K, V],
// A_n [C, C] and V_n [C, V] in fp32, writes dQ_n, dS_n, dA_n and dV_n in fp32 and does
// 2 C K V + C^2 V multiply-adds (A_n and dA_n causal): at the 1.3B GDN head (K 96, V 192, C 64) 172
// KiB read (dO in bf16), 172 KiB written, 3.1 M multiply-adds. The 8 x 4096 layer's 8,192 chunk-heads
// move 2.9 GB (~0.9 ms at ~3.3 TB/s); their 26 G multiply-adds are ~0.1 ms in TF32. As four batched
// GEMMs (the libtorch form) the step also copies dO into fp32 chunks and writes dA's upper half.
//
// Design. Grid (N, H, B), 8 warps; the value columns stream through in panels of 16 (two stages):
// dO's panel (converted to fp32 through registers, fetched a panel ahead), S_n's and V_n's by
// cp.async. Per panel, on tensor cores (warp_product: 3xTF32, or one TF32 product with `tf32`):
// dQ += dO_p S_p^T and dA += dO_p V_p^T accumulate in registers (warp w: rows 16 (w % 4) .. + 15,
// half the columns; dA's blocks above the diagonal skipped), while dS_p = Q^T dO_p (warp w: rows
// 16 w .. + 15) and dV_p = A^T dO_p (A^T upper triangular: rows x >= i) are written at once.
// Requirements: C 64, K a multiple of 16 up to 128, V a multiple of 16.

constexpr int kOutBwdPanel = 16;
constexpr int kOutBwdPanelPitch = kOutBwdPanel + 4;  // 20: the A-side reads' 8 rows in distinct banks
constexpr int kOutBwdMaxK = 128;

struct OutputBackwardShared {  // offsets and pitches in floats
  int pq, pa;                  // row pitches of Q_n and A_n
  int q, a, stages, stage_size, d_o, s, v, total;  // stage i at stages + i stage_size: dO, S and V panels
};
__host__ __device__ inline OutputBackwardShared output_backward_shared(int K) {
  OutputBackwardShared l{};
  l.pq = K + 4;
  l.pa = kOutChunk + 4;
  l.q = 0;
  l.a = l.q + kOutChunk * l.pq;
  l.stages = l.a + kOutChunk * l.pa;
  l.d_o = 0;
  l.s = l.d_o + kOutChunk * kOutBwdPanelPitch;
  l.v = l.s + K * kOutBwdPanelPitch;
  l.stage_size = l.v + kOutChunk * kOutBwdPanelPitch;
  l.total = l.stages + 2 * l.stage_size;
  return l;
}

bool output_backward_dims_in_bounds(int K, int V, int C) {
  return C == kOutChunk && K >= 16 && K <= kOutBwdMaxK && K % 16 == 0 && V >= 16 && V % 16 == 0;
}

template <typename In, bool kTf32>
__global__ void __launch_bounds__(kThreads, 2)
    delta_rule_output_backward_kernel(const DeltaRuleOutputBackwardParams bp) {
  constexpr int C = kOutChunk, P = kOutBwdPanel, PP = kOutBwdPanelPitch, kMaxKTiles = kOutBwdMaxK / 8 / 2;
  constexpr int E = 16 / sizeof(In);                          // dO elements a 16-byte piece
  constexpr int kPieces = ceil_div(C * P / E, kThreads);      // dO pieces a thread fetches a panel
  const DeltaRuleOutputParams& p = bp.forward;
  const int K = p.head_k, V = p.head_v, T = p.seq, H = p.heads;
  const int n = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = n * C, rows = min(C, T - t0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int mt = warp % 4, m0 = 16 * mt, half = warp / 4;
  const OutputBackwardShared lay = output_backward_shared(K);
  extern __shared__ __align__(16) float out_bwd_smem[];
  const float *sQ = out_bwd_smem + lay.q, *sA = out_bwd_smem + lay.a;
  const int64_t chunk = (static_cast<int64_t>(b) * H + h) * gridDim.x + n;
  const float* state = p.states + chunk * K * V;
  const float* v_new = p.v_new + chunk * C * V;
  const In* d_out = static_cast<const In*>(bp.dout) + ((static_cast<int64_t>(b) * T + t0) * H + h) * V;
  const int panels = V / P;
  auto stage = [&](int i) { return out_bwd_smem + lay.stages + (i % 2) * lay.stage_size; };

  // dO's panel at column c0 into registers (rows past the sequence: zeros), then into a stage in fp32.
  uint4 fetched[kPieces];
  auto fetch_d_out = [&](int c0) {
#pragma unroll
    for (int m = 0; m < kPieces; ++m) {
      const int e = threadIdx.x + m * kThreads, i = e / (P / E), c = E * (e % (P / E));
      fetched[m] = e < C * P / E && i < rows
                       ? __ldg(reinterpret_cast<const uint4*>(d_out + static_cast<int64_t>(i) * H * V + c0 + c))
                       : make_uint4(0, 0, 0, 0);
    }
  };
  auto put_d_out = [&](float* dst) {
#pragma unroll
    for (int m = 0; m < kPieces; ++m) {
      const int e = threadIdx.x + m * kThreads, i = e / (P / E), c = E * (e % (P / E));
      if (e >= C * P / E) break;
      float f[E];
      unpack16<In>(fetched[m], f);
#pragma unroll
      for (int x = 0; x < E; x += 4)
        *reinterpret_cast<float4*>(dst + i * PP + c + x) = make_float4(f[x], f[x + 1], f[x + 2], f[x + 3]);
    }
  };
  const RowCopy copy_panel = plan_row_copy(P);
  auto load_panels = [&](int i) {  // S_n's and V_n's columns of panel i into its stage, one group
    float* st = stage(i);
    for (int r = copy_panel.row0; r < K; r += copy_panel.row_step)
      cp_async16(st + lay.s + r * PP + copy_panel.col, state + int64_t{r} * V + P * i + copy_panel.col);
    for (int r = copy_panel.row0; r < C; r += copy_panel.row_step)
      cp_async16(st + lay.v + r * PP + copy_panel.col, v_new + int64_t{r} * V + P * i + copy_panel.col);
    cp_async_commit();
  };

  copy_rows_async(plan_row_copy(K), out_bwd_smem + lay.q, lay.pq, p.q_start + chunk * C * K, C, K);
  copy_rows_async(plan_row_copy(C), out_bwd_smem + lay.a, lay.pa, p.a_qk + chunk * C * C, C, C);
  cp_async_commit();
  load_panels(0);
  fetch_d_out(0);

  const int k_tiles = K / 16, nq0 = half * k_tiles;              // the warp's n-tiles of dQ [C, K]
  const int na0 = 4 * half, a_tiles = max(0, min(4, 2 * mt + 2 - na0));  // of dA [C, C], at or below the diagonal
  float dq[kMaxKTiles][4] = {}, da[4][4] = {};
  for (int i = 0; i < panels; ++i) {
    float* st = stage(i);
    put_d_out(st + lay.d_o);  // its stage was last read before the barrier closing panel i - 2
    if (i + 1 < panels) {
      load_panels(i + 1);
      fetch_d_out(P * (i + 1));
      cp_async_wait<1>();  // all but panel i + 1's group: Q_n, A_n and panel i landed (this thread's)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float *sD = st + lay.d_o, *sS = st + lay.s, *sV = st + lay.v;
    // dQ += dO_p S_p^T: A(i, x) = dO[i][x], B(x, k) = S[k][x].
    warp_product<kMaxKTiles, kTf32>(dq, sD, PP, 1, sS, 1, PP, m0, nq0, k_tiles, 0, P);
    // dA += dO_p V_p^T: B(x, j) = V[j][x].
    warp_product<4, kTf32>(da, sD, PP, 1, sV, 1, PP, m0, na0, a_tiles, 0, P);
    const int col0 = P * i;
    if (16 * warp < K) {  // dS_p = Q^T dO_p: A(k, x) = Q[x][k], B(x, c) = dO[x][c]
      float ds[2][4] = {};
      warp_product<2, kTf32>(ds, sQ, 1, lay.pq, sD, PP, 1, 16 * warp, 0, 2, 0, C);
      float* out = bp.dstates + chunk * K * V + col0;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<float2*>(out + int64_t{16 * warp + g + 8 * r} * V + 8 * j + 2 * t) =
              make_float2(ds[j][2 * r], ds[j][2 * r + 1]);
    }
    {  // dV_p = A^T dO_p: A(i, x) = A[x][i], zero for x < i; the warp's n-tile `half`
      float dv[1][4] = {};
      warp_product<1, kTf32>(dv, sA, 1, lay.pa, sD, PP, 1, m0, half, 1, m0, C);
      float* out = bp.dv_new + chunk * C * V + col0;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<float2*>(out + int64_t{m0 + g + 8 * r} * V + 8 * half + 2 * t) =
            make_float2(dv[0][2 * r], dv[0][2 * r + 1]);
    }
    __syncthreads();  // the stage is free for panel i + 2
  }
  float* dq_out = bp.dq_start + chunk * C * K;
#pragma unroll
  for (int j = 0; j < kMaxKTiles; ++j) {
    if (j >= k_tiles) break;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(dq_out + (m0 + g + 8 * r) * K + 8 * (nq0 + j) + 2 * t) =
          make_float2(dq[j][2 * r], dq[j][2 * r + 1]);
  }
  float* da_out = bp.da_qk + chunk * C * C;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = m0 + g + 8 * r, c = 8 * (na0 + j) + 2 * t;
      const bool kept = j < a_tiles;  // tiles past the diagonal and entries above it: zeros
      *reinterpret_cast<float2*>(da_out + i * C + c) =
          make_float2(kept && c <= i ? da[j][2 * r] : 0.f, kept && c + 1 <= i ? da[j][2 * r + 1] : 0.f);
    }
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
  LT2_CHECK(p.q && p.k && p.v && (p.additive || (p.beta && p.w)) && p.u && p.kt && p.carry && p.q_start &&
                (p.a_qk || p.channel_gate),
            "delta_rule_prepare: every pointer but g (beta and w in the additive mode, a_qk with channel_gate) must "
            "be given");
  check_channel_gate(p, "delta_rule_prepare");
  const size_t smem = sizeof(float) * prepare_shared(p.head_k).total;
  const dim3 grid(chunks, p.heads, p.batch);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype_tf32(p.dtype, p.tf32, [&](auto in, auto tf32) {
    auto launch = [&](auto channel) {
      constexpr auto kernel = delta_rule_prepare_kernel<decltype(in), decltype(tf32)::value, decltype(channel)::value>;
      reserve_shared<kernel>(smem, "delta_rule_prepare");
      kernel<<<grid, kPrepThreads, smem, s>>>(p);
    };
    if (p.channel_gate) launch(std::true_type{});
    else launch(std::false_type{});
  });
  check_launch("delta_rule_prepare");
}

void delta_rule_prepare_backward(const DeltaRulePrepareBackwardParams& bp, void* stream) {
  const DeltaRulePrepareParams& p = bp.forward;
  check_prepare(p, "delta_rule_prepare_backward");
  const int chunks = ceil_div(p.seq, kPrepChunk);
  if (p.batch == 0 || p.heads == 0 || chunks == 0) return;
  LT2_CHECK(p.q && p.k && p.v && (p.additive || (p.beta && bp.dw && bp.dbeta && bp.dk_partial)) && bp.du && bp.dkt &&
                bp.dcarry &&
                bp.dq_start && (bp.da_qk != nullptr) == !p.channel_gate && bp.dq && bp.dk && bp.dv &&
                (bp.dg != nullptr) == (p.g != nullptr),
            "delta_rule_prepare_backward: every pointer must be given (dg exactly when g is; beta, dw and dbeta "
            "not in the additive mode; da_qk exactly without channel_gate)");
  check_channel_gate(p, "delta_rule_prepare_backward");
  LT2_CHECK(bp.dv_row >= int64_t{p.heads} * p.head_v && bp.dv_row <= kMaxRow && bp.dv_row % 4 == 0,
            "delta_rule_prepare_backward: dv_row must be a multiple of 4 in [heads x head_v, ", kMaxRow, "], found ",
            bp.dv_row);
  LT2_CHECK((bp.d_channel_gate != nullptr) == (p.channel_gate != nullptr) &&
                (bp.d_scores_kk != nullptr) == (p.channel_gate && !p.additive),
            "delta_rule_prepare_backward: d_channel_gate exactly with channel_gate, d_scores_kk with it unless "
            "additive");
  int device = 0;
  cudaGetDevice(&device);
  const size_t smem = sizeof(float) * prepare_backward_shared(p.head_k).total;
  LT2_CHECK(smem <= max_shared_bytes(device), "delta_rule_prepare_backward: K ", p.head_k, " needs ", smem,
            " bytes of shared memory, the device gives ", max_shared_bytes(device));
  const dim3 grid(chunks, p.heads, p.batch);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype_tf32(p.dtype, p.tf32, [&](auto in, auto tf32) {
    auto launch = [&](auto channel) {
      constexpr auto kernel =
          delta_rule_prepare_backward_kernel<decltype(in), decltype(tf32)::value, decltype(channel)::value>;
      reserve_shared<kernel>(smem, "delta_rule_prepare_backward");
      kernel<<<grid, kPrepThreads, smem, s>>>(bp);
    };
    if (p.channel_gate) launch(std::true_type{});
    else launch(std::false_type{});
  });
  check_launch("delta_rule_prepare_backward");
}

bool delta_rule_output_backward_supported(int head_k, int head_v, int chunk_size, int device) {
  return output_backward_dims_in_bounds(head_k, head_v, chunk_size) &&
         sizeof(float) * static_cast<size_t>(output_backward_shared(head_k).total) <= max_shared_bytes(device);
}

void delta_rule_output_backward(const DeltaRuleOutputBackwardParams& bp, void* stream) {
  const char* op = "delta_rule_output_backward";
  const DeltaRuleOutputParams& p = bp.forward;
  LT2_CHECK(output_backward_dims_in_bounds(p.head_k, p.head_v, p.chunk_size), op, ": needs C ", kOutChunk,
            ", K a multiple of 16 in [16, ", kOutBwdMaxK, "] and V a multiple of 16, found K ", p.head_k, ", V ",
            p.head_v, ", C ", p.chunk_size);
  LT2_CHECK(p.batch >= 0 && p.heads >= 0 && p.seq >= 0 && p.batch <= 65535 && p.heads <= 65535, op, ": batch ",
            p.batch, " and heads ", p.heads, " must be in [0, 65535], seq ", p.seq, " >= 0");
  LT2_CHECK(p.dtype == DType::Float32 || p.dtype == DType::BFloat16, op, ": dout must be fp32 or bf16");
  const int chunks = ceil_div(p.seq, kOutChunk);
  if (p.batch == 0 || p.heads == 0 || chunks == 0) return;
  LT2_CHECK(p.q_start && p.states && p.a_qk && p.v_new && bp.dout && bp.dq_start && bp.dstates && bp.da_qk &&
                bp.dv_new,
            op, ": every pointer but forward.out must be given");
  LT2_CHECK(aligned16(p.q_start) && aligned16(p.states) && aligned16(p.a_qk) && aligned16(p.v_new) &&
                aligned16(bp.dout) && aligned16(bp.dq_start) && aligned16(bp.dstates) && aligned16(bp.da_qk) &&
                aligned16(bp.dv_new),
            op, ": every tensor must be 16-byte aligned");
  int device = 0;
  cudaGetDevice(&device);
  const size_t smem = sizeof(float) * output_backward_shared(p.head_k).total;
  LT2_CHECK(smem <= max_shared_bytes(device), op, ": K ", p.head_k, " needs ", smem,
            " bytes of shared memory, the device gives ", max_shared_bytes(device));
  const dim3 grid(chunks, p.heads, p.batch);
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype_tf32(p.dtype, p.tf32, [&](auto in, auto tf32) {
    constexpr auto kernel = delta_rule_output_backward_kernel<decltype(in), decltype(tf32)::value>;
    reserve_shared<kernel>(smem, op);
    kernel<<<grid, kThreads, smem, s>>>(bp);
  });
  check_launch(op);
}

}  // namespace lt2::kernels
