// Full causal softmax attention (MHA / GQA) with RoPE and the optional SDPA output gate
// (the LT2 paper's "SDPA output gate"):
//   q = RoPE(x W_q), k = RoPE(x W_k), v = x W_v          per head
//   o = SDPA(q, k, v) (causal)                            [B, T, H, D]
//   out = W_o( concat_heads(o) * sigmoid(x W_gate) )      W_gate zero-initialised (gate optional)
// Decode state: a preallocated KV cache [B, H_kv, max_len, D] in the model dtype.
#pragma once
#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"

namespace lt2 {

struct KVCache : MixerState {
  Tensor k, v;  // [B, H_kv, max_len, D]
  int64_t bytes() const override;
  void reset() override { length = 0; }
  std::unique_ptr<MixerState> slice(int64_t begin, int64_t count) const override;
  int64_t decode_bytes(int64_t length) const override;
  std::vector<Tensor> tensors() const override { return {k, v}; }
  std::vector<int64_t> token_axes() const override { return {2, 2}; }
  int64_t capacity() const { return k.size(2); }
};

// Writes k_new/v_new ([B, T, H_kv, D]) at positions [length, length + T) of the cache, advances
// length, and returns views of every cached key and value ([B, H_kv, length, D]).
std::pair<Tensor, Tensor> kv_cache_append(KVCache& cache, const Tensor& k_new, const Tensor& v_new);

// Per-sequence positions (Positions::seq_pos, decode): writes row [b, :, 0, :] of `rows`
// ([B, H, 1, D]) at position seq_pos[b] of `cache` ([B, H, L, D]), on the device (no host read of
// the positions).
void cache_write_at(const Tensor& cache, const Tensor& rows, const Tensor& seq_pos);

// Causal attention of q ([B, H, T, D]) at absolute positions past..past+T-1 over keys/values
// ([B, H_kv, L, D], key j at absolute position j, L = past + T). Returns [B, T, H, D].
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t past);

class FullAttentionImpl : public MixerImpl {
 public:
  explicit FullAttentionImpl(const ModelConfig& cfg);
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr) override;
  std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len,
                                         torch::TensorOptions opts, const LoopSettings& loop = {}) const override;
  std::string kind() const override { return "full"; }
  // Decode at per-sequence positions on the fused kernels (fused_decode) after the packed
  // projection, wo with the output gate after them; nullopt where the kernels do not take the state.
  std::optional<DecodeDescriptor> decode_descriptor(MixerState& state, int64_t batch) override;

  // The pieces subclasses (window, dsa) reuse around their own attention pattern.
  struct Projections {
    Tensor q;     // [B, T, H, D]      RoPE applied at absolute positions start..start+T-1
    Tensor k, v;  // [B, T, H_kv, D]   (k with RoPE)
    Tensor gate;  // [B, T, H * D] output-gate pre-activation when the packed projection made it
  };
  // Positions of x's tokens: start.. (pos.seq_pos undefined) or seq_pos[b] for sequence b.
  Projections project(const Tensor& x, const Positions& pos);
  // The projections before RoPE: q, k, v [B, T, H * D | H_kv * D] (+ the gate's pre-activation
  // [B, T, H * D] with the output gate); views of one packed GEMV's output when packed.
  std::vector<Tensor> projections(const Tensor& x);
  // RoPE on (and head views of) projections() at the positions of pos.
  Projections rotate(const std::vector<Tensor>& raw, const Positions& pos) const;
  // o: [B, T, H, D] attention output, x: [B, T, d] the mixer input (for the gate) -> [B, T, d].
  // gate: the gate's pre-activation when already computed (Projections::gate).
  Tensor output(const Tensor& o, const Tensor& x, const Tensor& gate = {});
  void pack_for_inference() override;
  Tensor w_in;  // packed [wq; wk; wv; wgate] (inference), or undefined

  int64_t n_heads, n_kv_heads, head_dim;
  double rope_theta;
  RopeStyle rope_style;
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  torch::nn::Linear wgate{nullptr};  // null when the output gate is off

 private:
  std::vector<torch::nn::Linear> packed_layers() const;  // the layers w_in packs, in order
  // Attention and output from projections() (x: the mixer input, for an unpacked gate).
  Tensor attend(const std::vector<Tensor>& raw, const Tensor& x, const Positions& pos, MixerState* state);
  // One token per sequence at positions pos.seq_pos on the fused kernels (RoPE + cache writes in one
  // launch, flash-decoding) from its projections (raw: q, k, v [B, (1,) H * D | H_kv * D]): the
  // attention output [B, H * D] before wo, or undefined, having run nothing, where the kernels do
  // not take them (ops::rope_cache_attention_applies: autograd, CPU, shapes without a kernel).
  Tensor fused_decode(const std::vector<Tensor>& raw, const Positions& pos, KVCache& cache);
};

}  // namespace lt2
