// DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer scores every causally visible
// key of each query,
//   I[t, s] = sum_j w[t, j] * ReLU(q^I[t, j] . k^I[s])         (H_I heads, one indexer key per token)
//   q^I = RoPE(x W_qI),  k^I = RoPE(LayerNorm(x W_kI)),  w = x W_w * H_I^-1/2 * d_I^-1/2
// (RoPE, rotate-half, on the first `index_rope_dim` dims, as the later DeepSeek code does), and
// softmax attention reads only the top-k keys of each query (all of them when fewer are visible),
// one token set shared by all heads of the layer. Ties in the index scores go to the lower
// position. The selection carries no gradient, and the indexer sees its input detached: it learns
// only from its KL loss (spec §6.2; the auxiliary-loss hook, train/aux_loss.h), the rest of the layer only from the
// model's loss.
//
// Attention forms (option "attention"):
//   "gqa"    (default) the full-attention block's projections, RoPE, GQA and SDPA output gate
//   "latent" one shared latent KV head, MLA in its MQA mode (DeepSeek V3.2's DSA):
//            c = RMSNorm(x W_dkv) [d_c], k_r = RoPE(x W_kr) [d_r], one per token, shared by all heads;
//            head h: q_h = [q^nope_h W_uk,h | RoPE(q^rope_h)],  key = [c | k_r],  value = c,
//            scale (D + d_r)^-1/2;  o_h = (softmax . c) W_uv,h  [D];  out = W_o(concat_h o_h * gate)
//
// Indexer training stages (set through the auxiliary-loss hook, MixerImpl::aux_loss(), or
// set_indexer_stage below):
//   off           sparse attention, no indexer loss (inference, or a fixed indexer)
//   dense_warmup  dense causal attention; each parallel forward records KL(p || softmax(I)) over
//                 all visible keys (only the indexer should train: the trainer freezes the rest)
//   sparse        top-k attention; records the KL restricted to the selected set
// The stage sets the attention pattern for forward and decode alike, so decode == forward holds in
// every stage. Losses are recorded by the parallel forward without a state, one per call (one per
// (layer, loop) in a looped model), until taken.
//
// Options (mixer.dsa): topk (2048), index_heads (64), index_head_dim (128), index_rope_dim
// (index_head_dim / 2), attention ("gqa"), latent_dim (512), latent_rope_dim (64).
//
// Decode state: the KV cache (GQA: k, v [B, H_kv, max_len, D]; latent: [c | k_r] [B, 1, max_len,
// d_c + d_r]) plus the indexer-key cache [B, max_len, d_I]; a decode step reads the index keys and
// then only the top-k cached tokens.
//
// Fused decode (latent form, inference: packed, CUDA, no gradient, the preset's 512 + 64 latent
// dims): one GEMV for all input projections, one dsa_latent_prep launch (RoPE, norms, both cache
// rows), the absorptions as batched GEMVs (gate folded into o W_uv), index top-k, sparse
// attention, wo: about ten kernels a layer instead of ~70.
#pragma once
#include "lt2/mixers/full_attention.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

enum class IndexerStage { Off, DenseWarmup, Sparse };
IndexerStage parse_indexer_stage(const std::string& s);  // "off", "dense_warmup", "sparse"
std::string to_string(IndexerStage s);

struct DSAState : MixerState {
  Tensor k, v;        // [B, H_kv, max_len, D] (latent form: k = [c | k_r] with H_kv = 1, v unused)
  Tensor index_keys;  // [B, max_len, d_I]
  int64_t topk = 0;   // tokens a decode step reads
  int64_t bytes() const override;
  void reset() override { length = 0; }
  std::unique_ptr<MixerState> slice(int64_t begin, int64_t count) const override;
  // Every index key, then the top-k selected keys and values.
  int64_t decode_bytes(int64_t length) const override;
  std::vector<Tensor> tensors() const override;
  std::vector<int64_t> token_axes() const override;
};

class DSAImpl : public MixerImpl {
 public:
  DSAImpl(const ModelConfig& cfg, const json& options);
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr) override;
  Tensor step(const Tensor& x, const Positions& pos, MixerState& state) override;
  std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len,
                                         torch::TensorOptions opts, const LoopSettings& loop = {}) const override;
  std::string kind() const override { return "dsa"; }
  // GQA form: the attention block's packing; latent form: w_in and the transposed wk_b, wv_b.
  void pack_for_inference() override;
  // The latent form's fused decode: w_in, then latent_decode, then wo; nullopt where the fused
  // kernels do not take the state (the GQA form, the dense warm-up stage, a top-k that covers the
  // cache, shapes without a kernel).
  std::optional<DecodeDescriptor> decode_descriptor(MixerState& state, int64_t batch) override;
  // The indexer's KL loss (stages: AuxLossStage Warmup = dense_warmup, Joint = sparse).
  AuxLoss* aux_loss() override { return &aux_; }

  // Indexer pieces (exposed for tests and the indexer loss).
  // x: [B, T, d] -> queries [B, T, H_I, d_I] and head weights [B, T, H_I] (scales folded in).
  std::pair<Tensor, Tensor> indexer_queries(const Tensor& x, const Positions& pos);
  Tensor indexer_keys(const Tensor& x, const Positions& pos);  // [B, T, d_I]
  std::vector<Tensor> indexer_parameters() const;

  IndexerStage stage = IndexerStage::Off;
  // Forward runs the query rows in blocks whose dense index logits, and then attention scores, take
  // about this many bytes each (a long prefill's would not fit otherwise); with the indexer loss,
  // one block holds both, in forward and in its recomputing backward.
  int64_t query_block_bytes = int64_t{2} << 30;
  std::vector<Tensor> indexer_losses;  // recorded KL losses (scalars), see the stage comment

  int64_t topk, index_heads, index_head_dim, index_rope_dim;
  bool latent;
  int64_t latent_dim, latent_rope_dim;
  int64_t n_heads, n_kv_heads, head_dim;

  // GQA form: the full-attention block.
  std::shared_ptr<FullAttentionImpl> attn;
  // Latent form.
  torch::nn::Linear wq{nullptr};        // d -> H (D + d_r)
  torch::nn::Linear wkv_a{nullptr};     // d -> d_c + d_r
  RMSNorm kv_norm{nullptr};             // on c
  Tensor wk_b, wv_b;                    // [H, D, d_c], [H, d_c, D]
  torch::nn::Linear wgate{nullptr}, wo{nullptr};
  // Indexer.
  torch::nn::Linear index_wq{nullptr}, index_wk{nullptr}, index_ww{nullptr};
  torch::nn::LayerNorm index_k_norm{nullptr};
  // Inference (pack_for_inference), latent form; undefined otherwise.
  Tensor w_in;            // [wq; wkv_a; index_wq; index_wk; index_ww(; wgate)] packed, [N, d]
  Tensor wk_b_t, wv_b_t;  // [H, d_c, D], [H, D, d_c]: wk_b, wv_b transposed (the parameters view them)
  std::vector<torch::nn::Linear> input_projections() const;  // what w_in packs, in order

  // Queries and keys of x (exposed for tests: the fused decode's reference).
  struct Heads {
    Tensor q;     // [B, H, T, D_qk]
    Tensor k, v;  // [B, H_kv, T, D_qk], [B, H_kv, T, D_v] (latent: v is a view of k)
    Tensor gate;  // the output gate's pre-activation [B, T, H D_v] with the gate, else undefined
  };
  Heads project(const Tensor& x, const Positions& pos);

 private:
  // Decode with per-sequence positions: cache writes at seq_pos, index scores over the
  // whole cache with slots past each sequence's length masked, attention over the top-k.
  Tensor step_at(const Tensor& x, const Positions& pos, DSAState& s);
  // The latent form's decode core on fused kernels, from the packed input GEMV's outputs (parts,
  // [B, N_i] in input_projections() order): ops::dsa_latent_prep, the absorbed q_nope W_uk, the
  // index top-k, sparse attention over the latent cache, o W_uv with the output gate. Returns y
  // [B, H * D], wo's input. fold_q / fold_o: the absorptions folded into the prep and the
  // attention's combine instead of batched GEMVs (decided by decode_descriptor).
  Tensor latent_decode(const std::vector<Tensor>& parts, const Positions& pos, DSAState& s, bool fold_q,
                       bool fold_o);
  Tensor output(const Tensor& o, const Tensor& x, const Heads& h);  // o: [B, T, H, D_v] -> [B, T, d]
  // Bytes of one query row's index scores (with the dense logits unless the kernels score: `kernels`)
  // and of its attention scores over `keys` keys, and the rows of an inference block (of `rows`) at
  // row_bytes each.
  int64_t index_row_bytes(int64_t batch, int64_t keys, bool kernels) const;
  int64_t attention_row_bytes(int64_t batch, int64_t keys) const;
  int64_t block_rows(int64_t row_bytes, int64_t rows) const;
  // caps().prefill_workspace: one block of query rows (query_block_bytes) of dense index logits
  // or attention scores, and every row's top-k mask.
  int64_t workspace_bytes(int64_t batch, int64_t rows, int64_t keys) const;
  struct IndexerAuxLoss : AuxLoss {
    explicit IndexerAuxLoss(DSAImpl* d) : self(d) {}
    void set_stage(AuxLossStage s) override;
    std::vector<Tensor> take() override;
    std::vector<Tensor> parameters() const override;
    DSAImpl* self;
  };
  IndexerAuxLoss aux_{this};
  double scale() const;  // softmax scale
  double index_weight_scale() const;  // H_I^-1/2 d_I^-1/2, on the index head weights
  double rope_theta;
  RopeStyle rope_style;
};

// Sets the indexer stage of every DSA mixer inside `model` (a LoopedLM, a block, a mixer).
void set_indexer_stage(torch::nn::Module& model, IndexerStage stage);
// Takes (and clears) the indexer losses recorded by every DSA mixer inside `model`, in module
// order (layer-major, then loop).
std::vector<Tensor> take_indexer_losses(torch::nn::Module& model);

}  // namespace lt2
