// The kernel-case table, in the spirit of ggml's test-backend-ops: every CUDA decode kernel at the
// shapes and dtypes it is checked and timed at. A case is an op, a shape, a dtype and the
// tolerance its outputs meet against a float64 reference (invariant 5 of docs/architecture.md:
// relative RMS error below 1e-5 in fp32, 5e-3 in bf16 and fp16), with the code that builds its
// inputs and runs the kernel and the reference on them. tests/gpu/kernel_cases_test.cpp checks
// every case; bench/decode_kernels_bench.cpp times them: a case added here is both a test and a
// benchmark row. Building the table touches no GPU; a case allocates its inputs when set up.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "lt2/config/model_config.h"
#include "lt2/ops/projections/gemv.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"

namespace lt2::kernel_cases {

inline torch::TensorOptions gpu(torch::ScalarType dt) { return torch::TensorOptions().device(torch::kCUDA).dtype(dt); }

// Invariant 5: relative RMS error below 1e-5 in fp32, 5e-3 in bf16 (and fp16).
inline double tolerance(torch::ScalarType dt) { return dt == torch::kFloat32 ? 1e-5 : 5e-3; }

inline const char* name(torch::ScalarType dt) {
  return dt == torch::kFloat32 ? "fp32" : dt == torch::kBFloat16 ? "bf16" : "fp16";
}

// One comparison of a case's check: `what` it compares, whether it held, and the numbers.
struct Check {
  std::string what;
  bool passed = false;
  std::string detail;
};

// What a case builds its inputs for: a check against the reference (random lengths, NaN poison
// in what must not be read), or timing (every sequence at its full length, weights in copies that
// together exceed the L2 cache where the kernel streams them).
enum class Purpose { Check, Time };

// A case's inputs, allocated on the current GPU, and what runs on them.
struct KernelRun {
  // Non-empty: this device or shape has no such kernel form (why); nothing else is set.
  std::string skip;
  // One call of the kernel, capturable in a CUDA graph (Purpose::Time: successive calls rotate
  // over the weight copies).
  std::function<void()> kernel;
  // One call of what the kernel replaces (the libtorch reference), for timing; empty: none.
  std::function<void()> reference;
  // The reference is timed by graph replay like the kernel (launch-bound elementwise ops and
  // products whose eager launch gaps would dominate) rather than eagerly with the fused kernels off.
  bool reference_in_graph = false;
  // Runs the kernel and compares it with the float64 reference (Purpose::Check).
  std::function<std::vector<Check>()> check;
  double bytes = 0;  // bytes one kernel call must move
  int min_reps = 1;  // calls per captured graph at least: the weight copies one rotation reads
};

struct KernelCase {
  std::string op;     // the op (benchmark --kernels names), e.g. "recurrent_step", "gdn_decode_cluster"
  std::string shape;  // the case within the op, e.g. "B3 H4 K96 V192 delta g/head"
  torch::ScalarType dtype = torch::kBFloat16;
  double tolerance = 0;  // bound on the outputs' relative RMS error against float64
  int64_t batch = 0;     // sequences (rows) of the call
  int64_t context = 0;   // keys per sequence (attention), else 0
  bool model_shape = false;  // at the grid's model shapes (the benchmark's default rows)
  std::function<KernelRun(Purpose)> setup;  // seeds the generator from name() and allocates the inputs

  // op, dtype and shape as one identifier of letters, digits and underscores.
  std::string name() const;
};

// The shapes the model-shaped cases take: the model's GDN and attention heads, widths and
// projections at each batch size, attention at each context, in each dtype; gemv rows at each
// K split (0: the one the kernel picks).
struct CaseGrid {
  ModelConfig model;
  std::vector<torch::ScalarType> dtypes;
  std::vector<int64_t> batches, contexts;
  std::vector<int> gemv_splits{0};
};

// The GPU test's grid: lt2-full-gdn-1.3b at batches 1 and 8, contexts 4096 and 32768, fp32 and bf16.
CaseGrid test_grid();

// Every case: the fixed ones, whose shapes reach each kernel's edges (tails off the tile sizes,
// strided views, the smallest and largest dims it takes), and the model-shaped ones of `grid`.
std::vector<KernelCase> kernel_cases(const CaseGrid& grid);

// The op names, in table order.
const std::vector<std::string>& kernel_ops();

// Inputs and float64 references the cases use, shared with the GPU tests beside the table (graph
// replays, rejected inputs).

// Lengths in [1, L] on the GPU, different per sequence: the first holds one key, the last (B > 1)
// the whole cache.
torch::Tensor random_lengths(int64_t B, int64_t L);
// A cache [B, Hkv, L, D] with NaN in every slot at or past each sequence's length: a kernel that
// reads past a length returns NaN.
torch::Tensor cache_with_poisoned_tail(int64_t B, int64_t Hkv, int64_t L, int64_t D, const torch::Tensor& lens,
                                       torch::ScalarType dt);
// Softmax attention of q [B, Hq, D] over each sequence's first lens[b] keys of k, v [B, Hkv, L, D],
// in float64, one sequence at a time (the keys past a length are never read): [B, Hq, D].
torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& lens, double scale);

// rope_cache_write's inputs: views q [B, H, D], k, v [B, H_kv, D] of one packed
// [B, (H + 2 H_kv) D + 8] projection row (the 8 trailing columns stand for a gate part), and
// caches [B, H_kv, L, D] of random contents.
struct RopeCacheShape {
  int64_t B, H, Hkv, D, L;
  RopeStyle style;
};
struct RopeCacheInputs {
  torch::Tensor packed, q, k, v, k_cache, v_cache;
};
RopeCacheInputs rope_cache_inputs(const RopeCacheShape& shape, torch::ScalarType dt);
// The unfused math in float64 on the CPU: q rotated, the caches with rows seq_pos[b] replaced
// (none for a position past the cache).
struct RopeCacheExpected {
  torch::Tensor q, k_cache, v_cache;
};
RopeCacheExpected rope_cache_reference(const RopeCacheInputs& in, const torch::Tensor& seq_pos, double theta,
                                       RopeStyle style);
// The kernel's rotated q and the caches in `in` after it ran, against `expected`.
std::vector<Check> rope_cache_checks(const RopeCacheInputs& in, const torch::Tensor& q_out,
                                     const RopeCacheExpected& expected, torch::ScalarType dt);

// sparse_attention_decode's inputs (Case.latent: v = k.narrow(-1, 0, Dv), one cache, each row read
// once): caches with a batch stride of two sequences (every other one of a larger buffer, offset
// by one) and rows 8 elements longer than the head dim; q with a head stride of Dk + 8; per
// sequence n distinct rows of [0, L) in random order and counts in [1, n] (random_selection).
struct SparseShape {
  int64_t B, Hq, Hkv, Dk, Dv, L, n;
  bool latent;
};
struct SparseInputs {
  torch::Tensor q, k, v, indices, counts;
  double scale;
};
SparseInputs sparse_inputs(const SparseShape& shape, torch::ScalarType dt);
// Per sequence: n distinct rows of [0, L) in random order, and counts in [1, n] with the first
// sequence at 1 and the last at n. On the GPU: {indices [B, n], counts [B]}.
std::pair<torch::Tensor, torch::Tensor> random_selection(int64_t B, int64_t L, int64_t n);
// sparse_attention_decode_reference on float64 copies (with the absorption and gate, if given).
torch::Tensor sparse_reference64(const SparseInputs& in, const torch::Tensor& absorb = {},
                                 const torch::Tensor& gate = {});

// DSA's lightning-indexer inputs of one decode step: q [B, H, D], w [B, H] fp32 (mixed signs),
// keys [B, L, D] and lengths lens [B] (the first holds one key where B > 1, the last the whole
// cache), with NaN in every key slot at or past a length to check (a kernel that reads one
// poisons its sequence's scores). With `strided`, q and keys are views whose batch, head and row
// strides are not the packed ones.
struct IndexInputs {
  torch::Tensor q, w, keys, lens;
};
// Lengths in [1, L] on the GPU, different per sequence: the last sequence uses the whole cache and
// (B > 1) the first holds one key.
torch::Tensor index_lengths(int64_t B, int64_t L);
IndexInputs index_inputs(int64_t B, int64_t H, int64_t D, int64_t L, torch::ScalarType dt, bool strided,
                         bool poisoned = true);

// dsa_latent_prep's shapes: batch, heads, head dim, latent and rope dims, index heads, index head
// dim and its rope dims, cache length, RoPE style and theta, top-k.
struct PrepShape {
  int64_t B, H, D, dc, dr, HI, dI, r, L;
  RopeStyle style;
  double theta;
  int64_t topk = 4;
};
// lt2-gdn-dsa-1.3b's latent DSA layer at batch 8 (top-k 100, cache 300).
PrepShape dsa_1p3b_prep_shape();
// Positions in [0, L) (B <= L), the last slot among them, on the GPU.
torch::Tensor random_positions(int64_t B, int64_t L);
// The inputs as views of one packed projection output with padded rows (batch strides not the
// packed ones), the outputs NaN (q, index_q, index_w: an unwritten element shows) and the caches
// random strided views (rows the kernel must leave alone).
ops::DsaLatentPrepArgs prep_inputs(const PrepShape& shape, torch::ScalarType dt);
// The same inputs with fresh copies of the outputs and the caches (the reference writes them).
ops::DsaLatentPrepArgs with_output_copies(ops::DsaLatentPrepArgs args);
// got (the kernel's outputs) against want (the reference's): the written values within tol, the
// latent part of q the absorbed q_nope W_uk with `absorb`, else unwritten, and every cache row but
// the one at each position unchanged.
std::vector<Check> prep_checks(const ops::DsaLatentPrepArgs& got, const ops::DsaLatentPrepArgs& want, double tol);

// A pre-norm block's decode tail on y [M, k]: h = residual + (y sigmoid(gate)) Wo^T,
// [a | b] = rms(h) g W13^T, out = h + (silu(a) b) W2^T; with `epilogue` the second product stores
// silu(a) b, otherwise [a | b] and the third applies silu(a) b to its x.
struct BlockTail {
  torch::Tensor y, gate, residual, wo, norm_weight, w13, w2;
  double eps = 1e-5;
  bool epilogue = true;

  BlockTail(int64_t M, int64_t d, int64_t k, int64_t ffn, bool gated, torch::ScalarType dt, bool silu_epilogue = true);
  // The three products as gemv_chain_fused takes them.
  std::vector<ops::ChainProduct> products() const;
  // The three products one at a time through gemv_fused (the epilogue as silu_mul_fused).
  std::vector<torch::Tensor> unchained() const;
  // float64 of each product from the previous product's output as the kernel stored it.
  std::vector<torch::Tensor> reference(const std::vector<torch::Tensor>& got) const;
};

}  // namespace lt2::kernel_cases
