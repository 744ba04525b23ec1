// Shared machinery of the linear-time mixers (gdn, kda, mamba2, retnet, deltanet, gla, hgrn2,
// linear): the decode state (recurrent matrix + short-conv windows), the short convolution
// module, and a base class that runs the chunked form in `forward` and the one-token recurrence
// in `step`. Each mixer only says how x becomes the op's inputs (`project`) and how the op's
// output becomes the layer's output (`output`).
#pragma once
#include <memory>
#include <vector>

#include "lt2/config/model_config.h"
#include "lt2/mixers/mixer.h"

namespace lt2 {

// Recurrent state of one (layer, loop) pair: S [B, H, K, V] in fp32 (fp64 for a fp64 model) and
// one window of the last kernel-1 inputs per short convolution ([B, kernel-1, C], model dtype).
struct RecurrentState : MixerState {
  Tensor S;
  std::vector<Tensor> conv;
  int64_t bytes() const override;
  void reset() override;
  std::unique_ptr<MixerState> slice(int64_t begin, int64_t count) const override;
  int64_t decode_bytes(int64_t length) const override { return 2 * bytes(); }  // read + write
  std::vector<Tensor> tensors() const override;
};

// Short causal depthwise convolution with its parameters (fla ShortConvolution / nn.Conv1d
// layout: weight [C, 1, W], optional bias [C]) and optional SiLU.
class ShortConvImpl : public torch::nn::Module {
 public:
  // init_std > 0: weights N(0, init_std) truncated at 3 std (fla's _init_weights, 0.02);
  // init_std == 0: PyTorch's nn.Conv1d default, U(-1/sqrt(W), 1/sqrt(W)) for weight and bias.
  ShortConvImpl(int64_t channels, int64_t kernel, bool bias, bool silu, double init_std);
  // x: [B, T, C]; window: nullptr or the state's [B, W-1, C] window (read, then advanced).
  // With pos.documents (no window), no output reads another document.
  Tensor forward(const Tensor& x, Tensor* window = nullptr, const Positions& pos = {});
  Tensor weight, bias;
  bool silu;
};
TORCH_MODULE(ShortConv);

// What the recurrence op consumes, in fla's [B, T, H, D] layout, q/k/v with the same head count.
struct RecurrenceInputs {
  Tensor q, k;    // [B, T, H, K]
  Tensor v;       // [B, T, H, V]
  Tensor beta;    // [B, T, H] write strength (delta rule only; undefined for additive mixers)
  Tensor g;       // log-decay <= 0: [B, T, H], [B, T, H, K] or undefined (no decay)
  double scale = 1.0;
  Tensor gate;    // output-gate pre-activation when `project` already computed it (Mamba2's z)
  Tensor skip;    // [B, T, H, V] added to the op's output (Mamba2's D x), or undefined
};

// A linear-time mixer: forward = chunked form (continuing from the state when given), step =
// one-token recurrence, state = recurrent matrix + conv windows.
class RecurrentMixerImpl : public MixerImpl {
 public:
  Tensor forward(const Tensor& x, const Positions& pos, MixerState* state = nullptr) override;
  Tensor step(const Tensor& x, const Positions& pos, MixerState& state) override;
  std::unique_ptr<MixerState> make_state(int64_t batch, int64_t max_len,
                                         torch::TensorOptions opts, const LoopSettings& loop = {}) const override;
  // Positions do not enter the recurrence, and a mixer whose projections use them (RetNet's RoPE)
  // reads them from `pos`, per sequence when pos.seq_pos is set: any lengths decode together.
  // Packed documents run through the ops' varlen forms, the short convolutions masked at the
  // boundaries (`project` passes `pos` to them).
  RecurrentMixerImpl() {
    caps_.seq_pos = true;
    caps_.packed_documents = true;
  }

  // x: [B, T, d] -> the op's inputs. `state` (may be null) supplies and advances the conv
  // windows; `pos` places x's tokens (a start, or one position per sequence at decode).
  virtual RecurrenceInputs project(const Tensor& x, RecurrentState* state, const Positions& pos) = 0;
  // o: [B, T, H, V] (the op's output) -> [B, T, d].
  virtual Tensor output(const Tensor& o, const Tensor& x, const RecurrenceInputs& in) = 0;
  // Packs input_projections() into w_in: decode and prefill then read them as one matrix.
  void pack_for_inference() override;

  bool delta_rule = false;   // gated delta rule (beta) or additive recurrence
  int64_t chunk_size = 64;
  int64_t state_heads = 0, state_k = 0, state_v = 0;  // S: [B, state_heads, state_k, state_v]
  int64_t conv_kernel = 0;                            // 0: no short convolutions
  std::vector<int64_t> conv_channels;                 // channels of each short conv, in order
  Tensor w_in;  // input_projections() packed (inference), or undefined

 protected:
  Tensor run(const Tensor& x, const Positions& pos, MixerState* state, bool decode);
  // The linear layers that read x, in the order project_inputs returns their outputs (for a
  // low-rank projection, its first layer); empty where the mixer projects x itself.
  virtual std::vector<torch::nn::Linear> input_projections() const { return {}; }
  // x [B, T, d] through input_projections(): one GEMM over their weights (w_in where packed, else
  // concatenated for the call: ops::linear_group), so under autograd x's gradient comes from one
  // product and autocast casts x once.
  std::vector<Tensor> project_inputs(const Tensor& x) const;
};

// Helpers shared by the mixer files.

// dt_bias initialisation shared by GDN, KDA and Mamba2: dt ~ exp(U(log 1e-3, log 1e-1)), floored
// at 1e-4, returned as its inverse softplus dt + log(-expm1(-dt)). Shape [n].
Tensor inverse_softplus_dt_init(int64_t n);
// log(A) for A ~ U(lo, hi) (A_log init; A floored at 1e-4 so log stays finite). Shape [n].
Tensor log_uniform_A_init(int64_t n, double lo, double hi);
// Layer i of a Sequential of linear layers (a low-rank projection's down or up layer).
torch::nn::Linear linear_at(const torch::nn::Sequential& layers, size_t i);
// [B, T, H, D] -> [B, T, H * groups, D], head i of the result = head i / groups of x (GVA).
Tensor repeat_heads(const Tensor& x, int64_t groups);
// Reads an integer or float option with a default, naming `where` in errors.
// Init std of the short convolutions (fla's _init_weights).
constexpr double kShortConvInitStd = 0.02;

// Per-head key/value dims from `expand_k` / `expand_v` (multiples of d_model) over `num_heads`;
// an error names the dims when they do not split evenly.
struct HeadDims {
  int64_t k, v;
};
HeadDims expand_head_dims(const json& opts, int64_t d_model, int64_t num_heads, double default_expand_k,
                          double default_expand_v, const std::string& where);

int64_t option_int(const json& opts, const char* key, int64_t fallback, const std::string& where);
double option_double(const json& opts, const char* key, double fallback, const std::string& where);
bool option_bool(const json& opts, const char* key, bool fallback, const std::string& where);

}  // namespace lt2
