// How the inference paths run: which fused CUDA kernels they take and the kernels' launch
// settings. Every field is an A/B switch or a tuning bound; the defaults are the measured best
// (docs/decode.md has the knob table and what each one traded). The engine owns one
// DecodeOptions and installs it (DecodeOptionsGuard) around everything it runs; the ops read the
// options in force and pass the kernel settings down in the kernels' params. Outside any guard
// the defaults apply.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lt2 {

struct DecodeOptions {
  // The fused CUDA kernels at all: off runs the libtorch reference ops (the reference path of
  // `lt2 bench --paths reference`). Without CUDA kernels in the build it has no effect.
  bool fused = true;
  // The projections as the fused tensor-core GEMV (off: cuBLAS through at::linear).
  bool fused_gemv = true;
  // A block's dependent products in one persistent chained kernel (off: one GEMV each).
  bool gemv_chain = true;
  // Rows up to which the whole block tail (output projection, w1|w3, w2) is one chain; above it
  // the chain stops before w2.
  int64_t chained_tail_max_rows = 4;
  // The GDN step loads its state before waiting on the projection launched just before it.
  bool gdn_early_state = true;
  // The delta-rule family's recurrence over the chunks as one CUDA kernel (fp32 recurrences), in
  // prefill and training alike (the backward's adjoint scan as the forward saw it).
  bool delta_rule_scan = true;
  // The value columns of S a block of that kernel owns (8, 16 or 32); 0: the launcher's choice
  // (the widest that fits, narrowed while the grid has fewer blocks than SMs).
  int scan_value_block = 0;
  // The causal short convolution (+ SiLU) of the linear mixers as one CUDA kernel forward and one
  // backward, in prefill and training (off: the libtorch reference; decided at forward time).
  bool short_conv = true;
  // The linear mixers' gated RMSNorm and q/k L2 norm as one CUDA kernel forward and one backward,
  // in prefill and training (off: the libtorch reference; decided at forward time).
  bool row_norm = true;
  // The block norms before products (ops::rms_norm_for_products) written by those kernels in bf16
  // under CUDA bf16 autocast in training, with fp32 x (off: in fp32, each product casting it).
  bool norm_products_dtype = true;
  // Each residual add h = x + m and the block RMSNorm of h after it (ops::add_rms_norm: the FFN's
  // norm, and the next block's mixer norm over a block's two output parts) as one row-norm kernel
  // forward and one backward in training, the backward adding h's other gradient and writing m's in
  // m's dtype (off: the add and the norm apart, autograd summing and casting).
  bool residual_norm = true;
  // SwiGLU's silu(a) * b and attention's output gate o * sigmoid(g) as one CUDA kernel forward and
  // one backward, in prefill, decode and training (off: the libtorch ops; where no gradient is
  // taken the kernel also needs `fused`).
  bool gated_product = true;
  // The LM head loss's softmax cross-entropy against hard labels (each chunk's loss and gradient from its
  // fp32 logits) as one CUDA kernel a chunk (off: log_softmax, gather, exp and scatter in libtorch).
  bool cross_entropy_kernel = true;
  // RoPE of the attention mixers' q and k at positions start.. as one CUDA kernel forward and one
  // backward (the inverse rotation), in prefill and training (off: the libtorch reference; decided
  // at forward time).
  bool rope = true;
  // The chunk preparation of the delta rule with one decay per head or none (L, its inverse, U, W,
  // the decayed queries and keys) as one CUDA kernel forward and one backward (prefill and
  // training); off: libtorch ops. Needs delta_rule_scan on.
  bool delta_rule_prepare = true;
  // The gated linear family's chunk preparation with one decay per head or none (Mamba2, RetNet,
  // linear attention: the decayed queries and keys, the intra-chunk scores, U = V) by the same
  // kernels in their additive mode, forward and backward, then the chunk scan without W (prefill
  // and training); off: libtorch ops and gated_prefix_chunks' choice. Needs delta_rule_scan on.
  bool gated_linear_prepare = true;
  // The same kernels' preparation with one decay per key channel (KDA, GLA, HGRN2: the decayed queries
  // and keys per channel, U and W of the UT transform for KDA), the intra-chunk scores coming from
  // channel_scores' decayed_scores, forward and backward (prefill and training); off: libtorch ops.
  // Needs delta_rule_prepare (KDA) or gated_linear_prepare (GLA, HGRN2) on.
  bool channel_gate_prepare = true;
  // The chunked forms' outputs O_n = Q_n S_n + A_n V_n (delta rule and gated family) as one CUDA
  // kernel writing the token layout in the output dtype, in prefill and training (the backward is
  // libtorch's products); off: two batched GEMMs and a copy to the token layout.
  bool delta_rule_output = true;
  // Its backward (dQ_n, dS_n, dA_n, dV_n from the output's gradient in its token layout) as one CUDA
  // kernel where the forward ran the kernel and K <= 128; off: four batched GEMMs on the gradient
  // copied into fp32 chunks. Read when the forward runs.
  bool delta_rule_output_backward = true;
  // Causal sliding-window and plain causal attention over a contiguous run of keys (the window
  // mixer's whole-sequence forward, NSA's window branch) through libtorch's FlashAttention-2
  // kernels with their window bound, forward and backward, on CUDA in bf16/fp16 (off: SDPA with a
  // boolean mask, which scores every key).
  bool window_flash = true;
  // The per-channel decayed scores of the chunked gated forms (GLA's and HGRN2's intra-chunk
  // scores, KDA's and its UT transform's) as one CUDA kernel forward and one backward, in fp32, in
  // prefill and training (off: the libtorch sub-chunk form).
  bool channel_scores = true;
  // Those kernels reading q and k where the chunked forms hold them, token rows [B, T, H, K] in their
  // dtype, and writing their gradients there (off: fp32 copies of q and k in the chunk layout, and
  // the gradients copied back).
  bool channel_score_rows = true;
  // KDA's two intra-chunk scores where the preparation runs them (scale * scores(q, k) and scores(k, k)) by
  // one pass of those kernels forward and one backward, sharing the reads of k and G and the decay
  // factors (off: a pass each way for each; decided at forward time).
  bool channel_score_pairs = true;
  // The chunk scan's backward on CUDA kernels around the adjoint scan: its products (dKt = G_{n+1}
  // V_n^T, dW = -dU_n S_n^T and the decay's gradient sum_v G_{n+1} S_n) as one kernel reading each
  // operand once, and its inputs -Kt^T and -W^T by a tiled transpose (off: two batched GEMMs and a
  // row-dot kernel, which read G_{n+1} and S_n twice each; libtorch's negation of the transposed views).
  bool scan_backward_products = true;
  // The chunk preparation's backward writing the gradients of q, k and v, where several are column slices
  // of one projection's output (GLA's), into one buffer as wide as that output, which the split's backward
  // then takes as the output's gradient, copying only the other columns in (off: a buffer each, of which
  // the split's backward takes one and copies every other block in; decided at forward time).
  bool shared_slice_gradients = true;
  // The chunk-local cumulative log-gate of the chunked forms (ops::chunk_cumulative_gate: the token
  // layout into the chunk layout and the sum within each chunk, its backward the reverse sum and the
  // layout back) as one CUDA kernel each way, fp32 (off: libtorch's copy and cumsum, and their
  // backward's flips, cumsum and copy).
  bool chunk_gate = true;
  // The gated linear family's log-sigmoid decay (GLA's g = log_sigmoid(x) / normalizer, HGRN2's g and
  // its input gate 1 - exp(g)) as one CUDA kernel forward and one backward, reading the logits in
  // place (prefill, decode and training; off: the libtorch ops).
  bool log_sigmoid_gate = true;
  // Mamba2's values scaled by their step (ops::scale_heads: v = dt x in x's dtype) as one CUDA kernel
  // forward and one backward, reading x in place (prefill, decode and training; off: libtorch's
  // products in fp32, casts and the sum of dt's gradient).
  bool scale_heads = true;
  // The gated delta rule's gates (GDN's and KDA's g and beta from their raw projections) as one CUDA
  // kernel, and under autograd one more for their backward (prefill and training); off: the libtorch
  // form.
  bool delta_rule_gates = true;
  // The gated linear family's chunked form (ops::gated_linear_chunked): the states at the chunk
  // starts as one decay-weighted prefix product up to this many chunks (no loop, but N^2 work and
  // memory), the chunk scan beyond (linear in the chunks; one CUDA kernel in fp32). 0: always the
  // scan; -1: 128 on the CPU (the measured crossover), no limit on CUDA (the prefix product's TF32
  // GEMMs measured faster there at 32 and 64 chunks, estimated so to well past 32k tokens).
  int64_t gated_prefix_chunks = -1;
  // NSA's combination of its branches, sum_i sigmoid(g_i) o_i (ops::sigmoid_gated_sum), as one CUDA kernel
  // forward and one backward (prefill and training; off: libtorch's sigmoid, products and sums).
  bool gated_sum = true;
  // NSA's block selection (the top-n blocks of each query row's importance) and its selection branch's
  // additive masks as CUDA kernels, in prefill and training (off: libtorch's top-k over int64 keys and a
  // broadcast `where`; the masks' choice is kept from the forward for the backward).
  bool nsa_selection_kernels = true;
  // DSA's selection in whole-sequence calls (prefill, and training's top-k and indexer-loss forward)
  // on the decode kernels: the index scores of a sequence's query rows against its index keys in one
  // dsa_index_scores launch (the rows share the keys), then topk_select; CUDA, sm_90, no gradient
  // (off: libtorch's dense [rows, H_I, L] logits and a top-k of int64 keys).
  bool dsa_index_kernels = true;
  // The indexer loss's target (the main attention's head-summed probabilities on the support) in
  // one kernel, ops::dsa_head_probs, reading the bf16 scores (off: libtorch's masked fill, fp32
  // softmax, head sum and normalisation over [B, H, rows, keys]).
  bool dsa_head_probs = true;
  // DSA's prefill attention over the top-k slots on the decode kernels (indexer_topk_attention:
  // O(T k) gathered reads, no reuse across query rows) instead of masked attention over every
  // visible key. Off by default: on an H100 the DSA layer's no-gradient forward at 8 x 4096 took
  // 123.9 ms with it against 42.4 ms without (bench/results/dsa_training_h100.md).
  bool dsa_sparse_prefill = false;
  // Rows up to which DSA folds its q absorption into the latent prep and its output absorption
  // into the attention's combine.
  int64_t dsa_fold_q_max_rows = 1;
  int64_t dsa_fold_o_max_rows = 1;
  // Cap on the thread-block cluster of DSA's top-k (0: the largest the device places, up to 16;
  // 8 is the portable size).
  int topk_max_blocks = 0;
  // Cap on the chain kernel's TMA ring slots (0: as many as shared memory holds).
  int gemv_chain_slots = 0;
  // Programmatic dependent launches of the decode kernels (off: every launch an ordinary one).
  bool pdl = true;
  // Kernel-name prefixes launched plainly even with pdl on ("gemv", "topk", ...).
  std::vector<std::string> pdl_off;

  // Whether the kernel named `kernel` launches as a programmatic dependent.
  bool pdl_for(const char* kernel) const;
  // Sets the field `name` (as in docs/decode.md and `lt2 bench --decode-option`) from text;
  // throws lt2::Error naming the field and the expected value on a bad name or value.
  void set(const std::string& name, const std::string& value);
  // Every field with its value, as "name=value" (the benchmark's JSON records them).
  std::vector<std::string> describe() const;
  // The field names `set` takes.
  static const std::vector<std::string>& names();
};

// The options in force on this thread: the innermost DecodeOptionsGuard's, else the defaults. Autograd
// runs a CUDA backward on a thread of its own: an autograd function whose backward reads a switch saves
// it in its forward and installs it there (ChunkStateScanFunction, the loop checkpoint).
const DecodeOptions& decode_options();

// True when this build has the CUDA kernels (LT2_CUDA on and nvcc found). Without them every
// kernel entry point throws and the dispatching ops always take their references. A constant, so
// that a CPU-only build compiles the kernels' input checks away (they name kernel queries that
// only the CUDA build defines).
constexpr bool fused_decode_available() {
#ifdef LT2_WITH_CUDA
  return true;
#else
  return false;
#endif
}
// Whether the decode paths take the fused kernels: DecodeOptions::fused of the options in force,
// and false in a build without the CUDA kernels.
bool fused_decode_enabled();

// Installs `options` on this thread until destroyed (nests; restores the previous ones).
class DecodeOptionsGuard {
 public:
  explicit DecodeOptionsGuard(const DecodeOptions& options);
  ~DecodeOptionsGuard();
  DecodeOptionsGuard(const DecodeOptionsGuard&) = delete;
  DecodeOptionsGuard& operator=(const DecodeOptionsGuard&) = delete;

 private:
  const DecodeOptions* previous_;
};

}  // namespace lt2
