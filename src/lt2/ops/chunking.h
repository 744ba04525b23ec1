// Helpers shared by the chunked forms of the linear-recurrence ops (delta_rule, gated_linear):
// splitting [B, T, H, D] sequences into chunks, chunk-local cumulative log-gates, and decayed
// score matrices built from relative exponents only.
#pragma once
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "lt2/nn/linear.h"  // accum_dtype: the dtype the recurrences compute in

namespace lt2::ops {

using torch::Tensor;

// Turns bf16 autocast off for the scope: the recurrences keep their states, gates and chunk
// products in fp32 (accum_dtype) even when the model runs under autocast.
class Fp32Scope {
 public:
  Fp32Scope() : guard_(c10::autocast_dispatch_keyset) {}

 private:
  c10::impl::ExcludeDispatchKeyGuard guard_;
};

// x: [B, T, H, D] -> [B, H, N, C, D] in dtype `dt`, N = ceil(T / C), the tail zero-padded; packed
// (the cast and the move of the head axis are one copy, and the chunk products read it as is).
Tensor to_chunks(const Tensor& x, int64_t chunk, torch::ScalarType dt);
// y: [B, H, N, C, D] -> [B, T, H, D] in dtype `dt` (drops the padded tail; one copy).
Tensor from_chunks(const Tensor& y, int64_t T, torch::ScalarType dt);
// The chunked forms' outputs O = Q_start S + A V per chunk: q_start [..., C, K], states [..., K, V],
// a [..., C, C], v [..., C, V] with the same leading dims -> [..., C, V], as two batched GEMMs (the
// second accumulates into the first's result: no separate sum pass).
Tensor chunk_outputs(const Tensor& q_start, const Tensor& states, const Tensor& a, const Tensor& v);

// Documents packed into one row (flash-linear-attention's cu_seqlens: document d holds tokens
// cu_seqlens[d] .. cu_seqlens[d + 1] - 1 of T; cu_seqlens[0] = 0, ascending, the last = T, empty
// documents allowed), laid out so that each document is chunked on its own: its tokens fill whole
// chunks, the last one zero-padded, and no chunk holds two documents.
class DocumentChunks {
 public:
  // Throws lt2::Error naming `op` when cu_seqlens does not describe T tokens.
  DocumentChunks(const std::vector<int64_t>& cu_seqlens, int64_t T, int64_t chunk, const torch::Device& device,
                 const char* op);
  int64_t documents() const { return documents_; }  // D, empty ones included
  int64_t chunks() const { return chunks_; }        // N
  const char* op() const { return op_; }            // the op named in errors
  // x [1, T, H, X] -> [1, H, N, C, X] in dtype `dt`, zeros in each document's padding.
  Tensor to_chunks(const Tensor& x, torch::ScalarType dt) const;
  // y [1, H, N, C, X] -> [1, T, H, X] in dtype `dt`.
  Tensor from_chunks(const Tensor& y, torch::ScalarType dt) const;
  // The same layout as token rows, for kernels that read rows: x [1, T, ...] -> [1, N C, ...],
  // each document from a chunk boundary, zeros in its padding; and back.
  Tensor to_padded_rows(const Tensor& x) const;
  Tensor from_padded_rows(const Tensor& y) const;
  // The chunk-local inclusive cumulative log-gate of chunk_cumulative_gate in this layout: g
  // undefined (zeros [1, H, N, C, 1]), [1, T, H] or [1, T, H, K].
  Tensor cumulative_gate(const Tensor& g, int64_t H, torch::ScalarType dt) const;
  Tensor present;      // [D'] int64 on the device: the non-empty documents, ascending
  Tensor first_chunk;  // [D'] int64 on the CPU: each one's first chunk (0 first, ascending)
  Tensor last_chunk;   // [D'] int64 on the device: each one's last chunk

 private:
  const char* op_;
  int64_t documents_ = 0, chunks_ = 0, chunk_ = 0, T_ = 0;
  Tensor slots_;  // [N * C] int64: the token at each chunk position (T: padding)
  Tensor where_;  // [T] int64: each token's chunk position
};

// Chunk-local inclusive cumulative log-gate, always with a trailing channel axis:
//   g undefined      -> zeros [B, H, N, C, 1]      (no decay)
//   g [B, T, H]      -> [B, H, N, C, 1]            (one decay per head)
//   g [B, T, H, K]   -> [B, H, N, C, K]            (one decay per key channel)
// Padded tail tokens get log-gate 0 (no decay), so they leave the state unchanged. On CUDA in fp32
// one kernel each way (DecodeOptions::chunk_gate), else libtorch's copy and cumsum.
Tensor chunk_cumulative_gate(const Tensor& g, int64_t B, int64_t T, int64_t H, int64_t chunk,
                             torch::ScalarType dt, const torch::Device& device);

// Decayed scores within each chunk:
//   S[i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d])   for j < i (strict) or j <= i (inclusive)
//   S[i, j] = 0                                          otherwise.
// a, b: [..., C, K]; G: [..., C, 1] (per-head decay) or [..., C, K] (per-channel decay).
// Only relative exponents G_i - G_j <= 0 are exponentiated; the upper triangle is masked before
// the exp, so nothing overflows and no 0 * inf appears in either pass. Per-channel decay in fp32 on
// CUDA runs one kernel forward and one backward (DecodeOptions::channel_scores).
Tensor decayed_scores(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive);
// The same scores of token tensors a, b [B, T, H, K] cut into the chunks of a per-channel gate G
// [B, H, N, C, K] (fp32): decayed_scores(to_chunks(a, C, fp32), to_chunks(b, C, fp32), G, inclusive),
// [B, H, N, C, C] fp32. On CUDA (DecodeOptions::channel_scores and channel_score_rows on, a and b
// token rows in place with one row stride, of one dtype, fp32 or bf16) the kernels read a's and b's
// rows in place and write their gradients in a's and b's layout and dtype, with no chunk-layout copy
// either way.
Tensor decayed_scores_of_rows(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive);

// The same scores by the kernels without autograd, for a chunked form that runs them inside its own
// autograd node so that q and k take one gradient each rather than one a consumer summed by autograd:
// whether the kernels serve these a, b and G (decayed_scores_of_rows's CUDA condition); with G packed,
// the scores [B, H, N, C, C] fp32, and their backward from d_scores adding a's and b's gradients into da
// and db (in a's and b's layout and dtype; da may be db where a is b) and G's into dG (G's shape, fp32).
// `scale` multiplies the scores (d_scores is then the scaled scores' gradient): a chunked form's A_qk in
// one pass.
bool score_rows_kernel_serves(const Tensor& a, const Tensor& b, const Tensor& G);
Tensor score_rows_by_kernel(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive, double scale = 1.0);
// The delta rule's two: {scale * scores(q, k, inclusive), scores(k, k, strict)} in one pass of the
// forward kernel (k and G read once, each kept pair's exponential taken once for both).
std::pair<Tensor, Tensor> score_row_pair_by_kernel(const Tensor& q, const Tensor& k, const Tensor& G, double scale);
void add_score_rows_backward(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive, const Tensor& d_scores,
                             const Tensor& da, const Tensor& db, const Tensor& dG, double scale = 1.0);
// The pair's backward in one pass of the backward kernel, adding into dq, dk (apart) and dG: d_qk the scaled
// scores' gradient, d_kk the self scores'.
void add_score_row_pair_backward(const Tensor& q, const Tensor& k, const Tensor& G, const Tensor& d_qk,
                                 const Tensor& d_kk, const Tensor& dq, const Tensor& dk, const Tensor& dG,
                                 double scale);

// Whether the CUDA kernels that read token rows take t [B, T, H, D] in place: each token's H D
// elements packed, the tokens evenly t.stride(1) elements apart (a packed tensor, or a column slice
// of a projection's [B, T, width] output).
bool token_rows_in_place(const Tensor& t);

// A gradient buffer of `dtype` in t's token-row layout, as the kernels that read t in place write it:
// packed where t is, else (t a column slice of a wider row) the first H D columns of a
// [B, T, t.stride(1)] buffer.
Tensor gradient_like(const Tensor& t, torch::ScalarType dtype);
// Gradient buffers of `dtype` for those of ts [B, T, H, D] that are column slices of the same rows (one
// storage, one row stride), several of them: one buffer [B, T, row] each such group, each slice's gradient
// at its own columns (undefined for the others). The projection split's backward (columns_gradient) then
// takes that buffer as the projection output's gradient, copying only the other columns into it.
std::vector<Tensor> shared_gradients(const std::vector<Tensor>& ts, torch::ScalarType dtype);

// Per-token log-gate in the layout the step functions use: [B, H, 1, 1] or [B, H, K, 1] (it
// multiplies a [B, H, K, V] state), from g [B, H] or [B, H, K].
Tensor state_decay(const Tensor& g, torch::ScalarType dt);

// Throws unless q, k are [B, T, H, K], v is [B, T, H, V] and g is undefined, [B, T, H] or
// [B, T, H, K]. `op` names the op in the message.
void check_recurrence_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const char* op);

// The state a recurrence starts from: initial_state ([B, H, K, V], checked) in dtype `dt`, or
// zeros when it is undefined.
Tensor initial_or_zero_state(const Tensor& initial_state, int64_t B, int64_t H, int64_t K,
                             int64_t V, torch::ScalarType dt, const torch::Device& device);

}  // namespace lt2::ops
