// Native Sparse Attention (Yuan et al. 2025). Each query head h at position t mixes three softmax
// attention branches with per-head sigmoid gates:
//   o_t = g_cmp * Attn(q_t, K_cmp, V_cmp) + g_slc * Attn(q_t, K_slc, V_slc) + g_win * Attn(q_t, K_win, V_win)
//   [g_cmp, g_slc, g_win] = sigmoid(x W_g + b)      per head; W_g zero, b = [-2, -2, +2] at init
//                                                   (lucidrains' choice: start on the window branch)
// * compression: block i covers tokens [i d, i d + l) (length l, stride d; d < l overlaps) and is
//   visible to t once it is complete (i d + l - 1 <= t). Compressed key/value = mean of the block
//   ("mean") or an MLP of the block plus a learned intra-block position embedding ("mlp":
//   vec(k_blk + E) -> Linear(l D, hidden) -> ReLU -> Linear(hidden, D), one MLP for K, one for V,
//   shared by the KV heads). Keys are compressed after RoPE (as fla does), so the compressed
//   keys carry their block's positions.
// * selection: selection blocks of l' tokens; importance of block j for query t = the compressed
//   attention probabilities, summed over the query heads of the GQA group and mapped to selection
//   blocks by the paper's sum (ops/sparse_attention/sparse_attention.h, nsa_overlap_matrix); block 0 and the
//   `local_blocks` blocks ending at t's own block are forced; the top `select_count` blocks (forced
//   ones included, ties to the lower block) are attended, causally within the current block.
// * sliding window of the last `window` tokens (itself included).
// Selection indices carry no gradient.
//
// Forms (option "form"):
//   "simplified" (default; fla): mean pooling, l = d = l' = 64, n 16, w 512, one K/V shared by the branches
//   "paper":     MLP compression, l 32, d 16, l' 64, n 16, w 512, separate K/V per branch
// and every field may be set on its own: compress_block, compress_stride, select_block,
// select_count, local_blocks (2), window, compression ("mean" | "mlp"), compress_hidden (4 D),
// shared_kv.
//
// Decode state: the KV cache of each K/V set (one, or three when separate), plus the compressed
// K/V cache, which gains a block whenever one completes. The state stores no block count: the
// blocks complete within a sequence's first n tokens are nsa_num_blocks(n, l, d), so a batch of
// sequences of different lengths (Positions::seq_pos) shares one state.
#pragma once
#include <array>

#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"

namespace lt2 {

struct NSAState : MixerState {
  std::vector<Tensor> k, v;  // per K/V set: [B, H_kv, max_len, D]
  Tensor k_cmp, v_cmp;       // [B, H_kv, max_blocks, D] compressed blocks, block i at row i
  // Cache rows one decode step reads per branch (cmp, slc, win), for decode_bytes: the l tokens
  // compressed into a new block, the n l' selected tokens, the window.
  std::array<int64_t, 3> branch_rows{};
  int64_t bytes() const override;
  std::unique_ptr<MixerState> slice(int64_t begin, int64_t count) const override;
  // A decode step reads every compressed block (the compression branch masks them) and, of each
  // K/V set, the rows its branches read, at most the length + 1 tokens held after the step.
  int64_t decode_bytes(int64_t length) const override;
  std::vector<Tensor> tensors() const override;
  std::vector<int64_t> token_axes() const override;
  void reset() override { length = 0; }
};

class NSAImpl : public MixerImpl {
 public:
  NSAImpl(const ModelConfig& cfg, const json& options);
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr) override;
  std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len,
                                         torch::TensorOptions opts, const LoopSettings& loop = {}) const override;
  std::string kind() const override { return "nsa"; }
  // One token per sequence; per-sequence positions go to step_at.
  Tensor step(const Tensor& x, const Positions& pos, MixerState& state) override;
  // Decode with per-sequence positions (x [B, 1, d], token b at pos.seq_pos[b] = p_b): the K/V
  // caches written at p_b; the block ending at p_b compressed and written where one completes;
  // the three branches over each sequence's own tokens <= p_b. Fixed shapes, no host read of the
  // positions (CUDA-graph capturable). On CUDA without autograd the selection and window branches
  // run the fused sparse-attention decode kernel over the cache rows they read.
  Tensor step_at(const Tensor& x, const Positions& pos, NSAState& s);

  enum Branch { kCmp = 0, kSlc = 1, kWin = 2 };
  // What x projects to, by one GEMM (x's gradient from one product): the queries [B, T, H, D] and
  // each K/V set's keys [B, T, H_kv, D] with RoPE at positions pos.start..start+T-1 (or
  // pos.seq_pos[b]), its values, and the branch gates' logits x W_g + b [B, T, H, 3] in the order
  // (cmp, slc, win).
  struct Projected {
    Tensor q;
    std::vector<Tensor> k, v;
    Tensor gate_logits;
  };
  Projected project(const Tensor& x, const Positions& pos);
  // The K/V set a branch reads (0 when shared).
  int64_t kv_set(Branch b) const { return shared_kv ? 0 : b; }
  // Compressed keys and values of the complete blocks of k, v: [B, L, H_kv, D] -> [B, NC, H_kv, D].
  std::pair<Tensor, Tensor> compress(const Tensor& k, const Tensor& v);
  // Visibility of the NC compressed blocks from queries at q_pos ([T] or [B, 1, 1]): block i once
  // complete, i d + l - 1 <= q_pos. [..., T, NC] bool.
  Tensor compressed_visible(const Tensor& q_pos, int64_t NC) const;
  // Selection-block importance from the compressed-attention probabilities p_cmp [B, H, T, NC]:
  // summed over the query heads of each group, mapped to NS selection blocks. [B, H_kv, T, NS].
  Tensor block_importance(const Tensor& p_cmp, int64_t NS) const;
  // The branch outputs ([B, T, H, D] each) summed with their sigmoid gates, and the output projection:
  // [B, T, d].
  Tensor combine(const Tensor& gate_logits, const Tensor& o_cmp, const Tensor& o_slc, const Tensor& o_win);

  int64_t n_heads, n_kv_heads, head_dim;
  int64_t compress_block, compress_stride, select_block, select_count, local_blocks, window;
  bool mlp_compression, shared_kv;
  int64_t compress_hidden;

  torch::nn::Linear wq{nullptr}, wo{nullptr}, wg{nullptr};
  std::vector<torch::nn::Linear> wk, wv;  // one per K/V set (1 shared, or cmp, slc, win)
  Tensor pos_k, pos_v;                    // [l, D] intra-block position embeddings (mlp)
  torch::nn::Sequential mlp_k{nullptr}, mlp_v{nullptr};

 private:
  double rope_theta;
  RopeStyle rope_style;
};

}  // namespace lt2
