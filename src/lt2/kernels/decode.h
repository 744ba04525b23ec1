// Fused CUDA kernels for the decode hot path (one new token per sequence), flash-attention style:
// a params struct per kernel, a launcher that picks the template instance from the dtype and the
// head dims, plain kernels in kernels/cuda/. No libtorch here (the op families under ops/ bind
// these for tensors). Pointers are device pointers; strides count elements; the last dim of every tensor is
// contiguous. Accumulation, gates and recurrent states are fp32 whatever the activation dtype.
// The launchers enqueue on `stream` (a cudaStream_t) and never synchronise, allocate or read
// device memory on the host, so a CUDA graph can capture them.
#pragma once
#include <cstdint>
#include <string>

namespace lt2::kernels {

enum class DType { Float32, BFloat16, Float16 };

// Largest key head dim the recurrent kernels hold in registers (rows of S per block).
constexpr int kMaxRecurrentHeadK = 512;

// Layout of the log-decay g of a recurrent step.
enum class DecayKind {
  None,        // no decay (DeltaNet, linear attention)
  PerHead,     // g [B, H]: one decay per head (GDN, Mamba2, RetNet)
  PerChannel,  // g [B, H, K]: one decay per key channel (KDA, GLA, HGRN2)
};

// One decode token of the linear-recurrence family on already projected inputs, S [B, H, K, V]:
//   S <- exp(g) S                                  (per head or per key channel)
//   delta rule (beta given):  S <- S + k (beta (v - S^T k))^T
//   additive   (beta null):   S <- S + k v^T
//   o = scale S^T q
// Same math as ops::delta_rule_step / ops::gated_linear_step.
struct RecurrentStepParams {
  const void* q;  // [B, H, K] in dtype
  const void* k;  // [B, H, K] in dtype
  const void* v;  // [B, H, V] in dtype
  int64_t q_batch_stride, q_head_stride;
  int64_t k_batch_stride, k_head_stride;
  int64_t v_batch_stride, v_head_stride;
  const float* beta;     // [B, H] contiguous, or nullptr for the additive update
  const float* g;        // log decay, contiguous: [B, H] or [B, H, K] per decay_kind; nullptr for None
  DecayKind decay_kind;
  float* state;          // [B, H, K, V] contiguous, updated in place
  void* o;               // [B, H, V] contiguous, in dtype
  int batch, heads, head_k, head_v;
  float scale;
  DType dtype;
};
void recurrent_step(const RecurrentStepParams& p, void* stream);

// Gated DeltaNet's whole decode step after its input projections, in one launch (num_v_heads ==
// num_heads). Per-head form: one block per (sequence, head), which owns its head's conv channels;
// cluster form: the head's cluster owns them (kernels/cuda/recurrent_decode.cu):
//   q, k, v = SiLU(ShortConv(q_raw | k_raw | v_raw))      conv windows advanced in place
//   q, k    = x * rsqrt(sum(x^2) + 1e-6)                   (L2 norm over K)
//   beta    = sigmoid(b_raw) (x2 with allow_neg_eigval),   g = -exp(A_log) softplus(a_raw + dt_bias)
//   S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = scale S^T q
//   y = o * rsqrt(mean(o^2) + eps) * norm_weight * silu(gate)   (no gate factor when gate is null)
// How gdn_decode spreads its work over the GPU.
enum class GdnDecodeForm {
  Auto,       // gdn_decode_form's choice
  Registers,  // one block per (sequence, head), S in registers (K <= kMaxGdnRegisterHeadK, V % 4 == 0)
  PerHead,    // one block per (sequence, head), S through shared memory in passes over the value columns
  Cluster,    // one thread-block cluster per (sequence, head), a block per tile of value columns (sm_90)
};
// Largest key head dim of gdn_decode's register form (32 rows of S per thread).
constexpr int kMaxGdnRegisterHeadK = 256;
struct GdnDecodeParams {
  const void* q_raw;  // [B, H*K] (batch stride q_stride)
  const void* k_raw;  // [B, H*K]
  const void* v_raw;  // [B, H*V]
  const void* a_raw;  // [B, H]
  const void* b_raw;  // [B, H]
  const void* gate;   // [B, H*V], or nullptr without the output gate
  int64_t q_stride, k_stride, v_stride, a_stride, b_stride, gate_stride;
  const void* q_conv_weight;  // [H*K, W] contiguous
  const void* k_conv_weight;  // [H*K, W]
  const void* v_conv_weight;  // [H*V, W]
  void* q_conv_window;        // [B, W-1, H*K] contiguous: the W-1 previous inputs, oldest first
  void* k_conv_window;        // [B, W-1, H*K]
  void* v_conv_window;        // [B, W-1, H*V]
  const void* A_log;          // [H]
  const void* dt_bias;        // [H]
  const void* norm_weight;    // [V]
  float* state;               // [B, H, K, V] contiguous, updated in place
  void* y;                    // [B, H*V] contiguous
  int batch, heads, head_k, head_v, conv_size;
  float scale, norm_eps;
  bool allow_neg_eigval;
  DType dtype;  // of every non-state tensor above
  GdnDecodeForm form;
  // No kernel that may still run when this step starts writes the state (the kernel before it on
  // the stream is the caller's input projection): the register form then loads S before it waits
  // for that kernel, so the load overlaps its end. Never for two steps on one state back to back.
  bool state_settled;
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
};
void gdn_decode(const GdnDecodeParams& p, void* stream);
// Whether the register form serves these head dims (it also needs a 16-byte aligned state).
bool gdn_decode_registers_supported(int head_k, int head_v);
// Whether the cluster form serves these head dims on CUDA device `device`.
bool gdn_decode_cluster_supported(int head_k, int head_v, int device);
// Auto's choice: the register form where it serves the head dims; else the cluster form when one
// block per (sequence, head) would leave most SMs idle (fewer blocks than half the SMs) and the
// cluster form serves the head dims, else the per-head form.
GdnDecodeForm gdn_decode_form(int batch, int heads, int head_k, int head_v, int device);

// RMSNorm of rows in fp32, optionally after a residual add (a transformer block's `h = x + m;
// y = norm(h)` pair), one block per row:
//   h = x + residual            rounded to dtype, as the unfused add in the activation dtype
//   y = h * rsqrt(mean(h^2) + eps) * weight                 (fp32, rounded to dtype once)
struct RmsNormParams {
  const void* x;         // [rows, dim], rows x_row_stride apart
  const void* residual;  // [rows, dim], rows residual_row_stride apart, or nullptr: y = norm(x)
  int64_t x_row_stride, residual_row_stride;
  const void* weight;    // [dim]
  void* h;               // [rows, dim] contiguous: x + residual (unused without residual)
  void* y;               // [rows, dim] contiguous
  int64_t rows;
  int dim;
  float eps;
  DType dtype;  // of every tensor above
};
void rms_norm(const RmsNormParams& p, void* stream);

// Flash-decoding: one query token per sequence against its KV cache. Grid = splits x Hkv x B; a
// block takes its sequence's keys [split * c, (split + 1) * c) with c = ceil(len / splits) for all
// G = Hq / Hkv query heads of its kv head (query head i reads kv head i / G), so K and V are read
// once; a combine kernel merges the splits' (max, sum, acc) partials. The split count depends only
// on the shapes (attention_decode_num_splits), never on the lengths, so a captured graph replays
// with new lengths.
constexpr int kAttentionMaxGroups = 8;  // query heads per kv head
constexpr int kAttentionMaxSplits = 128;
struct AttentionDecodeParams {
  const void* q;  // [B, Hq, D]
  int64_t q_batch_stride, q_head_stride;
  const void* k_cache;  // [B, Hkv, Lmax, D], rows 16-byte aligned
  const void* v_cache;  // [B, Hkv, Lmax, D]
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  const int64_t* seq_lens;  // [B]: keys 0..len-1 of sequence b are attended (len in [1, Lmax])
  void* out;                // [B, Hq, D] contiguous
  float* partial_out;       // [B, Hq, splits, D] workspace (unused with one split)
  float* partial_lse;       // [B, Hq, splits] workspace, base-2 log-sum-exp of each split
  int batch, q_heads, kv_heads, head_dim, max_len, num_splits;
  float scale;
  DType dtype;  // of q, the caches and out
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
};
// Head dims with a kernel instance.
bool attention_decode_head_dim_supported(int head_dim);
// Splits for these shapes on CUDA device `device`: enough blocks to fill the GPU, a few dozen keys
// of cache capacity per split at least, at most kAttentionMaxSplits.
int attention_decode_num_splits(int batch, int kv_heads, int max_len, int device);
void attention_decode(const AttentionDecodeParams& p, void* stream);

// Attention's decode prologue (kernels/cuda/rope_cache.cu), one launch for what the unfused path
// does in ~30 small kernels (cos/sin tables, pair swaps, products, cache scatters): sequence b's
// new token sits at position pos_b = positions[b];
//   q_out[b, h]             = rope(q[b, h], pos_b)   for its H query heads
//   k_cache[b, j, pos_b]    = rope(k[b, j], pos_b)   for its H_kv heads
//   v_cache[b, j, pos_b]    = v[b, j]
// RoPE pairs as in model/rope.h (interleaved (2i, 2i + 1) or halves (i, i + D/2)), angle
// pos theta^(-2i / D) in float64 (exact at long contexts), the rotation in fp32, one rounding. A
// position outside [0, max_len) writes no cache row (q is still rotated).
constexpr int kRopeCacheMaxHeadDim = 512;
struct RopeCacheParams {
  const void* q;  // [B, H * D], rows q_in_stride apart
  const void* k;  // [B, H_kv * D], rows k_in_stride apart
  const void* v;  // [B, H_kv * D], rows v_in_stride apart
  int64_t q_in_stride, k_in_stride, v_in_stride;
  void* q_out;    // [B, H, D] contiguous
  void* k_cache;  // [B, H_kv, max_len, D], last dim contiguous
  void* v_cache;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  const int64_t* positions;  // [B]
  int batch, heads, kv_heads, head_dim;
  int64_t max_len;
  double theta;
  bool interleaved;
  DType dtype;  // of every tensor but positions
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
};
// Whether rope_cache_write takes these sizes (D even and <= kRopeCacheMaxHeadDim, B and heads in a grid).
bool rope_cache_write_supported(int batch, int heads, int kv_heads, int head_dim);
void rope_cache_write(const RopeCacheParams& p, void* stream);

// The projections of a decode step, y = x W^T for a few rows (nn.Linear without bias), with the
// elementwise work around them folded in (kernels/cuda/gemv_decode.cu):
//   prologue RmsNorm   y = norm(x) W^T,  norm(x) = x rsqrt(mean(x^2) + eps) * norm_weight
//   prologue SiluMul   x = [a | b] ([rows, 2K]):  y = (silu(a) * b) W^T       (SwiGLU's w2)
//   prologue SigmoidGate  y = (x * sigmoid(x_gate)) W^T, x_gate [rows, K]     (attention's output gate)
//   residual           y = residual + (...)                                    (the block's adds)
//   y_gate             y = sigmoid(y_gate) (...), y_gate [rows, N]              (DSA's gate after W_uv)
// x [rows, K] (rows x_row_stride apart, 16-byte aligned), W [N, K] contiguous (16-byte aligned),
// y and residual [rows, N] (rows *_row_stride apart), all in dtype; fp32 accumulation, one
// rounding. Memory bound on reading W once; more rows than kGemvMaxRows are a GEMM (cuBLAS).
// The tensor-core kernel may split K over the blocks of a thread-block cluster (k_splits, at most
// kGemvMaxKSplits; 0 lets gemv pick): few weight rows (N = 2048) leave too few blocks, each with
// too many dependent trips to memory, to keep HBM busy otherwise.
constexpr int kGemvMaxRows = 8;
constexpr int kGemvMaxKSplits = 8;  // the portable cluster size
enum class GemvPrologue { None, RmsNorm, SiluMul, SigmoidGate };
struct GemvParams {
  const void* x;
  int64_t x_row_stride;
  const void* w;
  void* y;
  int64_t y_row_stride;
  const void* residual;          // or nullptr
  int64_t residual_row_stride;
  const void* norm_weight;       // [K], RmsNorm only
  float norm_eps;
  const void* x_gate;            // [rows, K] (rows x_gate_row_stride apart, 16-byte aligned), SigmoidGate only
  int64_t x_gate_row_stride;
  GemvPrologue prologue;
  int64_t rows, n;
  int k;
  DType dtype;
  int k_splits = 0;              // 0: gemv_k_splits; otherwise 1..kGemvMaxKSplits (benchmarks, tests)
  // Batched: `batch` independent products (grid z), product j's x, W, y and y_gate advanced by j
  // times their batch strides (elements); no residual then. Default: one product.
  int64_t batch = 1;
  int64_t x_batch_stride = 0, w_batch_stride = 0, y_batch_stride = 0;
  // Output gate: y = sigmoid(y_gate) (...) before the residual, y_gate [rows, N] like y, or nullptr.
  const void* y_gate = nullptr;
  int64_t y_gate_row_stride = 0, y_gate_batch_stride = 0;
  // gemv_chain only (gemv rejects it): W's two halves of n / 2 rows give a = x W_a^T, b = x W_b^T
  // and y [rows, n / 2] = silu(a) * b (+ residual [rows, n / 2]), a and b not rounded apart.
  bool silu_mul_out = false;
  bool pdl = true;  // a programmatic dependent launch where the launcher allows one (DecodeOptions::pdl_for)
};
// Whether gemv takes `rows` rows of length k in dtype (1 <= rows <= kGemvMaxRows, k a whole
// number of 16-byte vectors).
bool gemv_supported(int64_t rows, int64_t k, DType dtype);
// The K splits gemv uses for W [n, k] in dtype on CUDA device `device` when k_splits is 0 (1 where
// the FMA kernel serves it or the device has no clusters).
int gemv_k_splits(int64_t n, int k, DType dtype, int device);
void gemv(const GemvParams& p, void* stream);

// A chain of dependent decode products in one persistent kernel (kernels/cuda/gemv_chain.cu):
// product i + 1 reads product i's y as its x (or its residual), so the products are separated by
// a grid-wide barrier; meanwhile each block's producer warp streams the weights of the products
// after it into a shared-memory ring with TMA bulk copies, which the barrier does not stop. HBM
// thus stays busy across the boundaries where separate launches ramp down and up (each GEMV
// launch pays ~4-6 us of ramp and tail: bench/results/gemv_splits_h200.txt). Every product is a
// GemvParams with one product (batch 1), no y_gate and k_splits ignored; x may be an earlier
// product's y, a residual an earlier product's y or the chain's input. Blocks: one per SM,
// co-resident (cooperative launch).
// Chains of 2+ products share one self-resetting grid barrier per (device, stream), at most 64
// streams per device; one product needs none. The launch is a programmatic dependent of the
// kernel before it, whose writes the consumers wait for before reading x.
constexpr int kGemvChainMaxProducts = 4;
struct GemvChainParams {
  GemvParams product[kGemvChainMaxProducts];
  int products = 0;
  int max_slots = 0;  // cap on the weight ring's slots; 0: as many as shared memory holds
  bool pdl = true;    // a programmatic dependent launch (DecodeOptions::pdl_for)
};
// Empty when gemv_chain takes p on CUDA device `device` (sm_90, bf16 / fp16, K a multiple of 32,
// x rows in shared memory, ...), else what does not fit.
std::string gemv_chain_problem(const GemvChainParams& p, int device);
void gemv_chain(const GemvChainParams& p, void* stream);

}  // namespace lt2::kernels
