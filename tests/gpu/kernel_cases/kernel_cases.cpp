#include "gpu/kernel_cases/kernel_cases.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "common/errors.h"
#include "lt2/config/presets.h"
#include "lt2/kernels/decode.h"
#include "lt2/kernels/sparse_attention_decode.h"
#include "lt2/mixers/full_attention.h"
#include "lt2/mixers/gdn.h"
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/mixers/registry.h"
#include "lt2/nn/rope.h"
#include "lt2/ops/attention/decode.h"
#include "lt2/ops/conv/short_conv.h"
#include "lt2/ops/delta_rule/decode.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "lt2/ops/norms/norms.h"
#include "lt2/ops/projections/gemv.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2::kernel_cases {

using lt2::testing::rel_err;
using torch::Tensor;

namespace {

const auto f32 = torch::kFloat32, f64 = torch::kFloat64, bf16 = torch::kBFloat16, f16 = torch::kFloat16;

Tensor cpu64(const Tensor& t) { return t.cpu().to(f64); }

Check below(std::string what, double error, double bound) {
  return {std::move(what), error < bound, cat("relative RMS error ", error, " (bound ", bound, ")")};
}

Check holds(std::string what, bool ok) { return {std::move(what), ok, ok ? "" : "does not hold"}; }

// Exactly equal tensors (same kernel, same inputs; or values the kernel must leave alone).
Check same(std::string what, const Tensor& a, const Tensor& b) { return holds(std::move(what), torch::equal(a, b)); }

Check no_nan(std::string what, const Tensor& t) { return holds(what + " has no NaN", !torch::isnan(t).any().item<bool>()); }

double bytes_of(std::initializer_list<Tensor> ts) {
  double n = 0;
  for (const auto& t : ts)
    if (t.defined()) n += static_cast<double>(t.nbytes());
  return n;
}

// FNV-1a of a case's name: its generator seed, the same on every run and platform.
uint64_t seed_of(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

// How many copies of `weight_bytes` of weights add up to well past the 50 MB L2 cache, so that
// rotating over them every call reads its weights from memory.
int weight_copies(double weight_bytes) { return static_cast<int>(std::max(1.0, std::ceil(256e6 / weight_bytes))); }

// The table being built. Every case's setup seeds the generator from the case's name first. A
// case's label names everything it varies, so a model-shaped case that is also a fixed one is
// added once (as model-shaped).
class Table {
 public:
  void add(std::string op, std::string shape, torch::ScalarType dt, int64_t batch, int64_t context, bool model_shape,
           std::function<KernelRun(Purpose)> setup) {
    KernelCase c;
    c.op = std::move(op), c.shape = std::move(shape), c.dtype = dt, c.tolerance = tolerance(dt);
    c.batch = batch, c.context = context, c.model_shape = model_shape;
    const auto name = c.name();
    if (const auto it = index_.find(name); it != index_.end()) {
      cases[it->second].model_shape = cases[it->second].model_shape || model_shape;
      return;
    }
    const uint64_t seed = seed_of(name);
    c.setup = [seed, setup = std::move(setup)](Purpose p) {
      torch::manual_seed(seed);
      return setup(p);
    };
    index_[name] = cases.size();
    cases.push_back(std::move(c));
  }
  std::vector<KernelCase> cases;

 private:
  std::unordered_map<std::string, size_t> index_;  // case name -> its place in cases
};

// ---------------------------------------------------------------------------------------------
// recurrent_step: the delta rule's and the gated linear recurrence's decode step.

enum class Decay { None, PerHead, PerChannel };

const char* decay_name(Decay d) {
  return d == Decay::None ? "no decay" : d == Decay::PerHead ? "g/head" : "g/channel";
}

struct RecurrentShape {
  int64_t B, H, K, V;
};

struct RecurrentInputs {
  Tensor q, k, v, beta, g;
};

// One token: q through a strided view (batch and head strides not the packed ones), unit keys
// for the delta rule (they keep it bounded), beta only for the delta rule.
RecurrentInputs recurrent_inputs(const RecurrentShape& s, torch::ScalarType dt, bool delta, Decay decay) {
  RecurrentInputs in;
  in.q = torch::randn({s.B, s.H, 2 * s.K}, gpu(dt)).narrow(2, 0, s.K);
  auto k = torch::randn({s.B, s.H, s.K}, gpu(f32));
  if (delta) k = k / k.norm(2, -1, true);
  in.k = k.to(dt);
  in.v = torch::randn({s.B, s.H, s.V}, gpu(dt));
  if (delta) in.beta = torch::sigmoid(torch::randn({s.B, s.H}, gpu(f32)));
  if (decay == Decay::PerHead) in.g = -torch::rand({s.B, s.H}, gpu(f32));
  if (decay == Decay::PerChannel) in.g = -torch::rand({s.B, s.H, s.K}, gpu(f32));
  return in;
}

// The op's libtorch step on `in` (any dtype), state updated in place.
Tensor recurrent_reference(const RecurrentInputs& in, double scale, Tensor& state) {
  return in.beta.defined() ? ops::delta_rule_step(in.q, in.k, in.v, in.beta, in.g, scale, state)
                           : ops::gated_linear_step(in.q, in.k, in.v, in.g, scale, state);
}

RecurrentInputs to64(const RecurrentInputs& in) {
  auto c = [](const Tensor& t) { return t.defined() ? t.to(f64) : t; };
  return {c(in.q), c(in.k), c(in.v), c(in.beta), c(in.g)};
}

KernelRun recurrent_step_run(RecurrentShape s, torch::ScalarType dt, bool delta, Decay decay) {
  KernelRun r;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  auto state = torch::randn({s.B, s.H, s.K, s.V}, gpu(f32)) * 0.5;
  const auto in = recurrent_inputs(s, dt, delta, decay);
  r.kernel = [=]() mutable { ops::recurrent_step_fused(in.q, in.k, in.v, in.beta, in.g, scale, state); };
  r.reference = [=]() mutable { recurrent_reference(in, scale, state); };
  r.bytes = 2 * bytes_of({state}) + bytes_of({in.q, in.k, in.v, in.beta, in.g, in.v});  // the last v: o
  // Three tokens in a row, each against the float64 step on the float64 state.
  r.check = [=]() mutable {
    std::vector<Check> out;
    auto state_ref = state.to(f64);
    for (int step = 0; step < 3; ++step) {
      const auto token = recurrent_inputs(s, dt, delta, decay);
      auto o = ops::recurrent_step_fused(token.q, token.k, token.v, token.beta, token.g, scale, state);
      auto o_ref = recurrent_reference(to64(token), scale, state_ref);
      out.push_back(holds(cat("output in ", name(dt), ", step ", step), o.scalar_type() == dt));
      out.push_back(below(cat("output, step ", step), rel_err(o, o_ref), tolerance(dt)));
      out.push_back(below(cat("state, step ", step), rel_err(state, state_ref), 1e-5));  // fp32 in both
    }
    return out;
  };
  return r;
}

void add_recurrent_step(Table& t, RecurrentShape s, torch::ScalarType dt, bool delta, Decay decay, bool model_shape) {
  t.add("recurrent_step",
        cat("B", s.B, " H", s.H, " K", s.K, " V", s.V, delta ? " delta " : " additive ", decay_name(decay)), dt, s.B,
        0, model_shape, [=](Purpose) { return recurrent_step_run(s, dt, delta, decay); });
}

// ---------------------------------------------------------------------------------------------
// gdn_decode: Gated DeltaNet's whole decode step after its projections, in each form.

struct GdnShape {
  int64_t B, H, K, V, W;
};

struct GdnForm {
  const char* op;
  kernels::GdnDecodeForm form;
};
const GdnForm kGdnForms[] = {{"gdn_decode", kernels::GdnDecodeForm::Auto},
                             {"gdn_decode_registers", kernels::GdnDecodeForm::Registers},
                             {"gdn_decode_per_head", kernels::GdnDecodeForm::PerHead},
                             {"gdn_decode_cluster", kernels::GdnDecodeForm::Cluster}};

// The next token's projections into a: v a strided batch.
void gdn_token(ops::GdnDecodeArgs& a, int64_t B, torch::ScalarType dt, bool gated) {
  const int64_t H = a.num_heads, K = a.head_k_dim, V = a.head_v_dim;
  a.q = torch::randn({B, H * K}, gpu(dt));
  a.k = torch::randn({B, H * K}, gpu(dt));
  a.v = torch::randn({B, 2 * H * V}, gpu(dt)).narrow(1, 0, H * V);
  a.a = torch::randn({B, H}, gpu(dt));
  a.b = torch::randn({B, H}, gpu(dt));
  a.gate = gated ? torch::randn({B, H * V}, gpu(dt)) : Tensor();
}

KernelRun gdn_decode_run(GdnShape s, torch::ScalarType dt, bool gated, bool neg_eigval, double norm_eps,
                         kernels::GdnDecodeForm form) {
  KernelRun r;
  const int64_t B = s.B, H = s.H, K = s.K, V = s.V, W = s.W;
#ifdef LT2_WITH_CUDA
  if (form == kernels::GdnDecodeForm::Registers &&
      !kernels::gdn_decode_registers_supported(static_cast<int>(K), static_cast<int>(V)))
    r.skip = "the register form does not serve these head dims";
  if (form == kernels::GdnDecodeForm::Cluster &&
      !kernels::gdn_decode_cluster_supported(static_cast<int>(K), static_cast<int>(V), c10::cuda::current_device()))
    r.skip = "the cluster form does not serve these head dims on this device";
#endif
  if (!r.skip.empty()) return r;
  ops::GdnDecodeArgs a;
  a.q_conv_weight = (torch::randn({H * K, 1, W}, gpu(f32)) * 0.5).to(dt);
  a.k_conv_weight = (torch::randn({H * K, 1, W}, gpu(f32)) * 0.5).to(dt);
  a.v_conv_weight = (torch::randn({H * V, 1, W}, gpu(f32)) * 0.5).to(dt);
  a.A_log = log_uniform_A_init(H, 1.0, 16.0).to(gpu(dt));
  a.dt_bias = inverse_softplus_dt_init(H).to(gpu(dt));
  a.norm_weight = (1 + 0.2 * torch::randn({V}, gpu(f32))).to(dt);
  a.num_heads = H, a.head_k_dim = K, a.head_v_dim = V;
  a.scale = 1.0 / std::sqrt(static_cast<double>(K)), a.norm_eps = norm_eps;
  a.allow_neg_eigval = neg_eigval;
  a.form = form;
  auto state = torch::randn({B, H, K, V}, gpu(f32)) * 0.1;
  auto q_win = torch::randn({B, W - 1, H * K}, gpu(dt)), k_win = torch::randn({B, W - 1, H * K}, gpu(dt));
  auto v_win = torch::randn({B, W - 1, H * V}, gpu(dt));
  gdn_token(a, B, dt, gated);
  r.kernel = [=]() mutable { ops::gdn_decode_fused(a, state, q_win, k_win, v_win); };
  r.bytes = 2 * bytes_of({state, q_win, k_win, v_win}) +
            bytes_of({a.q, a.k, a.v, a.gate, a.a, a.b, a.q_conv_weight, a.k_conv_weight, a.v_conv_weight, a.A_log,
                      a.dt_bias, a.norm_weight}) +
            static_cast<double>(B * H * V) * a.q.element_size();  // y
  // Three tokens in a row against short_conv + l2_normalize + gates + delta_rule_step +
  // gated_rms_norm in float64 on float64 copies of the state and the windows.
  r.check = [=]() mutable {
    std::vector<Check> out;
    auto state_ref = state.to(f64);
    auto q_win_ref = q_win.to(f64), k_win_ref = k_win.to(f64), v_win_ref = v_win.to(f64);
    auto w = [](const Tensor& t) { return t.to(f64); };
    auto conv = [](const Tensor& x, const Tensor& weight, Tensor& window) {
      return ops::short_conv(x.to(f64).unsqueeze(1), weight.to(f64), Tensor(), true, &window).squeeze(1);
    };
    for (int step = 0; step < 3; ++step) {
      gdn_token(a, B, dt, gated);
      auto y = ops::gdn_decode_fused(a, state, q_win, k_win, v_win);
      auto q = ops::l2_normalize(conv(a.q, a.q_conv_weight, q_win_ref).view({B, H, K}));
      auto k = ops::l2_normalize(conv(a.k, a.k_conv_weight, k_win_ref).view({B, H, K}));
      auto v = conv(a.v, a.v_conv_weight, v_win_ref).view({B, H, V});
      auto beta = torch::sigmoid(w(a.b)) * (neg_eigval ? 2.0 : 1.0);
      auto g = -w(a.A_log).exp() * torch::softplus(w(a.a) + w(a.dt_bias));
      auto o = ops::delta_rule_step(q, k, v, beta, g, a.scale, state_ref);
      auto gate = gated ? w(a.gate).view({B, H, V}) : Tensor();
      auto y_ref = ops::gated_rms_norm(o, w(a.norm_weight), a.norm_eps, gate,
                                       gated ? ops::GateActivation::Swish : ops::GateActivation::None)
                       .reshape({B, H * V});
      out.push_back(holds(cat("output in ", name(dt), ", step ", step), y.scalar_type() == dt));
      out.push_back(below(cat("output, step ", step), rel_err(y, y_ref), tolerance(dt)));
      out.push_back(below(cat("state, step ", step), rel_err(state, state_ref), 1e-5));
      if (W > 1) {
        out.push_back(same(cat("q window, step ", step), q_win.to(f64), q_win_ref));
        out.push_back(same(cat("k window, step ", step), k_win.to(f64), k_win_ref));
        out.push_back(same(cat("v window, step ", step), v_win.to(f64), v_win_ref));
      }
    }
    return out;
  };
  return r;
}

void add_gdn_decode(Table& t, const GdnForm& form, GdnShape s, torch::ScalarType dt, bool gated, bool neg_eigval,
                    double norm_eps, bool model_shape) {
  t.add(form.op,
        cat("B", s.B, " H", s.H, " K", s.K, " V", s.V, " W", s.W, gated ? " gate" : " no gate",
            neg_eigval ? " beta<2" : ""),
        dt, s.B, 0, model_shape,
        [=, kind = form.form](Purpose) { return gdn_decode_run(s, dt, gated, neg_eigval, norm_eps, kind); });
}

// ---------------------------------------------------------------------------------------------
// attention_decode: flash-decoding over a KV cache.

struct AttentionShape {
  int64_t B, Hq, Hkv, D, L;
};

KernelRun attention_decode_run(AttentionShape s, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  Tensor lens, k, v, q;
  if (purpose == Purpose::Check) {
    lens = random_lengths(s.B, s.L);
    k = cache_with_poisoned_tail(s.B, s.Hkv, s.L, s.D, lens, dt);
    v = cache_with_poisoned_tail(s.B, s.Hkv, s.L, s.D, lens, dt);
    q = torch::randn({s.B, s.Hq, s.D}, gpu(dt)) * 2;  // sharper softmax than unit scores
  } else {  // every sequence holding L keys
    lens = torch::full({s.B}, s.L, gpu(torch::kInt64));
    k = torch::randn({s.B, s.Hkv, s.L, s.D}, gpu(dt));
    v = torch::randn({s.B, s.Hkv, s.L, s.D}, gpu(dt));
    q = torch::randn({s.B, s.Hq, s.D}, gpu(dt));
  }
  r.kernel = [=] { ops::attention_decode_fused(q, k, v, lens, scale); };
  r.reference = [=] { ops::attention_decode_reference(q, k, v, lens, scale); };
  r.bytes = bytes_of({k, v, q, q});  // and the split partials where there are several splits:
#ifdef LT2_WITH_CUDA
  const int splits = kernels::attention_decode_num_splits(static_cast<int>(s.B), static_cast<int>(s.Hkv),
                                                          static_cast<int>(s.L), c10::cuda::current_device());
  if (splits > 1) r.bytes += 2.0 * s.B * s.Hq * splits * (s.D + 1) * sizeof(float);
#endif
  r.check = [=] {
    std::vector<Check> out{holds("the kernel takes the inputs", ops::attention_decode_supported(q, k, v))};
    if (!out.back().passed) return out;
    auto o = ops::attention_decode_fused(q, k, v, lens, scale);
    out.push_back(holds("output [B, Hq, D]", o.sizes() == q.sizes()));
    out.push_back(below("output", rel_err(o, attention_reference(q, k, v, lens, scale)), tolerance(dt)));
    return out;
  };
  return r;
}

void add_attention_decode(Table& t, AttentionShape s, torch::ScalarType dt, bool model_shape) {
  t.add("attention_decode", cat("B", s.B, " Hq", s.Hq, " Hkv", s.Hkv, " D", s.D, " L", s.L), dt, s.B, s.L,
        model_shape, [=](Purpose p) { return attention_decode_run(s, dt, p); });
}

// ---------------------------------------------------------------------------------------------
// rope_cache_write: RoPE of the new token's q and k, and the k, v cache write.

KernelRun rope_cache_write_run(RopeCacheShape c, torch::ScalarType dt, double theta, Purpose purpose) {
  KernelRun r;
  const bool interleaved = c.style == RopeStyle::Interleaved;
  auto in = rope_cache_inputs(c, dt);
  // Positions in the cache; to check, also one past it (no row written) and, for q only, a
  // long-context one.
  auto seq_pos = torch::randint(c.L, {c.B}, torch::TensorOptions().dtype(torch::kLong));
  if (purpose == Purpose::Check) {
    seq_pos[0] = c.L;
    if (c.B > 2) seq_pos[2] = 131000;
  }
  seq_pos = seq_pos.cuda();
  r.kernel = [=] { ops::rope_cache_write(in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos, theta, interleaved); };
  // The unfused path: RoPE of q and k at the positions, then the cache rows written.
  r.reference = [=] {
    const auto pos = seq_pos.view({c.B, 1});
    apply_rope(in.q.unsqueeze(1), pos, theta, c.style);
    cache_write_at(in.k_cache, apply_rope(in.k.unsqueeze(1), pos, theta, c.style).transpose(1, 2), seq_pos);
    cache_write_at(in.v_cache, in.v.unsqueeze(2), seq_pos);
  };
  r.reference_in_graph = true;  // some thirty small launches: their eager gaps would dominate
  r.bytes = 2 * bytes_of({in.q, in.k, in.v});  // q, k, v read; q, and the k and v rows, written
  r.check = [=] {
    const auto expected = rope_cache_reference(in, seq_pos, theta, c.style);
    std::vector<Check> out{holds("the kernel takes the inputs", ops::rope_cache_write_supported(
                                                                    in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos))};
    if (!out.back().passed) return out;
    auto q_out = ops::rope_cache_write(in.q, in.k, in.v, in.k_cache, in.v_cache, seq_pos, theta, interleaved);
    out.push_back(holds("q [B, H, D]", q_out.sizes() == in.q.sizes()));
    for (auto& check : rope_cache_checks(in, q_out, expected, dt)) out.push_back(std::move(check));
    return out;
  };
  return r;
}

void add_rope_cache_write(Table& t, RopeCacheShape c, torch::ScalarType dt, double theta, bool model_shape) {
  t.add("rope_cache_write",
        cat("B", c.B, " H", c.H, " Hkv", c.Hkv, " D", c.D, " L", c.L,
            c.style == RopeStyle::Interleaved ? " interleaved" : " half"),
        dt, c.B, c.L, model_shape, [=](Purpose p) { return rope_cache_write_run(c, dt, theta, p); });
}

// ---------------------------------------------------------------------------------------------
// The elementwise kernels: rms_norm, add_rms_norm, silu_mul.

// RMSNorm in float64 on the CPU: x * rsqrt(mean(x^2) + eps) * w.
Tensor rms_norm_reference(const Tensor& x, const Tensor& w, double eps) {
  auto x64 = cpu64(x);
  return x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + eps) * cpu64(w);
}

KernelRun rms_norm_run(int64_t rows, int64_t d, torch::ScalarType dt, double eps) {
  KernelRun r;
  // Rows through a strided view (row stride 2d), values off unit scale.
  auto x = (3 * torch::randn({rows, 2 * d}, gpu(f32))).to(dt).narrow(1, 0, d);
  auto w = (1 + 0.3 * torch::randn({d}, gpu(f32))).to(dt);
  r.kernel = [=] { ops::rms_norm_fused(x, w, eps); };
  r.reference = [=] { lt2::rms_norm(x, w, eps); };
  r.reference_in_graph = true;
  r.bytes = bytes_of({x, w, x});
  r.check = [=] {
    auto y = ops::rms_norm_fused(x, w, eps);
    return std::vector<Check>{holds(cat("output in ", name(dt)), y.scalar_type() == dt),
                              holds("output shaped like x", y.sizes() == x.sizes()),
                              below("output", rel_err(y.cpu(), rms_norm_reference(x, w, eps)), tolerance(dt))};
  };
  return r;
}

KernelRun add_rms_norm_run(int64_t rows, int64_t d, torch::ScalarType dt, double eps) {
  KernelRun r;
  auto x = torch::randn({rows, 1, d}, gpu(dt));  // a decode step's [B, 1, d]
  auto m = (0.5 * torch::randn({rows, 1, d}, gpu(f32))).to(dt);
  auto w = (1 + 0.3 * torch::randn({d}, gpu(f32))).to(dt);
  r.kernel = [=] { ops::add_rms_norm_fused(x, m, w, eps); };
  r.reference = [=] { lt2::rms_norm(x + m, w, eps); };
  r.reference_in_graph = true;
  r.bytes = bytes_of({x, m, w, x, x});  // h and y written
  r.check = [=] {
    auto res = ops::add_rms_norm_fused(x, m, w, eps);
    // y normalises the rounded h, as ffn_norm(x + m) does.
    return std::vector<Check>{same("h is the unfused add in the activation dtype", res.h, x + m),
                              holds(cat("y in ", name(dt)), res.y.scalar_type() == dt),
                              holds("y shaped like x", res.y.sizes() == x.sizes()),
                              below("y", rel_err(res.y.cpu(), rms_norm_reference(x + m, w, eps)), tolerance(dt))};
  };
  return r;
}

KernelRun silu_mul_run(int64_t rows, int64_t hidden, bool strided, torch::ScalarType dt) {
  KernelRun r;
  auto gate_up = (3 * torch::randn({rows, 1, (strided ? 3 : 2) * hidden}, gpu(f32))).to(dt);
  if (strided) gate_up = gate_up.narrow(-1, hidden, 2 * hidden);
  r.kernel = [=] { ops::silu_mul_fused(gate_up); };
  r.reference = [=] { torch::silu(gate_up.narrow(-1, 0, hidden)) * gate_up.narrow(-1, hidden, hidden); };
  r.reference_in_graph = true;
  r.bytes = 1.5 * bytes_of({gate_up});
  r.check = [=] {
    auto out = ops::silu_mul_fused(gate_up);
    auto g64 = cpu64(gate_up);
    auto a = g64.narrow(-1, 0, hidden), b = g64.narrow(-1, hidden, hidden);
    return std::vector<Check>{holds(cat("output in ", name(dt)), out.scalar_type() == dt),
                              holds("output [..., hidden]", out.sizes() == a.sizes()),
                              below("output", rel_err(out.cpu(), a * torch::sigmoid(a) * b), tolerance(dt))};
  };
  return r;
}

// ---------------------------------------------------------------------------------------------
// gemv: y = f(x) W^T at a few rows, with the folded prologues and epilogue and K split over a
// cluster.

enum class Fold { None, Norm, SiluMul, Residual, NormResidual, SiluMulResidual, Gate, GateResidual };

const char* fold_name(Fold f) {
  switch (f) {
    case Fold::None: return "";
    case Fold::Norm: return " norm";
    case Fold::SiluMul: return " silu*mul";
    case Fold::Residual: return " +residual";
    case Fold::NormResidual: return " norm +residual";
    case Fold::SiluMulResidual: return " silu*mul +residual";
    case Fold::Gate: return " gate";
    case Fold::GateResidual: return " gate +residual";
  }
  return "";
}

struct GemvShape {
  int64_t M, N, K;
};

// What a gemv case varies besides its shape: the folded work, the K split (0: the kernel picks),
// x as a view with rows 2K apart (else contiguous, scaled by 1.5), and whether the check also
// asks gemv_fused_applies.
struct GemvVariant {
  Fold fold = Fold::None;
  int k_splits = 0;
  bool strided_x = false;
  bool check_applies = false;
  bool splits_in_name = false;  // a sweep over the K splits (0 named "auto")
};

KernelRun gemv_run(GemvShape s, torch::ScalarType dt, GemvVariant v, Purpose purpose) {
  KernelRun r;
  const bool silu = v.fold == Fold::SiluMul || v.fold == Fold::SiluMulResidual;
  const bool norm = v.fold == Fold::Norm || v.fold == Fold::NormResidual;
  const bool gate = v.fold == Fold::Gate || v.fold == Fold::GateResidual;
  const bool add = v.fold == Fold::Residual || v.fold == Fold::NormResidual || v.fold == Fold::SiluMulResidual ||
                   v.fold == Fold::GateResidual;
  const int64_t x_dim = silu ? 2 * s.K : s.K;
  const auto x = v.strided_x ? torch::randn({s.M, 1, 2 * x_dim}, gpu(dt)).narrow(-1, 0, x_dim)
                             : torch::randn({s.M, 1, x_dim}, gpu(dt)) * 1.5;
  const double w_bytes = static_cast<double>(s.N * s.K) * torch::elementSize(dt);
  const int copies = purpose == Purpose::Time ? weight_copies(w_bytes) : 1;
  std::vector<Tensor> ws;
  for (int i = 0; i < copies; ++i) ws.push_back(torch::randn({s.N, s.K}, gpu(dt)) / std::sqrt(static_cast<double>(s.K)));
  ops::GemvFusion f;
  f.k_splits = v.k_splits;
  if (norm) f.norm_weight = 1 + 0.3 * torch::randn({s.K}, gpu(dt)), f.norm_eps = 1e-5;
  f.silu_mul = silu;
  if (gate) f.x_gate = torch::randn({s.M, 1, s.K}, gpu(dt)) * 2;
  if (add) f.residual = torch::randn({s.M, 1, s.N}, gpu(dt));
  auto next = std::make_shared<int>(0);
  r.kernel = [=] { ops::gemv_fused(x, ws[(*next)++ % copies], f); };
  r.reference = [=] { at::linear(x, ws[(*next)++ % copies]); };
  r.reference_in_graph = true;
  r.min_reps = copies;
  r.bytes = w_bytes + bytes_of({x}) + static_cast<double>(s.M * s.N) * torch::elementSize(dt);
  r.check = [=] {
    const auto& w = ws[0];
    std::vector<Check> out;
    if (v.check_applies) {
      out.push_back(holds("gemv_fused_applies", ops::gemv_fused_applies(x, w, f)));
      if (!out.back().passed) return out;
    }
    auto x64 = cpu64(x), in = x64;
    if (norm) in = x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + f.norm_eps) * cpu64(f.norm_weight);
    if (silu) {
      auto a = x64.narrow(-1, 0, s.K), b = x64.narrow(-1, s.K, s.K);
      in = a * torch::sigmoid(a) * b;
    }
    if (gate) in = x64 * torch::sigmoid(cpu64(f.x_gate));
    auto expected = torch::matmul(in, cpu64(w).t());
    if (add) expected = expected + cpu64(f.residual);
    auto y = ops::gemv_fused(x, w, f);
    out.push_back(holds("y [M, 1, N]", y.sizes() == torch::IntArrayRef({s.M, 1, s.N})));
    out.push_back(holds(cat("y in ", name(dt)), y.scalar_type() == dt));
    out.push_back(no_nan("y", y));
    out.push_back(below("y", rel_err(y.cpu(), expected), tolerance(dt)));
    return out;
  };
  return r;
}

void add_gemv(Table& t, GemvShape s, torch::ScalarType dt, GemvVariant v, bool model_shape) {
  const std::string splits = !v.splits_in_name ? "" : v.k_splits ? cat(" splits ", v.k_splits) : " splits auto";
  t.add("gemv", cat("M", s.M, " N", s.N, " K", s.K, fold_name(v.fold), splits, v.strided_x ? " strided x" : ""), dt,
        s.M, 0, model_shape, [=](Purpose p) { return gemv_run(s, dt, v, p); });
}

// ---------------------------------------------------------------------------------------------
// gemv_chain: a block's tail as one chained kernel (or two and a GEMV), and one product alone.

// The kernel's outputs of a tail run as a chain of the first two products and w2 as gemv_fused
// (with h as its residual), or as one chain of three. Empty where the chain kernel does not take it.
std::vector<Tensor> run_tail(const BlockTail& tail, bool split_down) {
  const auto products = tail.products();
  if (!split_down) return ops::gemv_chain_fused(tail.y, products);
  auto out = ops::gemv_chain_fused(tail.y, {products[0], products[1]});
  if (out.empty()) return out;
  ops::GemvFusion add = products[2].fusion;
  add.residual = out[0];
  out.push_back(ops::gemv_fused(out[1], tail.w2, add));
  return out;
}

KernelRun gemv_chain_tail_run(int64_t M, int64_t d, int64_t k, int64_t ffn, bool gated, bool epilogue,
                              bool split_down, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const double w_bytes = static_cast<double>(d * k + 3 * ffn * d) * torch::elementSize(dt);
  const int copies = purpose == Purpose::Time ? weight_copies(w_bytes) : 1;
  std::vector<BlockTail> tails;
  for (int i = 0; i < copies; ++i) tails.emplace_back(M, d, k, ffn, gated, dt, epilogue);
  auto next = std::make_shared<int>(0);
  r.kernel = [=] { run_tail(tails[(*next)++ % copies], split_down); };
  // Three gemv_fused launches, SiLU·mul as w2's prologue.
  r.reference = [=] {
    const auto& tail = tails[(*next)++ % copies];
    const auto p = tail.products();
    auto h = ops::gemv_fused(tail.y, tail.wo, p[0].fusion);
    auto gu = ops::gemv_fused(h, tail.w13, p[1].fusion);
    ops::GemvFusion down;
    down.silu_mul = true, down.residual = h;
    ops::gemv_fused(gu, tail.w2, down);
  };
  r.reference_in_graph = true;
  r.min_reps = copies;
  r.bytes = w_bytes + static_cast<double>(M * (k + 4 * d + 2 * ffn)) * torch::elementSize(dt);
  r.check = [=] {
    const auto& tail = tails[0];
    const auto got = run_tail(tail, split_down);
    std::vector<Check> out{holds("the chain takes the block tail", got.size() == 3u)};
    if (!out.back().passed) return out;
    const auto expected = tail.reference(got);
    const auto one_by_one = tail.unchained();
    for (int i = 0; i < 3; ++i) {
      const std::string product = cat("product ", i);
      out.push_back(holds(product + " shaped as unchained", got[i].sizes() == one_by_one[i].sizes()));
      if (!out.back().passed) return out;
      out.push_back(no_nan(product, got[i]));
      out.push_back(below(product, rel_err(got[i].cpu(), expected[i]), tolerance(dt)));
      out.push_back(below(product + " against unchained", rel_err(got[i].cpu(), cpu64(one_by_one[i])), tolerance(dt)));
    }
    return out;
  };
  return r;
}

void add_gemv_chain_tail(Table& t, int64_t M, int64_t d, int64_t k, int64_t ffn, bool gated, bool epilogue,
                         bool split_down, torch::ScalarType dt, bool model_shape) {
  t.add("gemv_chain",
        cat("M", M, " d", d, " k", k, " ffn", ffn, gated ? " gated" : "", epilogue ? " silu*mul epilogue" : "",
            split_down ? " + gemv w2" : ""),
        dt, M, 0, model_shape,
        [=](Purpose p) { return gemv_chain_tail_run(M, d, k, ffn, gated, epilogue, split_down, dt, p); });
}

KernelRun gemv_chain_one_run(GemvShape s, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const auto x = torch::randn({s.M, 1, s.K}, gpu(dt));
  const double w_bytes = static_cast<double>(s.N * s.K) * torch::elementSize(dt);
  const int copies = purpose == Purpose::Time ? weight_copies(w_bytes) : 1;
  std::vector<Tensor> ws;
  for (int i = 0; i < copies; ++i) ws.push_back(torch::randn({s.N, s.K}, gpu(dt)) * 0.02);
  auto next = std::make_shared<int>(0);
  r.kernel = [=] { ops::gemv_chain_fused(x, {ops::ChainProduct{ws[(*next)++ % copies]}}); };
  r.reference = [=] { at::linear(x, ws[(*next)++ % copies]); };
  r.reference_in_graph = true;
  r.min_reps = copies;
  r.bytes = w_bytes + bytes_of({x}) + static_cast<double>(s.M * s.N) * torch::elementSize(dt);
  r.check = [=] {
    const auto out = ops::gemv_chain_fused(x, {ops::ChainProduct{ws[0]}});
    std::vector<Check> checks{holds("the chain takes the product", out.size() == 1u)};
    if (!checks.back().passed) return checks;
    checks.push_back(below("y", rel_err(out[0].cpu(), torch::matmul(cpu64(x), cpu64(ws[0]).t())), tolerance(dt)));
    return checks;
  };
  return r;
}

// ---------------------------------------------------------------------------------------------
// gemv_batched: J independent products in one launch (DSA's latent absorptions).

struct BatchedShape {
  int64_t M, J, N, K;
};

KernelRun gemv_batched_run(BatchedShape s, torch::ScalarType dt, bool gated, int64_t x_offset) {
  KernelRun r;
  // x a strided view (the packed projection's q_nope), misaligned with an offset (then copied);
  // out a view into a wider tensor of NaN whose other columns must stay untouched.
  const auto x = torch::randn({s.M, s.J, s.K + 16}, gpu(dt)).narrow(-1, x_offset, s.K);
  const auto w = torch::randn({s.J, s.N, s.K}, gpu(dt)) / std::sqrt(static_cast<double>(s.K));
  const auto gate = gated ? torch::randn({s.M, s.J, s.N + 3}, gpu(dt)).narrow(-1, 0, s.N) : Tensor();
  const auto wide = torch::full({s.M, s.J, s.N + 8}, std::nan(""), gpu(dt));
  const auto out = wide.narrow(-1, 4, s.N);
  r.kernel = [=] { ops::gemv_batched(x, w, out, gate); };
  r.reference = [=] {
    auto y = torch::einsum("mjk,jnk->mjn", {x, w});
    if (gated) y = y * torch::sigmoid(gate);
  };
  r.reference_in_graph = true;
  r.bytes = bytes_of({x, w, out, gate});
  r.check = [=] {
    std::vector<Check> checks{holds("gemv_batched_applies", ops::gemv_batched_applies(x, w, gate))};
    if (!checks.back().passed) return checks;
    ops::gemv_batched(x, w, out, gate);
    auto want = torch::einsum("mjk,jnk->mjn", {cpu64(x), cpu64(w)});
    if (gated) want = want * torch::sigmoid(cpu64(gate));
    checks.push_back(below("out", rel_err(out.cpu(), want), tolerance(dt)));
    checks.push_back(holds("nothing written left of out", torch::isnan(wide.narrow(-1, 0, 4)).all().item<bool>()));
    checks.push_back(holds("nothing written right of out", torch::isnan(wide.narrow(-1, s.N + 4, 4)).all().item<bool>()));
    return checks;
  };
  return r;
}

// ---------------------------------------------------------------------------------------------
// sparse_attention_decode: flash-decoding over selected cache rows (DSA's top-k tokens, NSA's
// blocks), with DSA's output absorption and gate folded into its combine.

// NaN in every cache row that a sequence does not select (its rows past counts[b] included).
void poison_unselected(Tensor cache, const Tensor& indices, const Tensor& counts) {
  const int64_t B = cache.size(0), L = cache.size(2);
  auto idx = indices.cpu(), cnt = counts.cpu();
  auto selected = torch::zeros({B, L}, torch::kBool);
  for (int64_t b = 0; b < B; ++b) selected[b].index_put_({idx[b].narrow(0, 0, cnt[b].item<int64_t>())}, true);
  cache.masked_fill_(~selected.cuda().view({B, 1, L, 1}), std::nan(""));
}

// The poisoned caches of a check: every row a sequence does not select is NaN.
void poison(const SparseShape& c, const SparseInputs& in) {
  poison_unselected(in.k, in.indices, in.counts);
  if (!c.latent) poison_unselected(in.v, in.indices, in.counts);
}

#ifdef LT2_WITH_CUDA
kernels::SparseAttentionDecodeParams sparse_params(const SparseInputs& in) {
  kernels::SparseAttentionDecodeParams p{};
  p.q = in.q.data_ptr();
  p.q_batch_stride = in.q.stride(0), p.q_head_stride = in.q.stride(1);
  p.k_cache = in.k.data_ptr(), p.v_cache = in.v.data_ptr();
  p.k_batch_stride = in.k.stride(0), p.k_head_stride = in.k.stride(1), p.k_row_stride = in.k.stride(2);
  p.v_batch_stride = in.v.stride(0), p.v_head_stride = in.v.stride(1), p.v_row_stride = in.v.stride(2);
  p.indices = in.indices.data_ptr<int64_t>();
  p.counts = in.counts.data_ptr<int64_t>();
  p.batch = in.q.size(0), p.q_heads = in.q.size(1), p.kv_heads = in.k.size(1);
  p.head_dim_k = in.k.size(3), p.head_dim_v = in.v.size(3), p.max_len = in.k.size(2), p.n = in.indices.size(1);
  p.num_splits = kernels::sparse_attention_decode_num_splits(p.batch, p.kv_heads, p.q_heads / p.kv_heads, p.n,
                                                             c10::cuda::current_device());
  p.scale = static_cast<float>(in.scale);
  p.dtype = in.q.scalar_type() == torch::kBFloat16  ? kernels::DType::BFloat16
            : in.q.scalar_type() == torch::kFloat16 ? kernels::DType::Float16
                                                    : kernels::DType::Float32;
  return p;
}

// The splits the launcher runs for in's shapes (without launching), and the count callers size
// the workspace with.
std::pair<int, int> splits_of(const SparseInputs& in) {
  const auto p = sparse_params(in);
  return {kernels::sparse_attention_decode_splits_used(p), p.num_splits};
}

// The kernel launched directly, its output and split workspaces filled with NaN first: every
// output element and every partial the combine reads must be written. Returns the output and the
// checks on the workspace.
std::pair<Tensor, std::vector<Check>> run_poisoned(const SparseInputs& in) {
  auto p = sparse_params(in);
  const int64_t B = p.batch, Hq = p.q_heads, Dv = p.head_dim_v;
  const int splits = p.num_splits;
  const float nan = std::nanf("");
  auto out = torch::full({B, Hq, Dv}, nan, in.q.options().memory_format(torch::MemoryFormat::Contiguous));
  auto partial_out = torch::full({B, Hq, splits, Dv}, nan, gpu(f32));
  auto partial_lse = torch::full({B, Hq, splits}, nan, gpu(f32));
  p.out = out.data_ptr();
  p.partial_out = splits > 1 ? partial_out.data_ptr<float>() : nullptr;
  p.partial_lse = splits > 1 ? partial_lse.data_ptr<float>() : nullptr;
  kernels::sparse_attention_decode(p, c10::cuda::getCurrentCUDAStream().stream());
  // The latent preset's tensor-core form runs fewer splits than the workspace holds: its partials
  // fill the first [B, Hq, used, Dv] of it.
  const int used = kernels::sparse_attention_decode_splits_used(p);
  std::vector<Check> checks{holds(cat(used, " splits used, at least one"), used >= 1),
                            holds(cat(used, " splits used, at most the workspace's ", splits), used <= splits)};
  if (used > 1) {
    checks.push_back(holds("every split partial written",
                           !torch::isnan(partial_out.flatten().narrow(0, 0, B * Hq * used * Dv)).any().item<bool>()));
    checks.push_back(holds("every split lse written",
                           !torch::isnan(partial_lse.flatten().narrow(0, 0, B * Hq * used)).any().item<bool>()));
  }
  return {out, checks};
}
#endif

// The rows one call reads (each sequence's n selected rows of every kv head; the latent form's
// values are its keys), q and the output.
double sparse_bytes(const SparseShape& c, const SparseInputs& in, int64_t out_dim) {
  const double row = static_cast<double>(c.Dk + (c.latent ? 0 : c.Dv)) * in.q.element_size();
  return c.B * c.Hkv * c.n * row + bytes_of({in.q}) + static_cast<double>(c.B * c.Hq * out_dim) * in.q.element_size();
}

// Every sequence at its full list to time; to check, NaN in every row it does not select.
SparseInputs sparse_case_inputs(const SparseShape& c, torch::ScalarType dt, Purpose purpose) {
  auto in = sparse_inputs(c, dt);
  if (purpose == Purpose::Check) poison(c, in);
  else in.counts.fill_(c.n);
  return in;
}

KernelRun sparse_attention_run(SparseShape c, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const auto in = sparse_case_inputs(c, dt, purpose);
  r.kernel = [=] { ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale); };
  r.reference = [=] { ops::sparse_attention_decode_reference(in.q, in.k, in.v, in.indices, in.counts, in.scale); };
  r.bytes = sparse_bytes(c, in, c.Dv);
  r.check = [=] {
    std::vector<Check> out{holds("the kernel takes the inputs", ops::sparse_attention_decode_supported(in.q, in.k, in.v))};
    if (!out.back().passed) return out;
    auto o = ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    out.push_back(holds("output [B, Hq, Dv]", o.sizes() == torch::IntArrayRef({c.B, c.Hq, c.Dv})));
    out.push_back(holds(cat("output in ", name(dt)), o.scalar_type() == dt));
    out.push_back(holds("no NaN row read, no output left unwritten", torch::isfinite(o).all().item<bool>()));
    out.push_back(below("output", rel_err(o, sparse_reference64(in)), tolerance(dt)));
#ifdef LT2_WITH_CUDA
    auto [poisoned, workspace] = run_poisoned(in);
    for (auto& check : workspace) out.push_back(std::move(check));
    out.push_back(same("output with NaN-poisoned buffers", poisoned, o));
#endif
    return out;
  };
  return r;
}

// DSA's latent preset (Dk 576, Dv 512 aliased in the keys, 16 query heads over one kv head) with
// counts set per sequence, in bf16 / fp16: the tensor-core form. Which path each case hits (n 2048
// on a 132-SM H200; tc::splits): B 1, n 2048: 32 splits of 2 tiles + combine (the workspace holds
// 128); B 8, n 2048: 16 splits of 4 tiles + combine; B 3, n 2048: 32 splits + combine, one count 0;
// B 1 and B 3, n 40 (2 tiles, the second partial): one split, `out` written without the combine;
// B 3, n 100 (4 tiles): 2 splits + combine; the count-5 sequence leaves split 1 empty.
KernelRun sparse_latent_counts_run(int64_t B, int64_t L, int64_t n, std::vector<int64_t> counts,
                                   torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const SparseShape c{B, 16, 1, 576, 512, L, n, true};
  auto in = sparse_inputs(c, dt);
  in.counts = torch::tensor(counts, torch::kInt64).cuda();
  if (purpose == Purpose::Check) poison(c, in);
  r.kernel = [=] { ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale); };
  r.reference = [=] { ops::sparse_attention_decode_reference(in.q, in.k, in.v, in.indices, in.counts, in.scale); };
  r.bytes = sparse_bytes(c, in, c.Dv);
  r.check = [=] {
    std::vector<Check> out;
    auto o = ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    out.push_back(holds("no NaN row read, no output left unwritten", torch::isfinite(o).all().item<bool>()));
    // Sequences with a count of 0 give zeros (the reference's softmax over nothing is NaN).
    auto nonempty = (in.counts > 0).nonzero().flatten();
    auto empty = (in.counts == 0).nonzero().flatten();
    if (empty.numel() > 0) {
      auto zeroed = o.index_select(0, empty);
      out.push_back(same("a count of 0 gives zeros", zeroed, torch::zeros_like(zeroed)));
    }
    out.push_back(below("output of the nonempty sequences",
                        rel_err(o.index_select(0, nonempty), sparse_reference64(in).index_select(0, nonempty)),
                        tolerance(dt)));
#ifdef LT2_WITH_CUDA
    auto [poisoned, workspace] = run_poisoned(in);
    for (auto& check : workspace) out.push_back(std::move(check));
    out.push_back(same("output with NaN-poisoned buffers", poisoned, o));
    const auto [used, splits] = splits_of(in);
    if (n == 2048) out.push_back(holds(cat(used, " of ", splits, " splits: several"), used > 1));
    if (n == 2048 && B == 1)
      out.push_back(holds(cat(used, " of ", splits, " splits: the tensor-core form's count"), used < splits));
    if (n == 40) out.push_back(holds(cat(used, " of ", splits, " splits: one"), used == 1));
#endif
    return out;
  };
  return r;
}

// The output absorption and its gate folded into the combine, y = (o absorb[h]^T) *
// sigmoid(gate), against float64 and against the unfolded path (o, then gemv_batched where it
// applies, else the product in fp32 on o); the gate a strided view.
KernelRun sparse_absorb_run(SparseShape c, int64_t Dy, bool gated, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const auto in = sparse_case_inputs(c, dt, purpose);
  const auto absorb =
      (torch::randn({c.Hq, Dy, c.Dv}, gpu(f32)) / std::sqrt(static_cast<double>(c.Dv))).to(dt);
  const auto gate = gated ? (torch::randn({c.B, c.Hq, Dy + 8}, gpu(f32)) * 2).to(dt).narrow(2, 4, Dy) : Tensor();
  r.kernel = [=] {
    ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale, absorb, gate);
  };
  r.reference = [=] {
    ops::sparse_attention_decode_reference(in.q, in.k, in.v, in.indices, in.counts, in.scale, absorb, gate);
  };
  r.bytes = sparse_bytes(c, in, Dy) + bytes_of({absorb, gate});
  r.check = [=] {
    std::vector<Check> out{holds("the kernel folds the absorption",
                                 ops::sparse_attention_absorb_supported(in.q, in.k, in.v, absorb, gate))};
    if (!out.back().passed) return out;
    auto y = ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale, absorb, gate);
    out.push_back(holds("y [B, Hq, Dy]", y.sizes() == torch::IntArrayRef({c.B, c.Hq, Dy})));
    out.push_back(holds("no NaN row read, no output left unwritten", torch::isfinite(y).all().item<bool>()));
    out.push_back(below("y", rel_err(y, sparse_reference64(in, absorb, gate)), tolerance(dt)));
    auto o = ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    Tensor unfolded;
    if (ops::gemv_batched_applies(o, absorb, gate)) {
      unfolded = torch::empty_like(y);
      ops::gemv_batched(o, absorb, unfolded, gate);
    } else {
      unfolded = torch::einsum("bhc,hjc->bhj", {o.to(f32), absorb.to(f32)});
      if (gated) unfolded = unfolded * torch::sigmoid(gate.to(f32));
    }
    out.push_back(below("y against the unfolded path", rel_err(y, unfolded), tolerance(dt)));
    return out;
  };
  return r;
}

std::string sparse_label(const SparseShape& c) {
  return cat("B", c.B, " Hq", c.Hq, " Hkv", c.Hkv, " Dk", c.Dk, " Dv", c.Dv, " L", c.L, " n", c.n,
             c.latent ? " latent" : "");
}

// ---------------------------------------------------------------------------------------------
// DSA's decode-step selection: the lightning indexer's scores, the top-k, both in one call, and
// the latent form's prep.

const double kInf = std::numeric_limits<double>::infinity();

// [B, L] bool: j < lens[b].
Tensor valid_mask(const Tensor& lens, int64_t L) { return torch::arange(L, lens.options()).unsqueeze(0) < lens.unsqueeze(1); }

// float64 on the CPU from the same (upcast) inputs: [B, L].
Tensor reference_scores(const IndexInputs& in) {
  auto q = in.q.to(torch::kCPU, f64).unsqueeze(1), w = in.w.to(torch::kCPU, f64).unsqueeze(1);
  return lightning_indexer_scores(q, w, in.keys.to(torch::kCPU, f64)).squeeze(1);
}

// Row b of got and want hold the same indices (in any order).
std::vector<Check> same_sets(const Tensor& got, const Tensor& want, const std::string& what) {
  std::vector<Check> out{holds(what + ": shapes", got.sizes() == want.sizes())};
  if (!out.back().passed) return out;
  auto g = std::get<0>(got.cpu().sort(-1)), w = std::get<0>(want.cpu().sort(-1));
  for (int64_t b = 0; b < got.size(0); ++b) out.push_back(same(cat(what, ", row ", b), g[b], w[b]));
  return out;
}

void append(std::vector<Check>& to, std::vector<Check> more) {
  for (auto& c : more) to.push_back(std::move(c));
}

struct IndexShape {
  int64_t B, H, D, L;
  bool strided;
};

KernelRun index_scores_run(IndexShape s, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const auto in = index_inputs(s.B, s.H, s.D, s.L, dt, s.strided, purpose == Purpose::Check);
  const auto out = torch::full({s.B, s.L}, std::nan(""), gpu(f32));  // every element must be written
  r.kernel = [=] { ops::dsa_index_scores(in.q, in.w, in.keys, in.lens, out); };
  r.reference = [=] { lightning_indexer_scores(in.q.unsqueeze(1), in.w.unsqueeze(1), in.keys); };
  r.bytes = bytes_of({in.q, in.w, in.keys, out});
  r.check = [=] {
    auto scores = ops::dsa_index_scores(in.q, in.w, in.keys, in.lens, out);
    std::vector<Check> checks{holds("written into out", scores.data_ptr() == out.data_ptr())};
    const auto valid = valid_mask(in.lens, s.L).cpu();
    const auto got = scores.cpu().to(f64), ref = reference_scores(in);
    checks.push_back(holds("no element unwritten, no key read past its length", !torch::isnan(got).any().item<bool>()));
    // The head weights have mixed signs, so a score can be a near-cancelling sum; its rounding
    // error scales with the sum of the terms' magnitudes, which is what the error is measured
    // against (sum_h |w_h| ReLU(q_h . k), float64).
    auto magnitude_in = in;
    magnitude_in.w = in.w.abs();
    const auto magnitude = reference_scores(magnitude_in).masked_select(valid);
    const double err = (got.masked_select(valid) - ref.masked_select(valid)).norm().item<double>() /
                       std::max(magnitude.norm().item<double>(), 1e-300);
    checks.push_back(below("scores, against the terms' magnitudes", err, tolerance(dt)));
    checks.push_back(holds("-inf past the lengths", (got.masked_select(~valid) == -kInf).all().item<bool>()));
    return checks;
  };
  return r;
}

// [6, L] fp32 rows of the kinds top-k gets wrong: distinct scores, heavy ties (rounded scores),
// all equal, many exact zeros (with -0 among them), mostly -inf, all -inf.
Tensor tie_heavy_rows(int64_t L) {
  auto opts = gpu(f32);
  auto distinct = torch::randn({L}, opts);
  auto rounded = torch::round(torch::randn({L}, opts) * 3);
  auto equal = torch::full({L}, 0.5, opts);
  auto zeros = torch::relu(torch::randn({L}, opts));
  zeros = torch::where(torch::rand({L}, opts) < 0.3, torch::full({L}, -0.0, opts), zeros);
  auto mostly_inf = torch::randn({L}, opts).masked_fill(torch::rand({L}, opts) < 0.9, -kInf);
  auto all_inf = torch::full({L}, -kInf, opts);
  return torch::stack({distinct, rounded, equal, zeros, mostly_inf, all_inf});
}

// The k to select from L entries: 1, 3, 2048, half and all (each once).
std::vector<int64_t> ks_for(int64_t L) {
  std::vector<int64_t> ks{1, std::min<int64_t>(3, L), std::min<int64_t>(2048, L), L / 2 + 1, L};
  std::sort(ks.begin(), ks.end());
  ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
  return ks;
}

// topk_select == topk_indices as sets, exactly, on tie-heavy rows; with lengths, entries past a
// length are never read (NaN and +inf there), rank as -inf, and a row's valid entries come first.
// cap: DecodeOptions::topk_max_blocks (8, the portable cluster; 16 where the device places it).
KernelRun topk_select_run(int64_t L, int64_t k, bool with_lengths, int cap) {
  KernelRun r;
  auto scores = tie_heavy_rows(L);
  const int64_t B = scores.size(0);
  Tensor lens;
  if (with_lengths) {
    auto garbage = torch::where(torch::rand({B, L}, gpu(f32)) < 0.5, torch::full({B, L}, std::nan(""), gpu(f32)),
                                torch::full({B, L}, kInf, gpu(f32)));
    lens = index_lengths(B, L);
    lens[1] = std::min<int64_t>(L, 30);  // shorter than most k
    scores = torch::where(valid_mask(lens, L), scores, garbage);
  }
  const auto visible = with_lengths ? valid_mask(lens, L) : torch::ones_like(scores, torch::kBool);
  const auto out = torch::full({B, k}, -1, gpu(torch::kInt64));
  DecodeOptions options;
  options.topk_max_blocks = cap;
  r.kernel = [=] {
    DecodeOptionsGuard guard(options);
    ops::topk_select(scores, k, lens, out);
  };
  r.reference = [=] { topk_indices(scores, visible, k); };
  r.bytes = bytes_of({scores, out});
  r.check = [=] {
    DecodeOptionsGuard guard(options);
    auto idx = ops::topk_select(scores, k, lens, out);
    std::vector<Check> checks{holds("written into out", idx.data_ptr() == out.data_ptr())};
    append(checks, same_sets(idx, topk_indices(scores, visible, k), with_lengths ? "with lengths" : "no lengths"));
    if (with_lengths) {
      const auto idx_cpu = idx.cpu(), lens_cpu = lens.cpu();
      for (int64_t b = 0; b < B; ++b) {
        const int64_t len = lens_cpu[b].item<int64_t>(), n = std::min(len, k);
        checks.push_back(holds(cat("row ", b, ": the valid entries first"),
                               (idx_cpu[b].narrow(0, 0, n) < len).all().item<bool>()));
      }
    }
    return checks;
  };
  return r;
}

struct IndexTopkShape {
  int64_t B, H, D, L, k;
};

// dsa_index_topk == topk_select(dsa_index_scores) == topk_indices of those scores.
KernelRun index_topk_run(IndexTopkShape s, torch::ScalarType dt, Purpose purpose) {
  KernelRun r;
  const auto in = index_inputs(s.B, s.H, s.D, s.L, dt, false, purpose == Purpose::Check);
  r.kernel = [=] { ops::dsa_index_topk(in.q, in.w, in.keys, in.lens, s.k); };
  r.reference = [=] {
    auto scores = lightning_indexer_scores(in.q.unsqueeze(1), in.w.unsqueeze(1), in.keys).squeeze(1);
    topk_indices(scores, valid_mask(in.lens, s.L), s.k);
  };
  r.bytes = bytes_of({in.q, in.w, in.keys}) + static_cast<double>(s.B * s.k) * sizeof(int64_t);
  r.check = [=] {
    std::vector<Check> checks{holds("the kernels take the inputs", ops::dsa_index_topk_supported(in.q, in.keys, s.k))};
    if (!checks.back().passed) return checks;
    auto idx = ops::dsa_index_topk(in.q, in.w, in.keys, in.lens, s.k);
    auto scores = ops::dsa_index_scores(in.q, in.w, in.keys, in.lens);
    checks.push_back(same("topk_select of dsa_index_scores", idx, ops::topk_select(scores, s.k, in.lens)));
    append(checks, same_sets(idx, topk_indices(scores, valid_mask(in.lens, s.L), s.k), "against topk_indices"));
    return checks;
  };
  return r;
}

std::string prep_label(const PrepShape& s) {
  return cat("B", s.B, " H", s.H, " D", s.D, " dc", s.dc, " dr", s.dr, " HI", s.HI, " dI", s.dI, " r", s.r, " L", s.L,
             s.style == RopeStyle::Half ? " half" : " interleaved", " theta ", s.theta);
}

// dsa_latent_prep against dsa_latent_prep_reference (float64); with `absorb`, the q absorption
// (W_uk transposed, [H, d_c, D]) folded in, also against the unfolded path (the prep, then
// gemv_batched where it applies).
KernelRun latent_prep_run(PrepShape s, torch::ScalarType dt, bool absorb) {
  KernelRun r;
  auto a = prep_inputs(s, dt);
  if (absorb) a.absorb = (torch::randn({s.H, s.dc, s.D}, gpu(f32)) / std::sqrt(static_cast<double>(s.D))).to(dt);
  r.kernel = [=] { ops::dsa_latent_prep(a); };
  r.bytes = bytes_of({a.q_raw, a.kv_raw, a.index_q_raw, a.index_k_raw, a.index_w_raw, a.absorb, a.q, a.index_q,
                      a.index_w}) +
            static_cast<double>(s.B) * ((s.dc + s.dr) + s.dI) * a.q.element_size();  // the cache rows written
  r.check = [=] {
    std::vector<Check> checks;
    if (absorb) {
      checks.push_back(holds("the kernel folds the absorption", ops::dsa_latent_prep_absorb_supported(a.q_raw, a.q, a.absorb)));
      if (!checks.back().passed) return checks;
    }
    const auto want = with_output_copies(a);
    auto unfolded = with_output_copies(a);
    unfolded.absorb = Tensor();
    ops::dsa_latent_prep(a);
    ops::dsa_latent_prep_reference(want);
    append(checks, prep_checks(a, want, tolerance(dt)));
    if (absorb) {
      const auto q_nope = a.q_raw.narrow(-1, 0, s.D), latent = unfolded.q.narrow(-1, 0, s.dc);
      if (ops::gemv_batched_applies(q_nope, a.absorb)) {
        ops::dsa_latent_prep(unfolded);
        ops::gemv_batched(q_nope, a.absorb, latent);
        checks.push_back(below("q against the unfolded path", rel_err(a.q.cpu(), unfolded.q.cpu()), tolerance(dt)));
      }
    }
    return checks;
  };
  return r;
}

// ---------------------------------------------------------------------------------------------
// The model's decode shapes.

// The heads of the model's GDN layer, where it has the fused step's form (one value head per
// q/k head), and the widths of its projections.
struct GdnDims {
  bool fused_form = false;
  int64_t heads = 0, head_k = 0, head_v = 0, conv = 0, packed_inputs = 0, o_proj_in = 0;
  bool gated = true, neg_eigval = false;
  double norm_eps = 1e-5;
};

GdnDims gdn_dims(const ModelConfig& cfg) {
  torch::NoGradGuard ng;
  auto gdn = std::dynamic_pointer_cast<GatedDeltaNetImpl>(make_mixer("gdn", cfg, 0));
  GdnDims g;
  if (!gdn || gdn->num_v_heads != gdn->num_heads) return g;
  g.fused_form = true;
  g.heads = gdn->num_heads, g.head_k = gdn->head_k_dim, g.head_v = gdn->head_v_dim, g.conv = gdn->conv_kernel;
  for (const auto& l : {gdn->q_proj, gdn->k_proj, gdn->v_proj, gdn->a_proj, gdn->b_proj, gdn->g_proj})
    if (l) g.packed_inputs += l->weight.size(0);
  g.o_proj_in = gdn->o_proj->weight.size(1);
  g.gated = gdn->use_gate, g.neg_eigval = gdn->allow_neg_eigval, g.norm_eps = gdn->norm_eps;
  return g;
}

void add_model_cases(Table& t, const CaseGrid& grid) {
  const auto& cfg = grid.model;
  const auto gdn = gdn_dims(cfg);
  const int64_t d = cfg.d_model, ffn = cfg.ffn_dim();
  // (N, K) of the decode projections: GDN's packed inputs and o_proj, the packed FFN w1|w3 and
  // w2, the LM head.
  std::vector<std::pair<int64_t, int64_t>> projections;
  if (gdn.fused_form) projections.push_back({gdn.packed_inputs, d}), projections.push_back({d, gdn.o_proj_in});
  projections.push_back({2 * ffn, d});
  projections.push_back({d, ffn});
  if (cfg.vocab_size > 0) projections.push_back({cfg.vocab_size, d});
  for (auto dt : grid.dtypes)
    for (int64_t B : grid.batches) {
      if (gdn.fused_form) {
        const RecurrentShape rs{B, gdn.heads, gdn.head_k, gdn.head_v};
        add_recurrent_step(t, rs, dt, /*delta=*/true, Decay::PerHead, true);
        const GdnShape gs{B, gdn.heads, gdn.head_k, gdn.head_v, gdn.conv};
        for (const auto& form : kGdnForms) add_gdn_decode(t, form, gs, dt, gdn.gated, gdn.neg_eigval, gdn.norm_eps, true);
      }
      for (int64_t L : grid.contexts)
        add_attention_decode(t, {B, cfg.n_heads, cfg.kv_heads(), cfg.dim_head(), L}, dt, true);
      if (!grid.contexts.empty())
        add_rope_cache_write(t, {B, cfg.n_heads, cfg.kv_heads(), cfg.dim_head(), grid.contexts.front(), cfg.rope_style},
                             dt, cfg.rope_theta, true);
      t.add("rms_norm", cat("rows", B, " d", d, " eps ", cfg.norm_eps), dt, B, 0, true,
            [=, eps = cfg.norm_eps](Purpose) { return rms_norm_run(B, d, dt, eps); });
      t.add("add_rms_norm", cat("rows", B, " d", d, " eps ", cfg.norm_eps), dt, B, 0, true,
            [=, eps = cfg.norm_eps](Purpose) { return add_rms_norm_run(B, d, dt, eps); });
      t.add("silu_mul", cat("rows", B, " hidden", ffn), dt, B, 0, true,
            [=](Purpose) { return silu_mul_run(B, ffn, false, dt); });
      if (B > kernels::kGemvMaxRows) continue;
      for (auto [N, K] : projections)
        for (int splits : grid.gemv_splits) {
          GemvVariant v;
          v.k_splits = splits, v.splits_in_name = true;
          add_gemv(t, {B, N, K}, dt, v, true);
        }
      if (dt == f32) continue;  // the chain kernel runs on tensor cores: bf16 and fp16
      // The tail after GDN (o_proj's K is its value width) and after attention (K = d).
      for (bool split_down : {false, true}) {
        if (gdn.fused_form) add_gemv_chain_tail(t, B, d, gdn.o_proj_in, ffn, false, true, split_down, dt, true);
        add_gemv_chain_tail(t, B, d, d, ffn, false, true, split_down, dt, true);
      }
      for (auto [N, K] : projections)
        t.add("gemv_chain", cat("M", B, " N", N, " K", K, " one product"), dt, B, 0, true,
              [=, s = GemvShape{B, N, K}](Purpose p) { return gemv_chain_one_run(s, dt, p); });
    }
}

// ---------------------------------------------------------------------------------------------
// The fixed cases: shapes at each kernel's edges.

void add_fixed_cases(Table& t) {
  // recurrent_step: K and V off multiples of 32 (and V off multiples of 4: the 4-byte copy path),
  // the 1.3B GDN head (96 x 192), K up to 256 and several column tiles.
  for (auto dt : {f32, bf16})
    for (bool delta : {true, false})
      for (Decay decay : {Decay::None, Decay::PerHead, Decay::PerChannel})
        for (RecurrentShape s : {RecurrentShape{1, 2, 32, 64}, RecurrentShape{3, 4, 96, 192},
                                 RecurrentShape{8, 2, 128, 128}, RecurrentShape{3, 3, 6, 12},
                                 RecurrentShape{2, 3, 64, 70}, RecurrentShape{1, 1, 256, 512}})
          add_recurrent_step(t, s, dt, delta, decay, false);

  // gdn_decode in each forced form. (1, 1, 256, 512): four passes over the value columns
  // (per-head form), eight tiles of 64 (cluster form), two passes of 256 columns at 32 rows per
  // thread (register form); V = 12, 40: one partial tile (register form: a partial warp of
  // columns); V = 70: rows not 16-byte aligned (per-head and cluster forms only); K = 200: rows
  // past K in the last row group, 10 passes (register form); W = 1: no conv window; (80, 400):
  // rows past K and two passes of 256 and 144 columns (register form). beta in (0, 2) on K = 96.
  for (auto dt : {f32, bf16})
    for (bool gated : {true, false})
      for (GdnShape s : {GdnShape{1, 2, 32, 64, 4}, GdnShape{3, 4, 96, 192, 4}, GdnShape{8, 2, 128, 256, 4},
                         GdnShape{3, 3, 6, 12, 4}, GdnShape{2, 2, 64, 70, 3}, GdnShape{1, 1, 256, 512, 4},
                         GdnShape{2, 1, 16, 40, 1}, GdnShape{2, 2, 200, 1200, 4}, GdnShape{2, 2, 80, 400, 4}})
        for (const auto& form : kGdnForms)
          if (form.form != kernels::GdnDecodeForm::Auto)
            add_gdn_decode(t, form, s, dt, gated, /*neg_eigval=*/s.K == 96, 1e-5, false);

  // attention_decode: GQA groups 1, 2, 3 (padded to the 4-head instance), 4 and 8; L off any
  // split size.
  for (auto dt : {f32, bf16})
    for (AttentionShape s : {AttentionShape{1, 4, 4, 64, 100}, AttentionShape{3, 8, 2, 128, 1000},
                             AttentionShape{8, 16, 4, 128, 300}, AttentionShape{3, 4, 1, 256, 77},
                             AttentionShape{1, 16, 16, 128, 5000}, AttentionShape{2, 6, 2, 64, 64},
                             AttentionShape{3, 8, 1, 128, 333}, AttentionShape{2, 4, 2, 128, 1}})
      add_attention_decode(t, s, dt, false);

  // rope_cache_write: MHA and GQA, both RoPE styles.
  for (auto dt : {f32, bf16})
    for (RopeCacheShape c : {RopeCacheShape{3, 4, 4, 64, 40, RopeStyle::Interleaved},
                             RopeCacheShape{2, 16, 4, 128, 9, RopeStyle::Half},
                             RopeCacheShape{4, 6, 2, 32, 17, RopeStyle::Interleaved},
                             RopeCacheShape{1, 2, 1, 256, 5, RopeStyle::Half}})
      add_rope_cache_write(t, c, dt, 10000.0, false);

  // The norms at [rows, d]: d = 64, 2048 (the 1.3B width), dims off multiples of 256 and of 32,
  // d < 256; 6144 and 8192 take the 16-byte form's 3 and 4 pieces a thread in bf16 (and the element
  // form in fp32). silu_mul: 5632, the 1.3B FFN width; 37, 1: not a multiple of the block size.
  const std::pair<int64_t, int64_t> norm_shapes[] = {{1, 64},   {1, 2048}, {3, 1000}, {5, 37},
                                                     {2, 4097}, {64, 300}, {4, 6144}, {2, 8192}};
  for (auto dt : {f32, bf16}) {
    for (auto [rows, d] : norm_shapes)
      t.add("rms_norm", cat("rows", rows, " d", d, " eps ", 1e-5), dt, rows, 0, false,
            [=, rows = rows, d = d](Purpose) { return rms_norm_run(rows, d, dt, 1e-5); });
    for (auto [rows, d] : norm_shapes)
      t.add("add_rms_norm", cat("rows", rows, " d", d, " eps ", 1e-6), dt, rows, 0, false,
            [=, rows = rows, d = d](Purpose) { return add_rms_norm_run(rows, d, dt, 1e-6); });
    for (auto [rows, hidden] : std::vector<std::pair<int64_t, int64_t>>{{1, 5632}, {8, 5632}, {3, 37}, {2, 1}, {33, 300}})
      for (bool strided : {false, true})
        t.add("silu_mul", cat("rows", rows, " hidden", hidden, strided ? " strided" : ""), dt, rows, 0, false,
              [=, rows = rows, hidden = hidden](Purpose) { return silu_mul_run(rows, hidden, strided, dt); });
  }

  // gemv: every row count 1..kGemvMaxRows, N off multiples of the block's rows, K of one vector
  // up to the FFN width (bf16: the tensor-core kernel at K % 32 == 0, the FMA one otherwise), x
  // rows strided; each folded prologue / epilogue; K split over a cluster at every split count
  // (including more splits than K has 32-wide chunks, where some blocks add nothing), with the
  // RMSNorm statistic and the residual reduced across the cluster too.
  for (auto dt : {f32, bf16})
    for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {5, 24}, {2051, 2048}, {1030, 5632}, {4099, 3072}})
      for (int64_t M = 1; M <= kernels::kGemvMaxRows; ++M) {
        GemvVariant v;
        v.strided_x = true;
        add_gemv(t, {M, N, K}, dt, v, false);
      }
  for (auto dt : {f32, bf16})
    for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{37, 24}, {2051, 2048}, {1030, 5632}})
      for (int64_t M : {1, 5, 8})
        for (Fold fold : {Fold::Norm, Fold::SiluMul, Fold::Residual, Fold::NormResidual, Fold::SiluMulResidual,
                          Fold::Gate, Fold::GateResidual}) {
          GemvVariant v;
          v.fold = fold, v.check_applies = true;
          add_gemv(t, {M, N, K}, dt, v, false);
        }
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{37, 64}, {2051, 2048}, {1030, 5632}})
    for (int64_t M : {1, 3, 8})
      for (int splits = 0; splits <= kernels::kGemvMaxKSplits; ++splits)
        for (Fold fold : {Fold::None, Fold::NormResidual}) {
          GemvVariant v;
          v.fold = fold, v.k_splits = splits, v.splits_in_name = true;
          add_gemv(t, {M, N, K}, bf16, v, false);
        }

  // gemv_chain: a pre-norm block's tail (output projection with the sigmoid gate and the
  // residual, w1|w3 with the RMSNorm prologue, w2 with the first product's output as its
  // residual; SiLU·mul as w1|w3's epilogue, the engine's form, or as w2's prologue) at 1..8 rows,
  // K off the ring's slices, N off the 8-row tiles (and the epilogue's 4-column tiles), the 1.3B
  // shapes. fp16 for the dtype path on the smaller shapes; the prologue form once per shape.
  for (auto dt : {bf16, f16})
    for (auto [d, k, ffn] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{96, 64, 160}, {1056, 2080, 1120}, {2048, 3072, 5632}})
      for (int64_t M : {1, 3, 8})
        for (bool gated : {false, true})
          for (bool epilogue : {true, false}) {
            if (dt == f16 && (d > 1056 || M == 3)) continue;
            if (!epilogue && gated) continue;
            add_gemv_chain_tail(t, M, d, k, ffn, gated, epilogue, false, dt, false);
          }

  // gemv_batched: fp32 and bf16 (both kernels), every row count, x a strided view and a
  // misaligned one, with and without the sigmoid output gate.
  for (auto dt : {f32, bf16})
    for (auto [J, N, K] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{16, 512, 128}, {16, 128, 512}, {3, 5, 24}, {1, 33, 64}})
      for (int64_t M : std::initializer_list<int64_t>{1, 3, kernels::kGemvMaxRows})
        for (bool gated : {false, true})
          for (int64_t x_offset : {0, 1})
            t.add("gemv_batched",
                  cat("M", M, " J", J, " N", N, " K", K, gated ? " gated" : "", x_offset ? " misaligned x" : ""), dt,
                  M, 0, false, [=, s = BatchedShape{M, J, N, K}](Purpose) {
                    return gemv_batched_run(s, dt, gated, x_offset);
                  });

  // sparse_attention_decode: every (Dk, Dv) instance, groups 1, 3, 4, 8, 16, batches 1, 3, 8, index
  // lists from 1 to 2048 entries with distinct rows in random order, counts differing per sequence
  // (1 and n included), the latent form, caches and queries with non-contiguous strides. fp16 on a
  // third of the shapes.
  const SparseShape sparse_shapes[] = {
      // DSA's latent preset at batch 1 (a count of 1 here; the counts cases below set counts):
      // fp32 on CUDA cores, 128 one-tile splits; bf16 / fp16 the tensor-core form, 32 splits
      {1, 16, 1, 576, 512, 3000, 2048, true},
      {8, 16, 1, 576, 512, 2100, 2048, true},    // ... at batch 8 (tensor-core form: 16 splits)
      {3, 16, 1, 576, 512, 500, 100, true},      // a short list: partial tiles, idle splits
      {2, 16, 1, 576, 512, 40, 12, true},        // one split, written without the combine
      {3, 8, 1, 576, 512, 400, 150, false},      // separate 512-dim values, G 8
      {3, 16, 16, 128, 128, 2500, 2048, false},  // DSA's GQA form (G 1)
      {8, 32, 8, 128, 128, 700, 300, false},     // G 4
      {3, 16, 1, 128, 128, 100, 16, false},      // G 16, four key groups, a one-tile list
      {1, 4, 1, 64, 64, 200, 37, false},         // G 4, D 64
      {8, 16, 1, 64, 64, 300, 150, false},       // G 16, D 64, eight key groups
      {8, 64, 4, 64, 64, 3000, 2048, false},     // fla's NSA heads (64 over 4, D 64): 16 tiles a split
      {3, 12, 4, 256, 256, 600, 333, false},     // G 3, padded to the 4-head instance
      {3, 16, 1, 256, 256, 300, 64, false},      // G 16, D 256
      {1, 2, 2, 256, 256, 50, 1, false},         // one index
  };
  for (auto dt : {f32, bf16, f16})
    for (size_t i = 0; i < std::size(sparse_shapes); ++i) {
      if (dt == f16 && i % 3 != 0) continue;
      const auto c = sparse_shapes[i];
      t.add("sparse_attention_decode", sparse_label(c), dt, c.B, c.L, false,
            [=](Purpose p) { return sparse_attention_run(c, dt, p); });
    }
  // The latent preset's tensor-core form with counts set per sequence: below n, one below a tile
  // (1, 7, 17), one at n, one that leaves a split's last tile partial and later splits empty, a
  // count of 0 (zeros).
  struct LatentCounts {
    int64_t B, L, n;
    std::vector<int64_t> counts;
  };
  const LatentCounts latent_counts[] = {
      {1, 3000, 2048, {2048}},
      {1, 2500, 2048, {1500}},
      {8, 2100, 2048, {2048, 1, 17, 1000, 2047, 33, 640, 1999}},
      {3, 2100, 2048, {700, 0, 2048}},
      {1, 100, 40, {40}},
      {3, 100, 40, {40, 7, 33}},
      {3, 300, 100, {100, 5, 64}},
  };
  for (auto dt : {bf16, f16})
    for (const auto& c : latent_counts) {
      std::string listed;
      for (int64_t count : c.counts) listed += cat(listed.empty() ? "" : ",", count);
      t.add("sparse_attention_decode", cat("B", c.B, " L", c.L, " n", c.n, " latent counts ", listed), dt, c.B, c.L,
            false, [=](Purpose p) { return sparse_latent_counts_run(c.B, c.L, c.n, c.counts, dt, p); });
    }
  // The folded absorption: DSA's latent preset (Dy 128) at batch 1 and 8 (the tensor-core form's
  // 32 and 16 splits), a short list and one split (partials written without a combine of
  // several); clusters of 1, 2 and 4 blocks (Dv 64, 128, 256) at odd Dy; 32 sequences. fp16 on
  // every other shape.
  const std::pair<SparseShape, int64_t> absorb_shapes[] = {
      {{1, 16, 1, 576, 512, 3000, 2048, true}, 128},  // lt2-gdn-dsa-1.3b, batch 1
      {{8, 16, 1, 576, 512, 2100, 2048, true}, 128},  // ... batch 8
      {{3, 16, 1, 576, 512, 500, 100, true}, 128},
      {{2, 16, 1, 576, 512, 40, 12, true}, 128},      // one split
      {{3, 6, 2, 64, 64, 50, 20, false}, 40},         // a cluster of one block
      {{5, 4, 1, 128, 128, 200, 37, false}, 24},      // two blocks
      {{32, 8, 1, 256, 256, 300, 64, false}, 128},    // four blocks, 32 sequences
  };
  for (auto dt : {f32, bf16, f16})
    for (size_t i = 0; i < std::size(absorb_shapes); ++i) {
      if (dt == f16 && i % 2 != 0) continue;
      const auto [c, Dy] = absorb_shapes[i];
      for (bool gated : {true, false})
        t.add("sparse_attention_decode", cat(sparse_label(c), " absorb Dy", Dy, gated ? " gated" : ""), dt, c.B, c.L,
              false, [=, c = c, Dy = Dy](Purpose p) { return sparse_absorb_run(c, Dy, gated, dt, p); });
    }

  // dsa_index_scores: the 1.3B indexer (64 x 128) at short and long caches (40000: several key
  // tiles per block), H 16 and 128, D 64 and 256; D 80 (a 16-wide last k-step), H 24 / D 72 (bf16
  // on the FMA kernel); L 1 and lengths off every tile size.
  for (auto dt : {f32, bf16, f16})
    for (IndexShape s : {IndexShape{1, 64, 128, 100, false}, IndexShape{3, 64, 128, 5000, true},
                         IndexShape{8, 16, 64, 300, false}, IndexShape{3, 16, 128, 4500, true},
                         IndexShape{8, 64, 64, 1000, false}, IndexShape{3, 64, 128, 40000, false},
                         IndexShape{2, 128, 256, 700, true}, IndexShape{2, 32, 80, 333, false},
                         IndexShape{3, 24, 72, 200, true}, IndexShape{1, 64, 128, 1, false},
                         IndexShape{3, 16, 128, 77, false}})
      t.add("dsa_index_scores", cat("B", s.B, " H", s.H, " D", s.D, " L", s.L, s.strided ? " strided" : ""), dt, s.B,
            s.L, false, [=](Purpose p) { return index_scores_run(s, dt, p); });

  // topk_select: one block (L <= 4096), clusters of 2, 5 and 8 blocks; with the portable cap,
  // 131072: 8 slices of 16384 entries, all cached in shared memory; 200000: the rest of every slice
  // re-read from global memory. Uncapped (where the device places 16-block clusters): 10 and 16
  // blocks. With lengths at 100, 5000, 40000 and 200000.
  for (int cap : {8, 16})
    for (int64_t L : {1, 7, 100, 4096, 5000, 20000, 40000, 131072, 200000})
      for (int64_t k : ks_for(L))
        t.add("topk_select", cat("L", L, " k", k, " cap ", cap), f32, 6, L, false,
              [=](Purpose) { return topk_select_run(L, k, false, cap); });
  for (int64_t L : {100, 5000, 40000, 200000})
    for (int64_t k : ks_for(L))
      t.add("topk_select", cat("L", L, " k", k, " lengths"), f32, 6, L, false,
            [=](Purpose) { return topk_select_run(L, k, true, 0); });

  // dsa_index_topk
  for (auto dt : {f32, bf16})
    for (IndexTopkShape s : {IndexTopkShape{8, 64, 128, 5000, 2048}, IndexTopkShape{3, 16, 64, 300, 64},
                             IndexTopkShape{2, 64, 128, 33000, 2048}, IndexTopkShape{3, 64, 128, 100, 100}})
      t.add("dsa_index_topk", cat("B", s.B, " H", s.H, " D", s.D, " L", s.L, " k", s.k), dt, s.B, s.L, false,
            [=](Purpose p) { return index_topk_run(s, dt, p); });

  // dsa_latent_prep: lt2-gdn-dsa-1.3b, long positions, the engine tests' small DSA, odd dims (d_I
  // > 128 threads), no index RoPE. With the q absorption folded in: lt2-gdn-dsa-1.3b at batch 1
  // and 8 (128 units of 64 columns) and 32 (four passes of 8 sequences), odd (a 40-column unit,
  // D = 24), 8 columns (one chunk a half; fp32: two).
  const auto one_three_b = dsa_1p3b_prep_shape();
  auto at_batch = [&](int64_t B) {
    auto s = one_three_b;
    s.B = B;
    return s;
  };
  const PrepShape prep_shapes[] = {one_three_b,
                                   {8, 16, 128, 512, 64, 64, 128, 64, 40000, RopeStyle::Half, 500000.0, 2048},
                                   {3, 2, 64, 32, 8, 2, 16, 8, 40, RopeStyle::Half, 10000.0},
                                   {1, 5, 24, 40, 6, 3, 200, 10, 17, RopeStyle::Interleaved, 10000.0},
                                   {2, 3, 16, 8, 2, 1, 8, 0, 5, RopeStyle::Half, 10000.0}};
  const PrepShape absorb_prep_shapes[] = {at_batch(1), at_batch(8), at_batch(32),
                                          {3, 5, 24, 40, 6, 3, 200, 10, 17, RopeStyle::Interleaved, 10000.0},
                                          {2, 3, 16, 8, 2, 1, 8, 0, 5, RopeStyle::Half, 10000.0}};
  for (auto dt : {f32, bf16, f16}) {
    for (const auto& s : prep_shapes)
      t.add("dsa_latent_prep", prep_label(s), dt, s.B, s.L, false, [=](Purpose) { return latent_prep_run(s, dt, false); });
    for (const auto& s : absorb_prep_shapes)
      t.add("dsa_latent_prep", prep_label(s) + " absorb", dt, s.B, s.L, false,
            [=](Purpose) { return latent_prep_run(s, dt, true); });
  }
}

}  // namespace

std::string KernelCase::name() const {
  std::string n = cat(op, "_", kernel_cases::name(dtype), "_", shape), out;
  for (char c : n) {
    const bool keep = std::isalnum(static_cast<unsigned char>(c));
    if (keep) out += c;
    else if (!out.empty() && out.back() != '_') out += '_';
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Inputs and float64 references shared with the tests beside the table.

Tensor random_lengths(int64_t B, int64_t L) {
  auto lens = torch::randint(1, L + 1, {B}, torch::kInt64);
  lens[0] = 1;                 // a sequence with one key
  if (B > 1) lens[B - 1] = L;  // one using the whole cache
  return lens.cuda();
}

Tensor cache_with_poisoned_tail(int64_t B, int64_t Hkv, int64_t L, int64_t D, const Tensor& lens,
                                torch::ScalarType dt) {
  auto c = torch::randn({B, Hkv, L, D}, gpu(dt));
  auto j = torch::arange(L, gpu(torch::kInt64)).view({1, 1, L, 1});
  return c.masked_fill(j >= lens.view({B, 1, 1, 1}), std::nan(""));
}

Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lens, double scale) {
  const int64_t B = q.size(0), G = q.size(1) / k.size(1);
  auto lens_cpu = lens.cpu();
  std::vector<Tensor> outs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens_cpu[b].item<int64_t>();
    auto kb = k[b].narrow(1, 0, len).to(f64).repeat_interleave(G, 0);  // [Hq, len, D]
    auto vb = v[b].narrow(1, 0, len).to(f64).repeat_interleave(G, 0);
    auto scores = torch::matmul(kb, q[b].to(f64).unsqueeze(-1)).squeeze(-1) * scale;  // [Hq, len]
    outs.push_back(torch::matmul(torch::softmax(scores, -1).unsqueeze(1), vb).squeeze(1));  // [Hq, D]
  }
  return torch::stack(outs);
}

RopeCacheInputs rope_cache_inputs(const RopeCacheShape& c, torch::ScalarType dt) {
  RopeCacheInputs in;
  const int64_t qd = c.H * c.D, kd = c.Hkv * c.D;
  in.packed = torch::randn({c.B, qd + 2 * kd + 8}, gpu(dt));
  in.q = in.packed.narrow(1, 0, qd).view({c.B, c.H, c.D});
  in.k = in.packed.narrow(1, qd, kd).view({c.B, c.Hkv, c.D});
  in.v = in.packed.narrow(1, qd + kd, kd).view({c.B, c.Hkv, c.D});
  in.k_cache = torch::randn({c.B, c.Hkv, c.L, c.D}, gpu(dt));
  in.v_cache = torch::randn({c.B, c.Hkv, c.L, c.D}, gpu(dt));
  return in;
}

RopeCacheExpected rope_cache_reference(const RopeCacheInputs& in, const Tensor& seq_pos, double theta,
                                       RopeStyle style) {
  const auto pos = seq_pos.cpu();
  const int64_t B = in.q.size(0), L = in.k_cache.size(2);
  auto q = apply_rope(cpu64(in.q).unsqueeze(1), pos.view({B, 1}), theta, style).squeeze(1);
  auto k = apply_rope(cpu64(in.k).unsqueeze(1), pos.view({B, 1}), theta, style).squeeze(1);
  auto k_cache = cpu64(in.k_cache), v_cache = cpu64(in.v_cache);
  const auto in_cache = (pos >= 0) & (pos < L);
  const auto b_in = torch::nonzero(in_cache).flatten();
  if (b_in.numel() > 0) {
    auto sub = [&](const Tensor& t) { return t.index_select(0, b_in); };
    auto kc = sub(k_cache), vc = sub(v_cache);
    cache_write_at(kc, sub(k).unsqueeze(2), sub(pos));
    cache_write_at(vc, sub(cpu64(in.v)).unsqueeze(2), sub(pos));
    k_cache.index_copy_(0, b_in, kc);
    v_cache.index_copy_(0, b_in, vc);
  }
  return {q, k_cache, v_cache};
}

std::vector<Check> rope_cache_checks(const RopeCacheInputs& in, const Tensor& q_out, const RopeCacheExpected& e,
                                     torch::ScalarType dt) {
  // Rows not written are bit-identical copies, so the whole cache's error is that of the new rows.
  return {below("q", rel_err(q_out.cpu(), e.q), tolerance(dt)),
          below("k_cache", rel_err(in.k_cache.cpu(), e.k_cache), tolerance(dt)),
          below("v_cache", rel_err(in.v_cache.cpu(), e.v_cache), tolerance(dt))};
}

SparseInputs sparse_inputs(const SparseShape& c, torch::ScalarType dt) {
  SparseInputs in;
  auto k_buf = torch::randn({2 * c.B + 1, c.Hkv, c.L, c.Dk + 8}, gpu(dt));
  in.k = k_buf.slice(0, 1, 2 * c.B + 1, 2).narrow(3, 0, c.Dk);
  if (c.latent) {
    in.v = in.k.narrow(3, 0, c.Dv);
  } else {
    auto v_buf = torch::randn({2 * c.B + 1, c.Hkv, c.L, c.Dv + 8}, gpu(dt));
    in.v = v_buf.slice(0, 1, 2 * c.B + 1, 2).narrow(3, 0, c.Dv);
  }
  in.q = (torch::randn({c.B, c.Hq, c.Dk + 8}, gpu(f32)) * 2).to(dt).narrow(2, 0, c.Dk);
  std::tie(in.indices, in.counts) = random_selection(c.B, c.L, c.n);
  in.scale = 1.0 / std::sqrt(static_cast<double>(c.Dk));
  return in;
}

std::pair<Tensor, Tensor> random_selection(int64_t B, int64_t L, int64_t n) {
  auto counts = torch::randint(1, n + 1, {B}, torch::kInt64);
  counts[0] = 1;
  if (B > 1) counts[B - 1] = n;
  std::vector<Tensor> rows;
  for (int64_t b = 0; b < B; ++b) rows.push_back(torch::randperm(L, torch::kInt64).narrow(0, 0, n));
  return {torch::stack(rows).cuda(), counts.cuda()};
}

Tensor sparse_reference64(const SparseInputs& in, const Tensor& absorb, const Tensor& gate) {
  auto to64 = [](const Tensor& t) { return t.defined() ? t.to(f64) : t; };
  return ops::sparse_attention_decode_reference(in.q.to(f64), in.k.to(f64), in.v.to(f64), in.indices, in.counts,
                                                in.scale, to64(absorb), to64(gate));
}

Tensor index_lengths(int64_t B, int64_t L) {
  auto lens = torch::randint(1, L + 1, {B}, torch::kInt64);
  if (B > 1) lens[0] = 1;
  lens[B - 1] = L;
  return lens.cuda();
}

IndexInputs index_inputs(int64_t B, int64_t H, int64_t D, int64_t L, torch::ScalarType dt, bool strided,
                         bool poisoned) {
  IndexInputs in;
  in.lens = poisoned ? index_lengths(B, L) : torch::full({B}, L, gpu(torch::kInt64));
  in.q = strided ? torch::randn({B, H, D + 16}, gpu(dt)).narrow(2, 0, D) : torch::randn({B, H, D}, gpu(dt));
  in.w = torch::randn({B, H}, gpu(f32)) / std::sqrt(static_cast<double>(H * D));  // mixed signs
  auto keys = strided ? torch::randn({B, L + 5, 2 * D}, gpu(dt)).narrow(1, 2, L).narrow(2, 0, D)
                      : torch::randn({B, L, D}, gpu(dt));
  if (poisoned) keys.masked_fill_(~valid_mask(in.lens, L).unsqueeze(2), std::nan(""));
  in.keys = keys;
  return in;
}

PrepShape dsa_1p3b_prep_shape() { return {8, 16, 128, 512, 64, 64, 128, 64, 300, RopeStyle::Interleaved, 10000.0, 100}; }

Tensor random_positions(int64_t B, int64_t L) {
  auto pos = torch::randperm(L, torch::kInt64).narrow(0, 0, B).clone();
  pos[0] = L - 1;
  return pos.cuda();
}

ops::DsaLatentPrepArgs prep_inputs(const PrepShape& s, torch::ScalarType dt) {
  const int64_t nq = s.H * (s.D + s.dr), nkv = s.dc + s.dr, niq = s.HI * s.dI;
  const auto proj = torch::randn({s.B, nq + nkv + niq + s.dI + s.HI + 8}, gpu(dt));
  ops::DsaLatentPrepArgs a;
  a.q_raw = proj.narrow(1, 0, nq).view({s.B, s.H, s.D + s.dr});
  a.kv_raw = proj.narrow(1, nq, nkv);
  a.index_q_raw = proj.narrow(1, nq + nkv, niq).view({s.B, s.HI, s.dI});
  a.index_k_raw = proj.narrow(1, nq + nkv + niq, s.dI);
  a.index_w_raw = proj.narrow(1, nq + nkv + niq + s.dI, s.HI);
  a.seq_pos = random_positions(s.B, s.L);
  a.kv_norm_weight = 1 + 0.2 * torch::randn({s.dc}, gpu(dt));
  a.index_norm_weight = 1 + 0.2 * torch::randn({s.dI}, gpu(dt));
  a.index_norm_bias = 0.2 * torch::randn({s.dI}, gpu(dt));
  a.kv_norm_eps = 1e-6, a.index_norm_eps = 1e-6;
  a.rope_theta = s.theta, a.rope_style = s.style, a.index_rope_dim = s.r;
  a.index_weight_scale = 1.0 / std::sqrt(static_cast<double>(s.HI * s.dI)), a.topk = s.topk;
  a.seq_lens = torch::full({s.B}, -1, gpu(torch::kInt64)), a.counts = torch::full({s.B}, -1, gpu(torch::kInt64));
  a.q = torch::full({s.B, s.H, s.dc + s.dr}, std::nan(""), gpu(dt));
  a.index_q = torch::full({s.B, s.HI, s.dI}, std::nan(""), gpu(dt));
  a.index_w = torch::full({s.B, s.HI}, std::nan(""), gpu(f32));
  a.k_cache = torch::randn({s.B, 1, s.L + 3, s.dc + s.dr + 8}, gpu(dt)).narrow(2, 1, s.L).narrow(3, 0, s.dc + s.dr);
  a.index_keys = torch::randn({s.B, s.L + 2, s.dI + 8}, gpu(dt)).narrow(1, 2, s.L).narrow(2, 0, s.dI);
  return a;
}

ops::DsaLatentPrepArgs with_output_copies(ops::DsaLatentPrepArgs a) {
  a.q = a.q.clone(), a.index_q = a.index_q.clone(), a.index_w = a.index_w.clone();
  a.seq_lens = a.seq_lens.clone(), a.counts = a.counts.clone();
  a.k_cache = a.k_cache.clone(), a.index_keys = a.index_keys.clone();
  return a;
}

std::vector<Check> prep_checks(const ops::DsaLatentPrepArgs& got, const ops::DsaLatentPrepArgs& want, double tol) {
  const int64_t dc = got.kv_norm_weight.size(0), dr = got.q.size(2) - dc, B = got.q.size(0);
  std::vector<Check> out{below("q", rel_err(got.q.narrow(-1, dc, dr).cpu(), want.q.narrow(-1, dc, dr).cpu()), tol)};
  if (got.absorb.defined())
    out.push_back(below("q's latent part", rel_err(got.q.narrow(-1, 0, dc).cpu(), want.q.narrow(-1, 0, dc).cpu()), tol));
  else
    out.push_back(holds("q's latent part unwritten", torch::isnan(got.q.narrow(-1, 0, dc)).all().item<bool>()));
  out.push_back(below("index_q", rel_err(got.index_q.cpu(), want.index_q.cpu()), tol));
  out.push_back(below("index_w", rel_err(got.index_w.cpu(), want.index_w.cpu()), tol));
  out.push_back(same("seq_lens", got.seq_lens.cpu(), want.seq_lens.cpu()));
  out.push_back(same("counts", got.counts.cpu(), want.counts.cpu()));
  auto k_got = cpu64(got.k_cache).clone(), k_want = cpu64(want.k_cache).clone();
  auto i_got = cpu64(got.index_keys).clone(), i_want = cpu64(want.index_keys).clone();
  const auto pos = got.seq_pos.cpu();
  std::vector<Tensor> k_rows_got, k_rows_want, i_rows_got, i_rows_want;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = pos[b].item<int64_t>();
    k_rows_got.push_back(k_got[b][0][t].clone()), k_rows_want.push_back(k_want[b][0][t].clone());
    i_rows_got.push_back(i_got[b][t].clone()), i_rows_want.push_back(i_want[b][t].clone());
    k_got[b][0][t].zero_(), k_want[b][0][t].zero_(), i_got[b][t].zero_(), i_want[b][t].zero_();
  }
  out.push_back(below("latent key rows", rel_err(torch::stack(k_rows_got), torch::stack(k_rows_want)), tol));
  out.push_back(below("index key rows", rel_err(torch::stack(i_rows_got), torch::stack(i_rows_want)), tol));
  out.push_back(same("the latent cache rows off the positions", k_got, k_want));
  out.push_back(same("the index cache rows off the positions", i_got, i_want));
  return out;
}

BlockTail::BlockTail(int64_t M, int64_t d, int64_t k, int64_t ffn, bool gated, torch::ScalarType dt, bool silu_epilogue)
    : epilogue(silu_epilogue) {
  y = torch::randn({M, k}, gpu(dt));
  if (gated) gate = torch::randn({M, k}, gpu(dt)) * 2;
  residual = torch::randn({M, d}, gpu(dt));
  wo = torch::randn({d, k}, gpu(dt)) / std::sqrt(static_cast<double>(k));
  norm_weight = 1 + 0.3 * torch::randn({d}, gpu(dt));
  w13 = torch::randn({2 * ffn, d}, gpu(dt)) / std::sqrt(static_cast<double>(d));
  w2 = torch::randn({d, ffn}, gpu(dt)) / std::sqrt(static_cast<double>(ffn));
}

std::vector<ops::ChainProduct> BlockTail::products() const {
  ops::ChainProduct projection{wo}, gate_up{w13}, down{w2};
  projection.fusion.x_gate = gate, projection.fusion.residual = residual;
  gate_up.fusion.norm_weight = norm_weight, gate_up.fusion.norm_eps = eps;
  gate_up.silu_mul_out = epilogue;
  down.fusion.silu_mul = !epilogue, down.residual_of = 0;
  return {projection, gate_up, down};
}

std::vector<Tensor> BlockTail::unchained() const {
  const auto p = products();
  ops::GemvFusion down = p[2].fusion;
  auto h = ops::gemv_fused(y, wo, p[0].fusion);
  auto gu = ops::gemv_fused(h, w13, p[1].fusion);
  if (epilogue) gu = ops::silu_mul_fused(gu);
  down.residual = h;
  return {h, gu, ops::gemv_fused(gu, w2, down)};
}

std::vector<Tensor> BlockTail::reference(const std::vector<Tensor>& got) const {
  auto in = cpu64(y);
  if (gate.defined()) in = in * torch::sigmoid(cpu64(gate));
  auto h = cpu64(residual) + torch::matmul(in, cpu64(wo).t());
  auto h_in = cpu64(got[0]);
  auto normed = h_in * torch::rsqrt(h_in.pow(2).mean(-1, true) + eps) * cpu64(norm_weight);
  auto gu = torch::matmul(normed, cpu64(w13).t());
  const int64_t F = w2.size(1);
  auto silu_mul = [F](const Tensor& t) {
    auto a = t.narrow(-1, 0, F), b = t.narrow(-1, F, F);
    return a * torch::sigmoid(a) * b;
  };
  if (epilogue) gu = silu_mul(gu);
  auto down_in = epilogue ? cpu64(got[1]) : silu_mul(cpu64(got[1]));
  auto out = h_in + torch::matmul(down_in, cpu64(w2).t());
  return {h, gu, out};
}

// ---------------------------------------------------------------------------------------------

CaseGrid test_grid() {
  CaseGrid g;
  g.model = load_model_config("lt2-full-gdn-1.3b");
  g.dtypes = {torch::kFloat32, torch::kBFloat16};
  g.batches = {1, 8};
  g.contexts = {4096, 32768};
  return g;
}

std::vector<KernelCase> kernel_cases(const CaseGrid& grid) {
  Table t;
  add_fixed_cases(t);
  add_model_cases(t, grid);
  // Table order: grouped by op, in kernel_ops() order, fixed cases before the model's.
  std::stable_sort(t.cases.begin(), t.cases.end(), [](const KernelCase& a, const KernelCase& b) {
    const auto& ops = kernel_ops();
    return std::find(ops.begin(), ops.end(), a.op) < std::find(ops.begin(), ops.end(), b.op);
  });
  return t.cases;
}

const std::vector<std::string>& kernel_ops() {
  static const std::vector<std::string> ops{
      "recurrent_step", "gdn_decode", "gdn_decode_registers", "gdn_decode_per_head", "gdn_decode_cluster",
      "attention_decode", "rope_cache_write", "sparse_attention_decode", "dsa_index_scores", "topk_select",
      "dsa_index_topk", "dsa_latent_prep", "rms_norm", "add_rms_norm", "silu_mul", "gemv", "gemv_chain",
      "gemv_batched"};
  return ops;
}

}  // namespace lt2::kernel_cases
