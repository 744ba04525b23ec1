#include "lt2/mixers/recurrent_mixer.h"

#include <cmath>

#include "lt2/ops/conv/short_conv.h"
#include "lt2/ops/delta_rule/decode.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "lt2/ops/projections/projections.h"

namespace lt2 {

int64_t RecurrentState::bytes() const {
  int64_t n = S.defined() ? S.nbytes() : 0;
  for (const auto& w : conv) n += w.nbytes();
  return n;
}

std::unique_ptr<MixerState> RecurrentState::slice(int64_t begin, int64_t count) const {
  auto s = std::make_unique<RecurrentState>();
  s->S = S.narrow(0, begin, count);
  for (const auto& w : conv) s->conv.push_back(w.narrow(0, begin, count));
  return s;
}

std::vector<Tensor> RecurrentState::tensors() const {
  std::vector<Tensor> out{S};
  out.insert(out.end(), conv.begin(), conv.end());
  return out;
}

void RecurrentState::reset() {
  if (S.defined()) S.zero_();
  for (auto& w : conv) w.zero_();
  length = 0;
}

ShortConvImpl::ShortConvImpl(int64_t channels, int64_t kernel, bool with_bias, bool silu_,
                             double init_std)
    : silu(silu_) {
  LT2_CHECK(kernel >= 1, "short conv kernel must be >= 1, found ", kernel);
  weight = register_parameter("weight", torch::empty({channels, 1, kernel}));
  const double bound = 1.0 / std::sqrt(static_cast<double>(kernel));  // fan_in = kernel
  torch::NoGradGuard ng;
  if (init_std > 0) trunc_normal_(weight, init_std);
  else weight.uniform_(-bound, bound);
  if (with_bias) {
    bias = register_parameter("bias", torch::empty({channels}));
    if (init_std > 0) bias.zero_();
    else bias.uniform_(-bound, bound);
  }
}

Tensor ShortConvImpl::forward(const Tensor& x, Tensor* window, const Positions& pos) {
  return ops::short_conv(x, weight, bias, silu, window, pos.documents ? pos.documents->offsets : Tensor());
}

namespace {

// The recurrence over packed documents: the B rows as one row of B * T tokens, each document
// chunked on its own (ops::delta_rule_chunked_varlen, ops::gated_linear_chunked_varlen). Returns
// o [B, T, H, V].
Tensor packed_recurrence(const RecurrenceInputs& in, bool delta_rule, const std::vector<int64_t>& cu_seqlens,
                         int64_t chunk_size) {
  auto flat = [](const Tensor& t) {  // [B, T, ...] -> [1, B * T, ...]
    if (!t.defined()) return t;
    std::vector<int64_t> shape{1, t.size(0) * t.size(1)};
    for (int64_t i = 2; i < t.dim(); ++i) shape.push_back(t.size(i));
    return t.reshape(shape);
  };
  const auto r = delta_rule ? ops::delta_rule_chunked_varlen(flat(in.q), flat(in.k), flat(in.v), flat(in.beta),
                                                             flat(in.g), in.scale, Tensor(), cu_seqlens, chunk_size)
                            : ops::gated_linear_chunked_varlen(flat(in.q), flat(in.k), flat(in.v), flat(in.g),
                                                               in.scale, Tensor(), cu_seqlens, chunk_size);
  return r.o.view({in.v.size(0), in.v.size(1), in.v.size(2), -1});
}

}  // namespace

Tensor RecurrentMixerImpl::run(const Tensor& x, const Positions& pos, MixerState* state, bool decode) {
  RecurrentState* st = nullptr;
  if (state) {
    st = dynamic_cast<RecurrentState*>(state);
    LT2_CHECK(st, kind(), ": the state given is not a recurrent state (made by another mixer?)");
    LT2_CHECK(pos.seq_pos.defined() || st->length == pos.start, kind(), " state holds ", st->length,
              " tokens but the call starts at position ", pos.start);
  }
  auto in = project(x, st, pos);
  Tensor o;  // [B, T, H, V]
  if (decode) {
    LT2_CHECK(st && x.size(1) == 1, kind(), ": step takes one token [B, 1, d] and a state, found ",
              x.sizes());
    auto q = in.q.select(1, 0), k = in.k.select(1, 0), v = in.v.select(1, 0);  // [B, H, K|V]
    auto beta = delta_rule ? in.beta.select(1, 0) : Tensor();                   // [B, H]
    auto g = in.g.defined() ? in.g.select(1, 0) : Tensor();
    o = ops::recurrent_step(q, k, v, beta, g, in.scale, st->S).unsqueeze(1);
  } else if (pos.documents) {
    LT2_CHECK(!st, kind(), ": packed documents run without a state");
    o = packed_recurrence(in, delta_rule, pos.documents->cu_seqlens, chunk_size);
  } else {
    Tensor s0 = st ? st->S : Tensor();
    auto r = delta_rule
                 ? ops::delta_rule_chunked(in.q, in.k, in.v, in.beta, in.g, in.scale, s0, chunk_size)
                 : ops::gated_linear_chunked(in.q, in.k, in.v, in.g, in.scale, s0, chunk_size);
    if (st) st->S.copy_(r.final_state.detach());
    o = r.o;
  }
  if (in.skip.defined()) o = o + in.skip;
  if (st && !pos.seq_pos.defined()) st->length += x.size(1);
  return output(o, x, in);
}

void RecurrentMixerImpl::pack_for_inference() {
  const auto layers = input_projections();
  if (!w_in.defined() && !layers.empty()) w_in = pack_linears(layers);
}

std::vector<Tensor> RecurrentMixerImpl::project_inputs(const Tensor& x) const {
  return ops::linear_group(x, input_projections(), w_in);
}

Tensor RecurrentMixerImpl::forward(const Tensor& x, const Positions& pos, MixerState* state) {
  return run(x, pos, state, /*decode=*/false);
}

Tensor RecurrentMixerImpl::step(const Tensor& x, const Positions& pos, MixerState& state) {
  return run(x, pos, &state, /*decode=*/true);
}

std::unique_ptr<MixerState> RecurrentMixerImpl::make_state(int64_t batch, int64_t max_len,
                                                           torch::TensorOptions opts, const LoopSettings& loop) const {
  auto st = std::make_unique<RecurrentState>();
  const auto state_dtype = opts.dtype() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;  // fp32 states
  st->S = torch::zeros({batch, state_heads, state_k, state_v}, opts.dtype(state_dtype));
  for (int64_t c : conv_channels) st->conv.push_back(torch::zeros({batch, conv_kernel - 1, c}, opts));
  return st;
}

HeadDims expand_head_dims(const json& opts, int64_t d_model, int64_t num_heads, double default_expand_k,
                          double default_expand_v, const std::string& where) {
  const int64_t key_dim = std::llround(d_model * option_double(opts, "expand_k", default_expand_k, where));
  const int64_t value_dim = std::llround(d_model * option_double(opts, "expand_v", default_expand_v, where));
  LT2_CHECK(num_heads > 0 && key_dim % num_heads == 0 && value_dim % num_heads == 0, where,
            ": key dim ", key_dim, " and value dim ", value_dim, " must split evenly into num_heads (",
            num_heads, ") heads");
  return {key_dim / num_heads, value_dim / num_heads};
}

Tensor inverse_softplus_dt_init(int64_t n) {
  const double lo = std::log(1e-3), hi = std::log(1e-1);
  auto dt = torch::exp(torch::rand({n}) * (hi - lo) + lo).clamp_min(1e-4);
  return dt + torch::log(-torch::expm1(-dt));
}

Tensor log_uniform_A_init(int64_t n, double lo, double hi) {
  return torch::empty({n}).uniform_(lo, hi).clamp_min(1e-4).log();
}

torch::nn::Linear linear_at(const torch::nn::Sequential& layers, size_t i) {
  return torch::nn::Linear(layers->ptr<torch::nn::LinearImpl>(i));
}

Tensor repeat_heads(const Tensor& x, int64_t groups) {
  return groups == 1 ? x : x.repeat_interleave(groups, /*dim=*/2);
}

int64_t option_int(const json& opts, const char* key, int64_t fallback, const std::string& where) {
  json_get(opts, key, fallback, where);
  return fallback;
}

double option_double(const json& opts, const char* key, double fallback, const std::string& where) {
  json_get(opts, key, fallback, where);
  return fallback;
}

bool option_bool(const json& opts, const char* key, bool fallback, const std::string& where) {
  json_get(opts, key, fallback, where);
  return fallback;
}

}  // namespace lt2
