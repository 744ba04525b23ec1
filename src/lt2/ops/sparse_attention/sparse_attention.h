// Reference math of the sparse softmax-attention mixers (sliding window, DSA, NSA), in plain libtorch
// ops (CPU and GPU, autograd): masked attention, deterministic top-k, the DSA lightning indexer and
// its KL training signal, and NSA's block compression and block selection.
//
// Positions are absolute token positions; a key is "visible" from a query by a boolean mask
// (true = attend). Masks are built from integer positions, never from the tensors' values, so the
// parallel forward, a chunked prefill and token-by-token decode select exactly the same keys.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>

namespace lt2 {

using torch::Tensor;

// Causal band: query at absolute position q_pos[i] sees the key at k_pos[j] when
// q_pos[i] - window < k_pos[j] <= q_pos[i] (W keys including itself; window 0 = unbounded, plain
// causal). q_pos: [T], k_pos: [L] int64 -> [T, L] bool.
Tensor window_mask(const Tensor& q_pos, const Tensor& k_pos, int64_t window);

// Softmax attention of q [B, H, T, D] over k, v [B, H_kv, L, D] (GQA: H_kv divides H, query head
// h reads key head h / (H / H_kv)) restricted by `mask` broadcastable to [B, H, T, L]: bool (true =
// attend), or additive in q's dtype (0 to attend, -inf not).
// Values may have their own width: v [B, H_kv, L, D_v]. Scores are scaled by `scale` (0 = D^-1/2).
// Every query must see at least one key. Returns [B, T, H, D_v].
Tensor masked_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                        double scale = 0);

// Causal sliding-window attention of the queries q [B, H, T, D] at the last T of L contiguous key
// positions (k, v [B, H_kv, L, D], T <= L, GQA as above): query i, at position L - T + i, sees the
// keys in (L - T + i - window, L - T + i]; window 0 = plain causal. The result of masked_attention
// with window_mask over those positions. Where window_flash_serves holds it runs libtorch's
// FlashAttention-2 kernels with their window bound, forward and backward (an autograd function),
// which skip the key blocks outside the band: O(T * window) work where the mask costs O(T * L);
// elsewhere masked_attention. Returns [B, T, H, D].
Tensor window_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t window, double scale = 0);

// Whether window_attention takes FlashAttention-2 for these inputs: DecodeOptions::window_flash on,
// CUDA tensors of one dtype, bf16 or fp16, on a GPU of compute capability 8.0 or newer, head dim a
// multiple of 8 up to 256 for queries, keys and values alike, query heads a multiple of key heads,
// T <= L.
bool window_flash_serves(const Tensor& q, const Tensor& k, const Tensor& v);

// The same attention computed explicitly, also returning the probabilities [B, H, T, L] (zero on
// masked keys). A query that sees no key gets probabilities 0 and output 0 (NSA's compression
// branch before the first block completes). Returns {out [B, T, H, D_v], probs}.
std::pair<Tensor, Tensor> masked_attention_probs(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& mask, double scale = 0);

// The softmax probabilities alone of that attention, [B, H, T, L] in the accumulation dtype (fp32,
// or float64 for float64 inputs): zero on masked keys, all zero for a query that sees no key. With
// zero_rows_without_keys false such a query's row is left NaN, one pass fewer over the
// probabilities, for a caller that masks those rows itself (the indexer loss's KL target).
Tensor attention_probs(const Tensor& q, const Tensor& k, const Tensor& mask, double scale = 0,
                       bool zero_rows_without_keys = true);

// Indices of the k largest entries of `scores` along the last dim, among those where `visible`
// (same shape, bool) is true. Order: by score descending; **equal scores -> lower index first**
// (stable sort), so selection is deterministic. Rows with fewer than k visible entries return all
// visible ones first and then invisible ones: use topk_mask when that matters. [..., L] -> [..., k']
// with k' = min(k, L).
Tensor topk_indices(const Tensor& scores, const Tensor& visible, int64_t k);

// Boolean selection mask [..., L]: the top-k visible entries per row (ties as in topk_indices);
// a row with at most k visible entries selects all of them.
Tensor topk_mask(const Tensor& scores, const Tensor& visible, int64_t k);

// DSA lightning indexer (spec §6.1): I[b, t, s] = sum_j w[b, t, j] * ReLU(q[b, t, j, :] . k[b, s, :]).
// q: [B, T, H_I, d_I], w: [B, T, H_I] (scales already folded in), k: [B, L, d_I] -> [B, T, L].
Tensor lightning_indexer_scores(const Tensor& q, const Tensor& w, const Tensor& k);

// The indexer's KL training signal (spec §6.2, as the HF port computes it):
//   p_t = sum_heads attn_probs[:, :, t, :] restricted to support_t, L1-normalised, detached
//   loss = mean_{b,t} sum_{s in support_t} p_ts (log p_ts - log softmax_{support_t}(I_t)_s)
// attn_probs: [B, H, T, L] (the main attention's probabilities), index_scores: [B, T, L],
// support: [B, T, L] bool (dense warm-up: every causally visible key; sparse stage: the selected
// set). Returns a scalar in the accumulation dtype (fp32, or float64 for float64 inputs).
Tensor indexer_kl_loss(const Tensor& attn_probs, const Tensor& index_scores, const Tensor& support);

// DSA's key selection for query rows at absolute positions [query_start, query_start + n): index
// queries iq [B, n, H_I, d_I] and weights iw [B, n, H_I] over the index keys index_k [B, L, d_I] at
// positions 0..L-1. topk 0: every causally visible key (the dense warm-up); else the top-k visible
// ones (topk_mask). With DecodeOptions::dsa_index_kernels, on sm_90 and where no gradient is taken,
// the decode kernels score and select (ops::dsa_index_scores, ops::topk_select: the same set).
struct IndexerSelection {
  Tensor scores;   // [B, n, L], lightning_indexer_scores on the visible keys (the kernels: -inf elsewhere)
  Tensor support;  // [B, n, L] bool, the keys each row attends to
};
IndexerSelection indexer_select(const Tensor& iq, const Tensor& iw, const Tensor& index_k, int64_t query_start,
                                int64_t topk);
// Whether indexer_select takes the decode kernels for these inputs (DecodeOptions::dsa_index_kernels):
// CUDA on sm_90 (topk_select's clusters), no gradient, shapes dsa_index_topk takes, at most 65535 rows.
// They write the [B, n, L] fp32 scores and no [B, n, H_I, L] logits.
bool indexer_kernels_serve(const Tensor& iq, const Tensor& index_k, int64_t topk);

// DSA's attention where no gradient is taken (prefill) on the decode kernels, in blocks of
// `block_rows` query rows: per sequence, the rows' index scores and top-k slots (as indexer_select
// selects), then sparse attention of q [B, H, T, D] over those k slots of k [B, H_kv, L, D] and
// v [B, H_kv, L, D_v] (ops::sparse_attention_decode_fused, its shapes: the GQA head dims 64/128/256
// and the latent 576/512), the queries at positions query_start .. query_start + T - 1. Work and
// reads O(T k) instead of the masked form's O(T L). Returns [B, T, H, D_v], or undefined, having run
// nothing, where the kernels do not serve (DecodeOptions::dsa_sparse_prefill or dsa_index_kernels
// off, no sm_90, a gradient recorded, topk >= L, shapes the kernels do not take).
Tensor indexer_topk_attention(const Tensor& iq, const Tensor& iw, const Tensor& index_k, const Tensor& q,
                              const Tensor& k, const Tensor& v, int64_t query_start, int64_t topk, double scale,
                              int64_t block_rows);

// The lightning indexer's queries and weights of a call's rows from what they read:
// (iq [B, T, H_I, d_I], iw [B, T, H_I]).
using IndexerQueries = std::function<std::pair<Tensor, Tensor>(const Tensor& x)>;

// DSA's indexer training signal over one call, without its dense activations: indexer_select for
// every query row, then indexer_kl_loss against the head-summed probabilities of the main attention
// q [B, H, T, D] over k [B, H_kv, L, D] on the selected keys (`scale` as in masked_attention; q and k
// are the target, so no gradient reaches them). With (iq, iw) = queries(x), the value and gradients
// equal those of
//   sel = indexer_select(iq, iw, index_k, query_start, topk);
//   indexer_kl_loss(attention_probs(q, k, sel.support[:, None], scale), sel.scores, sel.support)
// but no [B, H, T, L] probabilities, [B, T, H_I, L] index logits or queries are kept for the
// backward: the rows go in blocks of about `block_bytes` each (indexer_loss_row_bytes a row), each
// over the keys its last row can see; the forward keeps the loss's gradient with respect to each
// block's scores (exact, in closed form: the target is fixed), and the backward calls queries(x) again and recomputes a block's scores to carry it to
// index_k and the queries. The queries' gradients go on, inside the backward, into what `queries`
// reads besides x (accumulated into their .grad, as activation checkpointing does); x itself takes
// none and must not require one. `queries` must give the same values each call and own what it
// captures. The index products run in the queries' autocast dtype where the caller runs under
// autocast (product_dtype), in forward and backward alike.
struct IndexerLoss {
  Tensor loss;     // scalar, accumulation dtype
  Tensor support;  // [B, T, L] bool, the selection (no gradient)
};
IndexerLoss indexer_loss_blocked(const IndexerQueries& queries, const Tensor& x, const Tensor& index_k,
                                 const Tensor& q, const Tensor& k, int64_t query_start, int64_t topk, double scale,
                                 int64_t block_bytes);

// The bytes a query row of indexer_loss_blocked holds at once over `keys` keys, for `batch`
// sequences, `heads` attention heads and `index_heads` index heads; `kernels`: the selection runs on
// the decode kernels (no dense [H_I, keys] logits).
int64_t indexer_loss_row_bytes(int64_t batch, int64_t heads, int64_t index_heads, int64_t keys, bool kernels);

// ---- NSA (spec §7) ----

// Number of compression blocks of length `block` and stride `stride` lying fully inside the first
// `length` tokens: block i covers tokens [i*stride, i*stride + block).
int64_t nsa_num_blocks(int64_t length, int64_t block, int64_t stride);

// Blocks of x [B, L, H, D]: [B, NC, H, block, D] (NC = nsa_num_blocks(L, block, stride)),
// block i = x[:, i*stride : i*stride + block].
Tensor nsa_unfold_blocks(const Tensor& x, int64_t block, int64_t stride);

// Overlap matrix [NC, NS] (dtype of `opts`) from compression blocks (length l, stride d) to
// selection blocks (length l', selection block j covers [j*l', (j+1)*l')): entry (i, j) = number of
// stride units of d tokens the two blocks share. With it, the paper's block importance
// p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n] (written with 0-based blocks
// that start at token 0) is p_slc = p_cmp @ overlap. Requires d | l and d | l'.
Tensor nsa_overlap_matrix(int64_t n_cmp, int64_t n_slc, int64_t l, int64_t d, int64_t l_sel,
                          torch::TensorOptions opts);

// NSA block selection. importance: [B, H_kv, T, NS] (compressed-attention probabilities summed
// over the query heads of each group, mapped to selection blocks), q_pos: absolute positions [T],
// or any shape broadcastable to [B, H_kv, T] (decode: [B, 1, 1], one position per sequence).
// Blocks starting after the query are invisible; block 0 and the `n_local` blocks ending at the
// query's own block are always selected; then the highest-importance visible blocks up to
// `n_select` in all (ties: lower block first). Returns the selected-block mask [B, H_kv, T, NS]. On
// CUDA one kernel (DecodeOptions::nsa_selection_kernels; an fp32, bf16 or fp16 importance, NS <= 256)
// selects exactly the set of the libtorch top-k it replaces.
Tensor nsa_select_blocks(const Tensor& importance, const Tensor& q_pos, int64_t block,
                         int64_t n_select, int64_t n_local);
// The additive mask of NSA's selection branch for query rows r0 .. r0 + n - 1 of T (at the last T of L
// positions) over the first `keys` keys: [B, H_kv G, n, keys] in `dt`, 0 where the row sees key j (causally
// visible, and its block j / block selected for the row's kv head in `selected`, bool [B, H_kv, T,
// ceil(L / block)]) and -inf elsewhere, each kv head's rows for its G query heads. Rows padded to 16
// elements (a view of wider rows): the fused attention kernels read the mask in aligned rows. With
// `kernel`, one CUDA kernel writes it where it takes the inputs (CUDA, contiguous `selected`, block a
// multiple of 8, a kernel dtype); else one broadcast libtorch `where`. The selection branch's fused
// path passes DecodeOptions::nsa_selection_kernels as it was at the forward.
Tensor nsa_selection_bias(const Tensor& selected, int64_t block, int64_t G, int64_t L, int64_t T, int64_t r0, int64_t n,
                          int64_t keys, torch::ScalarType dt, bool kernel);
// NSA's selection branch: softmax attention of q [B, H, T, D] at the last T of L positions over k, v
// [B, H_kv, L, D] (GQA as masked_attention), query t seeing key j when j is causally visible from it
// and selected[b, h / G, t, j / block] (bool [B, H_kv, T, ceil(L / block)], nsa_select_blocks'
// mask); `scale` as masked_attention. Equals masked_attention with that mask expanded to the keys.
// On CUDA in bf16 or fp16 (training under autocast; fp32 keeps the masked form's accuracy) the query rows go
// in blocks whose [B, H, n, keys] additive mask takes about `block_bytes`, each through libtorch's fused
// attention (cuDNN's where its SDPA takes that, else the memory-efficient kernel), and no mask is kept
// for the backward: it is made again from `selected`
// block by block (the [B, H, T, L] mask of the masked form is 6 GB in bf16 at 4 x 8192 tokens and 12
// heads, a layer application). Elsewhere masked_attention. Returns [B, T, H, D_v].
Tensor selected_block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& selected,
                                int64_t block, double scale = 0, int64_t block_bytes = int64_t{512} << 20);
// Whether selected_block_attention takes the memory-efficient kernels for these inputs: CUDA, q, k and
// v of one dtype (bf16 or fp16), q's and k's head dims equal, head dims multiples of 8, T <= L.
bool selected_block_kernels_serve(const Tensor& q, const Tensor& k, const Tensor& v);

// The same selection as block indices [B, H_kv, T, min(n_select, NS)]: the selected blocks (the
// mask's true entries) first, then, where fewer than n_select blocks are visible, invisible ones
// (all past the query's block).
Tensor nsa_select_block_indices(const Tensor& importance, const Tensor& q_pos, int64_t block,
                                int64_t n_select, int64_t n_local);

}  // namespace lt2
