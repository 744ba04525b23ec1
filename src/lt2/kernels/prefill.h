// CUDA kernels for the prefill hot path (many tokens per sequence), in the style of decode.h: a
// params struct per kernel, a launcher, plain kernels in kernels/cuda/. No libtorch here (the
// tensor binding is ops::chunk_state_scan in ops/delta_rule/delta_rule.h). Pointers are device
// pointers to packed (contiguous) fp32 tensors. The launchers enqueue on `stream` (a cudaStream_t)
// and never synchronise, allocate or read device memory on the host.
#pragma once
#include <cstdint>

#include "lt2/kernels/decode.h"  // DType

namespace lt2::kernels {

// Bounds of delta_rule_scan's shapes (the state slice and the chunk's matrices sit in shared memory).
constexpr int kMaxScanHeadK = 256;  // key head dim K: a multiple of 4 in [4, 256]
constexpr int kMaxScanChunk = 64;   // chunk size C: a multiple of 4 in [4, 64]
// The value head dim V: any multiple of 8 (a block owns 8, 16 or 32 value columns of S).

// The inter-chunk recurrence of the chunked delta rule (ops::chunk_state_scan), all N chunks of
// every (sequence, head) in one launch; S [K, V] per (sequence, head), fp32:
//   for n = 0 .. N-1 (or N-1 .. 0 when `reverse`):
//     S     = reset_states[resets[n]]            // where resets[n] >= 0 (zeros without reset_states)
//     S_n   = S                                  // the state entering chunk n, stored
//     V_n   = U_n - W_n S                        // [C, V], stored
//     S     = carry_n * S + Kt_n V_n (+ Y_n)     // carry_n: one scalar, or one per key channel (row of S)
// The forward pass runs it with the UT transform's W, U and the keys decayed to the chunk end; the
// backward pass runs the same recurrence in reverse for the state gradients (ops/delta_rule: the
// adjoint's W is -Kt^T, its Kt is -W^T, its addend the gradient flowing into each S_n). The gated
// linear family (no delta-rule correction) runs it without W, and its adjoint without Kt.
// Every pointer below: fp32, packed in the order of its shape comment, 16-byte aligned.
struct DeltaRuleScanParams {
  const float* w;      // [B, H, N, C, K], or nullptr: V_n = U_n (then v_new is nullptr: U is V_n)
  const float* u;      // [B, H, N, C, V]
  const float* kt;     // [B, H, N, K, C], or nullptr: no write (S = carry_n * S + Y_n)
  const float* carry;  // [B, H, N, K] when per_channel_carry, else [B, H, N]: the chunk's decay of S
  const float* addend;         // [B, H, N, K, V] Y_n, or nullptr for none
  // Packed documents (batch 1): resets[n] >= 0 restarts S at chunk n from reset_states[resets[n]]
  // (zeros when reset_states is nullptr); -1 continues. nullptr: no resets.
  const int* resets;           // [N] int32
  const float* reset_states;   // [D, H, K, V]
  const float* initial_state;  // [B, H, K, V], or nullptr for zeros
  float* states;               // [B, H, N, K, V]: S_n
  float* v_new;                // [B, H, N, C, V]: V_n (with w; nullptr without)
  float* final_state;          // [B, H, K, V]: S after the last chunk (may alias initial_state)
  int batch, heads, chunks, chunk_size, head_k, head_v;
  bool per_channel_carry;
  bool reverse;  // chunks from the last to the first
  // The products' precision: one TF32 product each (a 10-bit mantissa, as cuBLAS under TF32) where
  // tf32, else 3xTF32 (fp32's accuracy).
  bool tf32;
  // Value columns per block: 8, 16 or 32 (dividing V), or 0 for delta_rule_scan_value_block's choice.
  int value_block;
};
void delta_rule_scan(const DeltaRuleScanParams& p, void* stream);

// The value block the launcher picks for value_block 0 on CUDA device `device`, or 0 when the
// kernel does not serve these dims there (bounds above, or more shared memory than the device
// gives): the widest of 32, 16, 8 that divides V and fits, narrowed (down to 8) while the grid
// (V / value_block) x heads x batch has fewer blocks than the device has SMs.
int delta_rule_scan_value_block(int batch, int heads, int head_k, int head_v, int chunk_size, int device);

// Whether delta_rule_scan serves these dims on CUDA device `device` (for some value block).
bool delta_rule_scan_supported(int head_k, int head_v, int chunk_size, int device);

// The chunked form's outputs from the scan (ops::run_chunked_form), written in the token layout:
//   O_n = Q_n S_n + A_n V_n        row i of chunk n is token n C + i (rows past seq are not written)
// with Q_n the queries decayed to the chunk start, A_n the causal intra-chunk scores (zero above
// the diagonal: the kernel skips those blocks), S_n and V_n the scan's states and new values.
struct DeltaRuleOutputParams {
  const float* q_start;  // [B, H, N, C, K]
  const float* states;   // [B, H, N, K, V]
  const float* a_qk;     // [B, H, N, C, C]
  const float* v_new;    // [B, H, N, C, V]
  void* out;             // [B, seq, H, V] in dtype, packed
  int batch, seq, heads, head_k, head_v, chunk_size;  // N = ceil(seq / chunk_size)
  DType dtype;  // of out: Float32 or BFloat16
  // One TF32 product per product (as cuBLAS under TF32) where tf32, else 3xTF32 (fp32's accuracy).
  bool tf32;
};
void delta_rule_output(const DeltaRuleOutputParams& p, void* stream);

// Whether delta_rule_output serves these dims on CUDA device `device`: C 64, K and V multiples of
// 16 in [16, 256].
bool delta_rule_output_supported(int head_k, int head_v, int chunk_size, int device);

// Its backward: from dO (the output's gradient, in the output's layout and dtype) and the forward's
// inputs, for every chunk-head
//   dQ_n = dO_n S_n^T,  dS_n = Q_n^T dO_n,  dA_n = CausalTril(dO_n V_n^T),  dV_n = A_n^T dO_n
// with dO_n's rows past seq taken as zeros and dA_n zero above the diagonal (the forward reads only
// A_n's causal part). All fp32, chunk layout, packed.
struct DeltaRuleOutputBackwardParams {
  DeltaRuleOutputParams forward;  // the inputs and dims; `out` unused, `dtype` is dout's
  const void* dout;     // [B, seq, H, V] dtype, packed
  float* dq_start;      // [B, H, N, C, K]
  float* dstates;       // [B, H, N, K, V]
  float* da_qk;         // [B, H, N, C, C]
  float* dv_new;        // [B, H, N, C, V]
};
void delta_rule_output_backward(const DeltaRuleOutputBackwardParams& p, void* stream);

// Whether delta_rule_output_backward serves these dims on CUDA device `device`: C 64, K a multiple
// of 16 in [16, 128], V a multiple of 16.
bool delta_rule_output_backward_supported(int head_k, int head_v, int chunk_size, int device);

// Row dot products of two [rows, cols] fp32 matrices: out[r] = sum_c x[r][c] y[r][c], in one read of
// each (the chunk scan's backward: the decay gradient sum_v G_{n+1}[k][v] S_n[k][v], where a product
// and a sum would write and read back a temporary of S's size). cols a multiple of 4, the matrices
// packed and 16-byte aligned.
struct RowDotsParams {
  const float* x;
  const float* y;
  float* out;  // [rows]
  int64_t rows;
  int cols;
};
void row_dots(const RowDotsParams& p, void* stream);

// The chunk scan's backward products (ops' ChunkStateScanFunction), for each of `count` chunks (the
// (sequence, head, chunk) triples in order) from the adjoint scan's G [K, V] (the gradient of the state
// leaving the chunk), the forward scan's S [K, V] (the state entering it), the chunk's values X [C, V]
// (V_new, or U without W) and the adjoint's dU [C, V]:
//   dKt = G X^T [K, C],  dW = -dU S^T [C, K] (only with W),  dcarry[k] = sum_v G[k][v] S[k][v]
// (dcarry summed over k too where the carry is one per head), reading each input once where two
// batched products and row_dots read G and S twice each. fp32, packed, 16-byte aligned; the dims as
// scan_backward_products_supported says. The products run as mma.sync m16n8k8 in 3xTF32 (fp32's
// accuracy) or, with tf32, one TF32 product each (as cuBLAS's fp32 products under TF32).
struct ScanBackwardProductsParams {
  const float* g_next;  // [count, K, V]
  const float* states;  // [count, K, V]
  const float* values;  // [count, C, V]
  const float* du;      // [count, C, V], read only with dw
  float* dkt;           // [count, K, C]
  float* dw;            // [count, C, K], or nullptr: no W (the gated linear family)
  float* dcarry;        // [count, K], or [count] with per_head_carry
  int64_t count;
  int head_k, head_v, chunk_size;
  bool per_head_carry;
  bool tf32;
};
void scan_backward_products(const ScanBackwardProductsParams& p, void* stream);
// Whether it serves these dims: K and C multiples of 16 with K <= 128 and C <= 64, V a multiple of 8.
bool scan_backward_products_supported(int head_k, int head_v, int chunk_size);

// -x^T of each of `count` [rows, cols] fp32 matrices (packed; out [count, cols, rows], packed): the
// adjoint scan's inputs -Kt^T and -W^T, through 32 x 32 shared-memory tiles so that both the reads and
// the writes are coalesced (an elementwise pass over the transposed view strides one of them).
struct NegatedTransposeParams {
  const float* x;
  float* out;
  int64_t count;
  int rows, cols;
};
void negated_transpose(const NegatedTransposeParams& p, void* stream);

// The UT transform's inverse of the chunked delta rule, for a batch of `count` C x C matrices:
//   T = (I + StrictTril(L))^{-1}             (unit lower triangular; L's diagonal and upper part unread)
// by forward substitution, one block per matrix and one thread per column of T (a column depends
// only on itself). l and t: [count, C, C] fp32, packed; C in [1, kMaxScanChunk].
struct UnitLowerInverseParams {
  const float* l;
  float* t;
  int64_t count;
  int size;  // C
};
void unit_lower_inverse(const UnitLowerInverseParams& p, void* stream);

// The causal depthwise short convolution of the linear mixers' q/k/v paths (ops::short_conv), on
// many tokens at once (training, prefill):
//   pre[b, t, c] = bias[c] + sum_{i < W} weight[c, i] * x[b, t - (W - 1 - i), c] * keep(t, W - 1 - i)
//   y = silu(pre) when `silu`, else pre
// where x before t = 0 is read from `past` (zeros when nullptr) and keep(t, j) = offsets[b, t] >= j
// with packed documents (no tap reaches into the document before), else 1. Computed in fp32.
constexpr int kMaxConvWidth = 8;  // W in [1, 8]
struct ShortConvParams {
  const void* x;          // [B, T, C] dtype, channels packed, tokens x_token_stride apart
  const void* past;       // [B, W - 1, C] dtype, packed, or nullptr
  const void* weight;     // [C, W] weight_dtype (Float32 or dtype), packed
  const float* bias;      // [C], or nullptr
  const int64_t* offsets; // [B, T], each token's position in its document, or nullptr
  void* y;                // [B, T, C] dtype
  int batch, seq, channels, width;
  // Elements from one token of x to the next (>= channels; rows seq * x_token_stride apart): a
  // column slice of a wider [B, T, N] tensor, as the parts of a packed projection, is read in place.
  int64_t x_token_stride;
  bool silu;
  DType dtype, weight_dtype;
};
void short_conv_forward(const ShortConvParams& p, void* stream);

// Its backward (no `past`: the op takes it only without gradients): with dpre = dy * silu'(pre)
// (pre recomputed from x: cheaper than storing it),
//   dx[b, t, c]   = sum_i weight[c, i] * dpre[b, t + W - 1 - i, c] * keep(t + W - 1 - i, W - 1 - i)
//   dweight[c, i] += sum_{b, t} dpre[b, t, c] * x[b, t - (W - 1 - i), c] * keep(t, W - 1 - i)
//   dbias[c]      += sum_{b, t} dpre[b, t, c]
// dweight and dbias accumulate (atomically) into what they hold: zero them first.
struct ShortConvBackwardParams {
  ShortConvParams forward;  // its `past` must be nullptr and `y` is unused
  const void* dy;           // [B, T, C] dtype, packed
  void* dx;                 // [B, T, C] dtype
  float* dweight;           // [C, W]
  float* dbias;             // [C], or nullptr
};
void short_conv_backward(const ShortConvBackwardParams& p, void* stream);

enum class GateAct { None, Swish, Sigmoid };

// A gated product of rows and its backward, as SwiGLU (SiLU: silu(a) * b on the halves of the
// w1|w3 output, prefill, decode and training) and attention's output gate (sigmoid: o * sigmoid(g))
// use them:
//   out = act(a) * b                      act(a) rounded to dtype before the product (the unfused form)
//   da = dout * b * act'(a),  db = dout * act(a)               in fp32, each rounded to dtype once
// Memory-bound: the forward reads a, b and writes out; the backward reads a, b, dout and writes da, db.
struct GatedProductParams {
  const void* a;            // [rows, hidden] dtype, rows a_row_stride apart
  const void* b;            // [rows, hidden] dtype, rows b_row_stride apart
  int64_t a_row_stride, b_row_stride;
  void* out;                // forward: [rows, hidden] dtype, packed
  const void* dout;         // backward: [rows, hidden] dtype, packed
  void* da;                 // backward: [rows, hidden] dtype, rows da_row_stride apart
  void* db;                 // backward: [rows, hidden] dtype, rows db_row_stride apart
  int64_t da_row_stride, db_row_stride;
  int64_t rows;
  int hidden;
  GateAct act;              // Swish or Sigmoid
  DType dtype;
};
void gated_product_forward(const GatedProductParams& p, void* stream);
void gated_product_backward(const GatedProductParams& p, void* stream);

// The gated sum of NSA's branches (ops::sigmoid_gated_sum) and its backward, for each row (b, t, h) of
// n branches x_i [B, T, H, D]:
//   out = sum_i s_i x_i,  s_i = sigmoid(logits[b, t, h, i])              in fp32, rounded once
//   dx_i = s_i dout,  dlogits[b, t, h, i] = s_i (1 - s_i) sum_d dout x_i   in fp32, each rounded once
// Memory-bound: the forward reads the branches and writes out; the backward reads dout and the branches
// and writes their gradients. Rows move in 16-byte pieces: D / (16 / sizeof(dtype)) a power of two up to
// 32, the branches 16-byte aligned with strides of whole pieces (gated_sum_supported).
constexpr int kGatedSumMaxBranches = 4;
struct GatedSumParams {
  const void* logits;                          // [B, T, H, n] dtype, the n at unit stride
  int64_t logit_strides[3];                    // of b, t and h
  const void* x[kGatedSumMaxBranches];         // [B, T, H, D] dtype each, D at unit stride
  int64_t x_strides[kGatedSumMaxBranches][3];  // of b, t and h
  void* out;                                   // forward: [B, T, H, D] packed
  const void* dout;                            // backward: [B, T, H, D] packed
  void* dx[kGatedSumMaxBranches];              // backward: [B, T, H, D] packed each
  void* dlogits;                               // backward: [B, T, H, n] packed
  int batch, length, heads, head_dim, branches;
  DType dtype;
};
bool gated_sum_supported(const GatedSumParams& p);
void gated_sum_forward(const GatedSumParams& p, void* stream);
void gated_sum_backward(const GatedSumParams& p, void* stream);

// A normalisation of rows, with an optional weight and an optional activated gate, as the linear
// mixers use it in training (the gated RMSNorm of their output, the L2 norm of q and k):
//   r = rsqrt(sum_i x[i]^2 / divisor + eps)    (divisor D: RMSNorm; 1: L2 norm)
//   y[i] = x[i] * r * weight[i] * act(gate[i]) (weight 1 and act 1 where absent)
// computed in fp32, one warp per row up to kMaxWarpRowDim (a block per row past it), D <=
// kMaxRowNormDim; r is saved for the backward. A residual add takes rows of at most kMaxWarpRowDim.
constexpr int kMaxWarpRowDim = 1024;
constexpr int kMaxRowNormDim = 4096;
struct RowNormParams {
  const void* x;         // [rows, D] dtype, packed
  const void* gate;      // [rows, D] dtype, or nullptr: groups of gate_group_rows packed rows,
                         // gate_group_stride elements apart (a column slice of a packed projection
                         // holding a token's heads; packed rows: 1 and D)
  const void* weight;    // [D] weight_dtype (Float32 or dtype), or nullptr
  void* y;               // [rows, D] out_dtype
  float* rstd;           // [rows]: r
  int64_t rows;
  int dim;
  int gate_group_rows;
  int64_t gate_group_stride;
  float divisor, eps;
  GateAct act;
  DType dtype, weight_dtype;
  // y's (and the backward's dy's) dtype: dtype, or BFloat16 with Float32 x (a norm whose output
  // only feeds bf16 products under autocast: written once in their dtype, no cast pass).
  DType out_dtype;
  // A residual add before the norm (forward): the row normalised is h = x + residual, rounded to
  // dtype as a separate add would, and written to h. residual [rows, D] residual_dtype (dtype, or
  // BFloat16 with Float32 x), packed, or nullptr; no gate with it.
  const void* residual;
  void* h;  // [rows, D] dtype, with residual
  DType residual_dtype;
};
void row_norm_forward(const RowNormParams& p, void* stream);

// Its backward from the saved r: with n = x * r, a = act(gate) and dn = dy * weight * a,
//   dx = r * (dn - n * sum_i(dn[i] n[i]) / divisor) + dh,  dgate = dy * n * weight * act'(gate),
//   dweight[i] += sum over rows of dy[i] n[i] a[i]   (atomically: zero it first).
// After a residual add, x is the saved h, dh the gradient h receives from its other uses, and the
// residual's gradient (dx itself) is written again in residual_dtype.
struct RowNormBackwardParams {
  RowNormParams forward;  // `y` and `residual` unused, `rstd` read
  const void* dy;         // [rows, D] out_dtype, packed
  void* dx;               // [rows, D] dtype
  void* dgate;            // [rows, D] dtype, packed, or nullptr (no gate)
  float* dweight;         // [D], or nullptr (no weight)
  const void* dh;         // [rows, D] dtype, packed, or nullptr: added to dx
  void* dresidual;        // [rows, D] forward.residual_dtype, or nullptr: dx in that dtype
};
void row_norm_backward(const RowNormBackwardParams& p, void* stream);
// The chunk preparation of the chunked delta rule (ops::delta_rule_chunked) with one decay per
// head or none: per chunk of C tokens of one (sequence, head), from the raw rows, with
//   G = the chunk-local inclusive cumulative sum of g (0 without a gate), G_l = G at the chunk's last row,
//   L[i][j] = beta_i (k_i . k_j) exp(G_i - G_j)          for j < i, else 0
//   T = (I + L)^{-1}
//   U = T diag(beta) V,  W = T diag(beta exp(G)) K        (the UT transform)
//   A_qk[i][j] = scale (q_i . k_j) exp(G_i - G_j)         for j <= i, else 0
//   Q_start = scale diag(exp(G)) Q,  Kt = (diag(exp(G_l - G)) K)^T,  carry = exp(G_l)
// the scan's inputs (W, U, Kt, carry) and the output's (Q_start reads S_n, A_qk reads V_n). Rows past
// the sequence's end are zeros (q, k, v, beta and g), as the padded chunk of the libtorch form.
// All in fp32; q, k and v may be bf16 (converted on load). C is 64 (delta_rule_prepare_supported).
// `additive`: the gated linear family's preparation (ops::gated_linear_chunked, no delta-rule
// correction): T = I, so U = V (in fp32) and no W; beta is not read.
// One decay per key channel (KDA, GLA, HGRN2: `channel_gate`, g then nullptr): G is given per chunk,
// row and channel, and the scores, whose decay sits inside the sum over the channels, come from
// ops::decayed_scores:
//   scores_qk[i][j] = sum_d q_id k_jd exp(G_id - G_jd)  (j <= i),  scores_kk[i][j] = the same of k_i, k_j (j < i)
//   L = diag(beta) scores_kk,  W = T diag(beta) (K * exp(G)),
//   Q_start = scale Q * exp(G),  Kt = (K * exp(G_l - G))^T,  carry = exp(G_l) [K]
// with * elementwise over [C, K]. A_qk = scale scores_qk is not the kernel's: the caller has the score
// kernels write it scaled (no [C, C] copy each way), so a_qk is nullptr and scores_qk is not read.
struct DeltaRulePrepareParams {
  const void* q;       // [B, T, H, K], dtype: each token's H K elements packed, tokens q_row apart
  const void* k;       // [B, T, H, K], dtype, tokens k_row apart
  const void* v;       // [B, T, H, V], dtype, tokens v_row apart
  const float* beta;   // [B, T, H] (nullptr when additive)
  const float* g;      // [B, T, H] log-decay per head, or nullptr for none
  const float* channel_gate;  // [B, H, N, C, K] G per key channel (chunk-local, inclusive), or nullptr
  const float* scores_kk;     // [B, H, N, C, C], with channel_gate unless additive
  float* w;            // [B, H, N, C, K] (nullptr when additive)
  float* u;            // [B, H, N, C, V]
  float* kt;           // [B, H, N, K, C]
  float* carry;        // [B, H, N], or [B, H, N, K] with channel_gate
  float* q_start;      // [B, H, N, C, K]
  float* a_qk;         // [B, H, N, C, C] (nullptr with channel_gate)
  int batch, seq, heads, head_k, head_v, chunk_size;  // N = ceil(seq / chunk_size)
  // Elements from one token's row of q, k, v to the next's (token t of sequence b at (b T + t) row):
  // H K and H V where packed, more where they are column slices of one projection's output (read
  // in place, no copy). Multiples of 16 bytes, as the pointers are: the rows are read in 16-byte loads.
  int64_t q_row, k_row, v_row;
  float scale;
  DType dtype;  // of q, k and v: Float32 or BFloat16
  // The forward's T [V | K] product (and K K^T, Q K^T from fp32 inputs): one TF32 product each
  // where tf32, else 3xTF32 (fp32's accuracy). The backward likewise for its panel and dq, dk
  // products (fp32 FMAs for the rest).
  bool tf32;
  bool additive;
};
void delta_rule_prepare(const DeltaRulePrepareParams& p, void* stream);

// Its backward: from the gradients of the six outputs (chunk layout as above, fp32, packed) and the
// forward's inputs, the gradients of q, k and v in their dtype (q's and k's in their row layout: a
// slice's gradient a slice of a buffer as wide, which the score kernels add into in place; v's rows
// dv_row apart) and of beta and g in fp32 (L, T and the products are recomputed, nothing of the forward
// is read). With G_l, L, T, A_qk as above, R = [beta V | beta
// exp(G) K], dUW = [dU | dW] and decay_ij = exp(G_i - G_j):
//   dR = T^T dUW,  dL = -StrictTril(T^T (dUW R^T) T^T),  dS = beta_i dL decay,  P = scale dA_qk decay (j <= i)
//   dq = P K + scale exp(G) dQ_start,  dk = (dS + dS^T) K + P^T Q + beta exp(G) dR_W + dKt^T exp(G_l - G),
//   dv = beta dR_V, dbeta and dG from every term, dg_i = sum over the chunk's rows s >= i of dG_s.
// Additive (T = I, no W, no beta): dv = dU, dq and dg as above, dk = P^T Q + dKt^T exp(G_l - G).
// With channel_gate dA_qk is not read (its gradient, scale dA_qk, is the scores' backward's, the caller's),
// the gradient of scores_kk is an output instead of the terms it gives (the caller takes those through
// ops::decayed_scores' backward): d_scores_kk = beta_i dL (j < i), and dq, dk, dbeta and d_channel_gate
// (per element, no cumulative sum) carry the rest: dq = scale exp(G) * dQ_start,
// dk = beta exp(G) * dR_W + exp(G_l - G) * dKt^T.
struct DeltaRulePrepareBackwardParams {
  DeltaRulePrepareParams forward;  // the inputs; its outputs are not read
  const float* dw;        // [B, H, N, C, K] (nullptr when additive)
  const float* du;        // [B, H, N, C, V]
  const float* dkt;       // [B, H, N, K, C]
  const float* dcarry;    // [B, H, N], or [B, H, N, K] with channel_gate
  const float* dq_start;  // [B, H, N, C, K]
  const float* da_qk;     // [B, H, N, C, C] (nullptr with channel_gate)
  void* dq;               // [B, T, H, K], the forward's dtype (of q, k and v), rows forward.q_row apart
  void* dk;               // [B, T, H, K], the forward's dtype, rows forward.k_row apart
  void* dv;               // [B, T, H, V], the forward's dtype, rows dv_row apart
  float* dk_partial;      // [B, T, H, K] fp32 scratch in dk's layout (dk itself where that is fp32); not read
                          // when additive
  float* dbeta;           // [B, T, H] (nullptr when additive)
  float* dg;              // [B, T, H], exactly when forward.g is given
  float* d_channel_gate;  // [B, H, N, C, K], exactly with channel_gate
  float* d_scores_kk;     // [B, H, N, C, C], with channel_gate unless additive
  // Elements from one token's row of dv to the next's: H V packed, more where dv is a column slice of a
  // wider buffer (v's gradient beside q's and k's in one buffer as wide as their projection's output). A
  // multiple of 4, at most kMaxRow.
  int64_t dv_row;
};
void delta_rule_prepare_backward(const DeltaRulePrepareBackwardParams& p, void* stream);

// Whether delta_rule_prepare and its backward serve these dims on CUDA device `device`: C 64, K
// and V multiples of 16 with K <= 128, and the backward's shared memory within the device's limit.
bool delta_rule_prepare_supported(int head_k, int head_v, int chunk_size, int device);

// The gates of the gated delta rule (ops::delta_rule_gates: GDN, KDA) from their raw projections,
// for `rows` tokens:
//   g[r][c]    = -exp(A_log[c / (cols / heads)]) * softplus(a[r][c] + dt_bias[c])   c < cols
//   beta[r][h] = beta_scale * sigmoid(b[r][h])                                        h < beta_cols
// in fp32, softplus as libtorch's (x past 20 is taken as is).
struct DeltaRuleGatesParams {
  const void* a;         // [rows, cols] dtype, columns packed, rows a_row_stride apart
  const void* b;         // [rows, beta_cols] dtype, columns packed, rows b_row_stride apart
  const void* A_log;     // [heads] param_dtype
  const void* dt_bias;   // [cols] param_dtype
  float* g;              // [rows, cols], packed
  float* beta;           // [rows, beta_cols], packed
  int64_t rows, a_row_stride, b_row_stride;
  int cols, heads, beta_cols;  // heads divides cols
  float beta_scale;
  DType dtype, param_dtype;    // param_dtype: Float32 or dtype
};
void delta_rule_gates(const DeltaRuleGatesParams& p, void* stream);

// Its backward (training) from dg and dbeta, with x = a + dt_bias[c] and softplus' = sigmoid (1 past 20):
//   da = dg * (-exp(A_log[head of c])) * sigmoid(x),   db = dbeta * beta * (1 - beta / beta_scale)
//   dt_bias_cols[c] += sum over rows of da,   A_log_cols[c] += sum over rows of dg * g
// (the caller sums A_log_cols over each head's columns and zeroes both sums first).
struct DeltaRuleGatesBackwardParams {
  DeltaRuleGatesParams forward;  // g and beta unused
  const float* dg;               // [rows, cols], packed
  const float* dbeta;            // [rows, beta_cols], packed
  void* da;                      // [rows, cols] dtype, packed
  void* db;                      // [rows, beta_cols] dtype, packed
  float* dt_bias_cols;           // [cols]
  float* A_log_cols;             // [cols]
};
void delta_rule_gates_backward(const DeltaRuleGatesBackwardParams& p, void* stream);

// The gated linear family's log-decay from raw logits (ops::log_sigmoid_gates: GLA's, HGRN2's):
//   g[r][c] = log_sigmoid(x[r][c]) / normalizer          in fp32
//   k[r][c] = 1 - exp(g[r][c])                            in k_dtype, where k is given (HGRN2's input gate)
// log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|)), accurate at both tails.
struct LogSigmoidGatesParams {
  const void* x;   // [rows, cols] x_dtype, columns packed, rows x_row_stride apart
  float* g;        // [rows, cols], packed
  void* k;         // [rows, cols] k_dtype, packed; nullptr: not computed
  int64_t rows, x_row_stride;
  int cols;
  float normalizer;
  DType x_dtype, k_dtype;
};
void log_sigmoid_gates(const LogSigmoidGatesParams& p, void* stream);
// Its backward, with s = sigmoid(-x) (the derivative of log_sigmoid):
//   dx = s / normalizer * (dg - dk * exp(g))     in x_dtype, packed
// (dg or dk nullptr: zero).
struct LogSigmoidGatesBackwardParams {
  LogSigmoidGatesParams forward;  // g and k unused
  const float* dg;                // [rows, cols], packed, or nullptr
  const void* dk;                 // [rows, cols] k_dtype, packed, or nullptr
  void* dx;                       // [rows, cols] x_dtype, packed
};
void log_sigmoid_gates_backward(const LogSigmoidGatesBackwardParams& p, void* stream);

// Values scaled per head (ops::scale_heads: Mamba2's v = dt x), x [rows, heads * head_dim] strided rows:
//   y[r][h][p] = dtype(x[r][h][p] * s[r][h])        the product in fp32, rounded once to x's dtype
// and its backward:
//   dx[r][h][p] = dtype(dy[r][h][p] * s[r][h]),   ds[r][h] = sum over p of dy[r][h][p] * x[r][h][p]   (fp32)
struct ScaleHeadsParams {
  const void* x;   // [rows, heads * head_dim] dtype, a row's values packed, rows x_row_stride apart
  const float* s;  // [rows, heads], packed
  void* y;         // [rows, heads * head_dim] dtype, packed
  int64_t rows, x_row_stride;
  int heads, head_dim;
  DType dtype;
};
void scale_heads(const ScaleHeadsParams& p, void* stream);
struct ScaleHeadsBackwardParams {
  ScaleHeadsParams forward;  // y unused
  const void* dy;            // [rows, heads * head_dim] dtype, packed
  void* dx;                  // [rows, heads * head_dim] dtype, packed
  float* ds;                 // [rows, heads], packed
};
void scale_heads_backward(const ScaleHeadsBackwardParams& p, void* stream);

// The per-channel decayed scores of the chunked gated forms (ops::decayed_scores with one decay per
// key channel: GLA, HGRN2, KDA), for `count` independent chunks of C rows and K channels:
//   A[i][j] = s sum_d a[i][d] b[j][d] exp(G[i][d] - G[j][d])   for j <= i (inclusive) or j < i, else 0
// with s = `scale` (the chunked forms' A_qk in one pass). G is a chunk's cumulative log-decay
// (non-increasing along the chunk), so every kept exponent is <= 0. The backward from dA (its entries
// outside the kept triangle ignored), with e_ijd = exp(G[i][d] - G[j][d]) over the kept pairs:
//   da[i][d] = s sum_j dA[i][j] b[j][d] e_ijd,  db[j][d] = s sum_i dA[i][j] a[i][d] e_ijd,
//   dG = a * da - b * db.
// G and dG fp32 [count, C, K], A and dA fp32 [count, C, C], packed; C <= 64, any K. a, b, da and db
// (of `dtype`) either packed [count, C, K] too, or, with `token_rows`, token-layout tensors
// [B, seq, heads, K], each token's heads x K packed and the tokens row_stride apart (count = B heads N
// chunks of C, in (b, h, n) order): chunk n's row i is token n C + i, and rows past seq read as zeros
// and take no gradient. The token rows let the chunked forms hand q and k over as they are (column
// slices of a projection's output too), where the chunk layout needs an fp32 copy of each and a copy
// of each gradient back.
constexpr int kMaxChannelScoresChunk = 64;
struct ChannelScoresParams {
  const void* a;
  const void* b;
  const float* g;
  float* scores;  // A, written whole (zeros outside the kept triangle)
  // Forward only, or nullptr: b's strict scores with itself too, unscaled (sum_d b_i b_j e_ijd, j < i),
  // written whole: KDA's scores_kk beside its A_qk in one pass, which reads b and G once and takes each
  // kept pair's exponential once for both.
  float* self_scores = nullptr;
  int64_t count;
  int chunk, dim;
  bool inclusive;
  float scale = 1.f;
  DType dtype = DType::Float32;  // of a, b, da, db
  bool token_rows = false;
  int64_t seq = 0;  // with token_rows: the tokens a sequence, and its heads
  int heads = 0;
  // With token_rows: elements from one token's row of a and b (and of da and db, written in the same
  // layout) to the next's: heads x dim where packed, more for column slices of a wider tensor.
  int64_t row_stride = 0;
};
void channel_scores_forward(const ChannelScoresParams& p, void* stream);
struct ChannelScoresBackwardParams {
  ChannelScoresParams forward;  // `scores` unused
  const float* d_scores;
  void* da;  // in a's layout and dtype
  void* db;
  float* dg;
  // Add da, db and dg to what the buffers hold instead of writing them (a caller whose q and k take other
  // gradients too: one sum in the kernel, not a pass of its own). da may be db where a is b: both shares
  // land there.
  bool accumulate = false;
  // Or nullptr: the gradient of b's strict self scores too (the forward's self_scores, unscaled: KDA's
  // scores_kk), [count, C, C] fp32, its shares added to db and dg in the same pass (da and db apart).
  const float* d_self_scores = nullptr;
};
void channel_scores_backward(const ChannelScoresBackwardParams& p, void* stream);

// The chunk-local inclusive cumulative log-gate of the chunked gated forms (ops::chunk_cumulative_gate)
// from the token layout into the chunk layout, and its backward (kernels/cuda/channel_scores.cu):
//   forward   G[b, h, n, c, d] = sum_{c' <= c} g[b, n C + c', h, d]          (g = 0 past T)
//   backward  dg[b, t, h, d]   = sum_{c' >= c} dG[b, h, n, c', d],  t = n C + c < T
// fp32, both tensors packed; a thread walks one (b, h, n, d) column of C rows.
struct ChunkGateParams {
  const float* in;  // forward: g [B, T, H, D]; backward: dG [B, H, N, C, D]
  float* out;       // forward: G; backward: dg
  int64_t batch, tokens;
  int heads, dim, chunk;
};
void chunk_gate_forward(const ChunkGateParams& p, void* stream);
void chunk_gate_backward(const ChunkGateParams& p, void* stream);

// Rotary position embedding of a whole [B, T, H, D] tensor at positions start + t, the same for every
// sequence (ops::apply_rope: training and prefill; kernels/cuda/rope_cache.cu), into a packed tensor:
//   y[a] = x[a] cos - x[b] sin,  y[b] = x[b] cos + x[a] sin,   angle (start + t) theta^(-2i / D)
// for pair i = (a, b): (2i, 2i + 1) where interleaved, (i, i + D / 2) otherwise (nn/rope.h's two
// layouts). `inverse` rotates by the negative angle: the backward, dx = R^T dy. The angle in float64
// reduced to within one turn, its sine and cosine and the rotation in fp32, one rounding to dtype.
// With pass_dims > 0 the rows are D + pass_dims long: the first D dims rotate, the rest are copied
// (a rotated prefix of the head dims into a new tensor in one pass).
constexpr int kRopeMaxHeadDim = 512;
struct RopeParams {
  const void* x;  // [B, T, H, D + pass_dims] dtype, last dim contiguous, the other dims strided as below
  void* y;        // [B, T, H, D + pass_dims] dtype, last dim contiguous, strided as below; y == x (with
                  // x's strides) rotates x in place: each thread reads its pairs before it writes them
  int64_t x_batch_stride, x_token_stride, x_head_stride;  // elements
  int64_t y_batch_stride, y_token_stride, y_head_stride;  // elements
  int batch, seq, heads, head_dim;
  int pass_dims;  // dims after the rotated head_dim copied from x to y as they are
  int64_t start;
  double theta;
  bool interleaved;
  bool inverse;
  DType dtype;
};
// Whether rope_apply takes these sizes: D even and at most kRopeMaxHeadDim, seq and batch x heads in an int.
bool rope_apply_supported(int64_t batch, int64_t seq, int64_t heads, int64_t head_dim);
void rope_apply(const RopeParams& p, void* stream);

// Softmax cross-entropy of rows of fp32 logits against hard labels and its gradient, one kernel (the
// LM head loss's chunks, ops/loss: HardLabels):
//   lse = log sum_v exp(x_v),  loss[row] = lse - x[label],  grad[v] = exp(x_v - lse) - (v == label)
// in fp32, the gradient rounded once to grad_dtype. A row labelled ignore_index scores 0 and gets a zero
// gradient. Labels are in [0, vocab) or ignore_index (the caller checks them).
struct CrossEntropyParams {
  const float* logits;    // [rows, vocab], packed
  const int64_t* labels;  // [rows]
  float* loss;            // [rows]: each row's loss
  void* grad;             // [rows, vocab] grad_dtype, packed; nullptr: no gradient
  int64_t rows;
  int vocab;
  int64_t ignore_index;
  DType grad_dtype;
};
// Whether cross_entropy_forward takes these sizes: rows in an int (a block a row), vocab >= 1.
bool cross_entropy_supported(int64_t rows, int64_t vocab);
void cross_entropy_forward(const CrossEntropyParams& p, void* stream);

// NSA's block selection (ops/sparse_attention: nsa_select_blocks) for every query row (b, h, t) of
// importance [B, H_kv, T, NS] (contiguous, in `dtype`): the query at position pos = positions[b *
// pos_stride_b + h * pos_stride_h + t * pos_stride_t] sits in block own = floor(pos / block) and sees
// blocks j <= own; block 0 and blocks j > own - n_local are forced (score +inf), and the row selects its
// visible blocks among the min(n_select, NS) largest scores, ties to the lower block. selected [B, H_kv,
// T, NS] contiguous. Exactly the set of the reference's fp32 top-k (its importance widened to fp32).
constexpr int kNsaSelectMaxBlocks = 256;
struct NsaSelectParams {
  const void* importance;
  DType dtype;
  const int64_t* positions;
  int64_t pos_stride_b, pos_stride_h, pos_stride_t;
  bool* selected;
  int batch, kv_heads, length, blocks, block, n_select, n_local;
};
// Whether nsa_select_blocks takes these sizes: 1 <= NS <= kNsaSelectMaxBlocks, rows in the grid.
bool nsa_select_blocks_supported(int64_t rows, int64_t blocks);
void nsa_select_blocks(const NsaSelectParams& p, void* stream);

// The additive mask of NSA's selection branch for query rows row0 .. row0 + rows - 1 (ops/sparse_attention:
// nsa_selection_bias): bias[b, h, i, c] = 0 where selected[b, h / G, row0 + i, c / block] and c <=
// first_position + i (the row's query position: causal), else -inf, for columns c < cols (a multiple of
// block; block a multiple of 8), rows `pitch` elements apart (a multiple of 8, 16-byte aligned base), in
// `dtype`. selected: [B, kv_heads, selected_rows, selected_blocks] bool, contiguous.
struct SelectionBiasParams {
  const bool* selected;
  int64_t selected_rows, selected_blocks;
  void* bias;
  DType dtype;
  int batch, heads, kv_heads, rows, row0, cols, pitch, block;
  int64_t first_position;
};
// Whether selection_bias takes these sizes: B H rows in an int, block a multiple of 8 dividing cols.
bool selection_bias_supported(int64_t rows, int64_t cols, int64_t block);
void selection_bias(const SelectionBiasParams& p, void* stream);

}  // namespace lt2::kernels
