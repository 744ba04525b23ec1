// GPU (CTest label `gpu`): the recurrent and attention decode kernels beyond their kernel-case
// rows (tests/gpu/kernel_cases_test.cpp): the GDN mixer's step with the fused path on == off (fp32,
// and bf16 as close to float64 as the reference path); attention replayed from a CUDA graph with
// new lengths == eager; the GDN step in each form captured and replayed, and back to back in one
// graph, == eager. Skips where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <cmath>
#include <vector>

#include "common/testing.h"
#include "lt2/mixers/gdn.h"
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/ops/attention/decode.h"
#include "lt2/ops/delta_rule/decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;
using lt2::kernel_cases::attention_reference;
using lt2::kernel_cases::random_lengths;

// ---------------------------------------------------------------------------------------------
// The GDN mixer's step: fused path on == off.

namespace {

const auto f64 = torch::kFloat64;

ModelConfig gdn_config(const json& gdn_options) {
  auto cfg = lt2::testing::tiny_config("gdn");
  cfg.d_model = 64;
  cfg.n_heads = 2;  // head_dim 0.75 * 64 / 2 = 24, V = 48: neither a multiple of 32
  cfg.mixer_options = json{{"gdn", gdn_options}};
  return cfg;
}

std::shared_ptr<GatedDeltaNetImpl> make_gdn(const ModelConfig& cfg, torch::ScalarType dt) {
  torch::manual_seed(21);
  auto m = std::make_shared<GatedDeltaNetImpl>(cfg);
  torch::NoGradGuard ng;
  m->o_norm->weight.normal_(1.0, 0.2);  // ones at init: randomise so the gain is exercised
  m->to(torch::kCUDA, dt);
  return m;
}

// Prefills `pre` tokens of x ([B, T, d]) with forward, then steps the rest one token at a time
// with the fused kernels on or off. Returns the step outputs [B, T - pre, d] and the state.
std::pair<Tensor, std::unique_ptr<MixerState>> decode(GatedDeltaNetImpl& m, const Tensor& x, int64_t pre,
                                                      bool fused) {
  torch::NoGradGuard ng;
  const int64_t B = x.size(0), T = x.size(1);
  auto state = m.make_state(B, T, x.options());
  m.forward(x.narrow(1, 0, pre), Positions{0}, state.get());
  FusedDecode options(fused);
  std::vector<Tensor> ys;
  for (int64_t t = pre; t < T; ++t) ys.push_back(m.step(x.narrow(1, t, 1), Positions{t}, *state));
  return {torch::cat(ys, 1), std::move(state)};
}

}  // namespace

TEST(FusedDecode, GdnMixerStepFusedEqualsReference) {
  REQUIRE_FUSED_DECODE();
  // Default options; no output gate with beta in (0, 2); GVA (two value heads per q/k head): the
  // GDN kernel does not serve it, the generic recurrent kernel does.
  for (const json& opts : {json::object(), json{{"use_gate", false}, {"allow_neg_eigval", true}},
                           json{{"num_v_heads", 4}}}) {
    SCOPED_TRACE(opts.dump());
    auto m = make_gdn(gdn_config(opts), torch::kFloat32);
    auto x = torch::randn({3, 9, 64}, gpu(torch::kFloat32));
    auto [y_fused, st_fused] = decode(*m, x, 3, true);
    auto [y_ref, st_ref] = decode(*m, x, 3, false);
    EXPECT_LT(rel_err(y_fused, y_ref), 1e-5);
    auto& a = dynamic_cast<RecurrentState&>(*st_fused);
    auto& b = dynamic_cast<RecurrentState&>(*st_ref);
    EXPECT_LT(rel_err(a.S, b.S), 1e-5);
    // The windows hold the raw projections: the fused path computes them with the decode GEMV,
    // the reference with at::linear, so they agree to fp32 rounding, not bit for bit.
    for (size_t i = 0; i < a.conv.size(); ++i) EXPECT_LT(rel_err(a.conv[i], b.conv[i]), 1e-6) << "window " << i;
    EXPECT_EQ(a.length, b.length);
  }
}

// bf16: the fused step is at least as close to a float64 copy of the module (same bf16-rounded
// weights) as the bf16 reference step, and within 5e-3.
TEST(FusedDecode, GdnMixerStepBf16) {
  REQUIRE_FUSED_DECODE();
  auto cfg = gdn_config(json::object());
  auto m = make_gdn(cfg, torch::kBFloat16);
  auto m64 = make_gdn(cfg, torch::kBFloat16);
  m64->to(f64);
  auto x = torch::randn({3, 9, 64}, gpu(torch::kBFloat16));
  auto y_fused = decode(*m, x, 3, true).first;
  auto y_ref = decode(*m, x, 3, false).first;
  auto y64 = decode(*m64, x.to(f64), 3, false).first;
  const double fused_err = rel_err(y_fused, y64), ref_err = rel_err(y_ref, y64);
  EXPECT_LT(fused_err, std::max(2 * ref_err, 5e-3)) << "bf16 reference path error " << ref_err;
  EXPECT_LT(fused_err, 5e-3) << "bf16 reference path error " << ref_err;
}

#ifdef LT2_WITH_CUDA

// Captured once, replayed with new lengths and queries: equals the eager call.
TEST(FusedDecode, AttentionGraphReplayWithNewLengths) {
  REQUIRE_FUSED_DECODE();
  const int64_t B = 4, Hq = 8, Hkv = 2, D = 128, L = 1000;
  torch::manual_seed(5);
  auto lens = random_lengths(B, L);
  auto k = torch::randn({B, Hkv, L, D}, gpu(torch::kBFloat16));
  auto v = torch::randn({B, Hkv, L, D}, gpu(torch::kBFloat16));
  auto q = torch::randn({B, Hq, D}, gpu(torch::kBFloat16));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // Warm-up, capture, replays and eager calls all on one side stream (capture needs a non-default one).
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  ops::attention_decode_fused(q, k, v, lens, scale);
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto out = ops::attention_decode_fused(q, k, v, lens, scale);
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    lens.copy_(random_lengths(B, L).flip(0));  // new lengths, the full-cache one first
    q.copy_(torch::randn({B, Hq, D}, gpu(torch::kBFloat16)));
    graph.replay();
    auto eager = ops::attention_decode_fused(q, k, v, lens, scale);
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(out, eager)) << "replay " << replay;
    EXPECT_LT(rel_err(out, attention_reference(q, k, v, lens, scale)), 5e-3) << "replay " << replay;
  }
}

// The GDN mixer's fused step captured once and replayed: equals stepping a twin eagerly.
TEST(FusedDecode, GdnStepGraphReplay) {
  REQUIRE_FUSED_DECODE();
  auto cfg = gdn_config(json::object());
  auto m = make_gdn(cfg, torch::kBFloat16);
  torch::NoGradGuard ng;
  const int64_t B = 4;
  auto x = torch::randn({B, 1, 64}, gpu(torch::kBFloat16));
  auto graph_state = m->make_state(B, 16, x.options());
  auto eager_state = m->make_state(B, 16, x.options());
  auto graph_tensors = graph_state->tensors(), eager_tensors = eager_state->tensors();
  for (size_t i = 0; i < eager_tensors.size(); ++i) {
    eager_tensors[i].copy_(torch::randn_like(eager_tensors[i], torch::kFloat32) * 0.1);
    graph_tensors[i].copy_(eager_tensors[i]);
  }
  Positions pos;
  pos.seq_pos = torch::zeros({B}, gpu(torch::kInt64));  // per-sequence positions: no length bookkeeping

  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  m->step(x, pos, *eager_state);  // warm-up, applied to both states
  m->step(x, pos, *graph_state);
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto y = m->step(x, pos, *graph_state);
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    x.copy_(torch::randn_like(x));
    graph.replay();
    auto y_eager = m->step(x, pos, *eager_state);
    torch::cuda::synchronize();
    EXPECT_LT(rel_err(y, y_eager), 1e-6) << "replay " << replay;
    for (size_t i = 0; i < eager_tensors.size(); ++i)
      EXPECT_LT(rel_err(graph_tensors[i], eager_tensors[i]), 1e-6) << "state tensor " << i << ", replay " << replay;
  }
}

namespace {

// The forms of gdn_decode this device runs at head dims (K, V).
std::vector<kernels::GdnDecodeForm> gdn_forms(int64_t K, int64_t V) {
  std::vector<kernels::GdnDecodeForm> forms{kernels::GdnDecodeForm::PerHead};
  if (kernels::gdn_decode_registers_supported(static_cast<int>(K), static_cast<int>(V)))
    forms.push_back(kernels::GdnDecodeForm::Registers);
  if (kernels::gdn_decode_cluster_supported(static_cast<int>(K), static_cast<int>(V), c10::cuda::current_device()))
    forms.push_back(kernels::GdnDecodeForm::Cluster);
  return forms;
}

const char* form_name(kernels::GdnDecodeForm form) {
  switch (form) {
    case kernels::GdnDecodeForm::Registers: return "registers";
    case kernels::GdnDecodeForm::PerHead: return "per-head";
    case kernels::GdnDecodeForm::Cluster: return "cluster";
    case kernels::GdnDecodeForm::Auto: break;
  }
  return "auto";
}

// bf16 weights of a GDN step of H heads (head dims K, V; conv width W) in `form`, for the graph
// tests; the inputs are the caller's.
ops::GdnDecodeArgs bf16_gdn_weights(int64_t H, int64_t K, int64_t V, int64_t W, kernels::GdnDecodeForm form) {
  const auto bf16 = gpu(torch::kBFloat16);
  ops::GdnDecodeArgs a;
  a.q_conv_weight = torch::randn({H * K, 1, W}, bf16) * 0.5;
  a.k_conv_weight = torch::randn({H * K, 1, W}, bf16) * 0.5;
  a.v_conv_weight = torch::randn({H * V, 1, W}, bf16) * 0.5;
  a.A_log = log_uniform_A_init(H, 1.0, 16.0).to(bf16);
  a.dt_bias = inverse_softplus_dt_init(H).to(bf16);
  a.norm_weight = 1 + 0.2 * torch::randn({V}, bf16);
  a.num_heads = H, a.head_k_dim = K, a.head_v_dim = V;
  a.scale = 1.0 / std::sqrt(static_cast<double>(K));
  a.form = form;
  return a;
}

// A random GDN state (fp32) and its three bf16 conv windows: {S, q, k, v windows}.
std::vector<Tensor> random_gdn_state(int64_t B, int64_t H, int64_t K, int64_t V, int64_t W) {
  const auto bf16 = gpu(torch::kBFloat16);
  return {torch::randn({B, H, K, V}, gpu(torch::kFloat32)) * 0.1, torch::randn({B, W - 1, H * K}, bf16),
          torch::randn({B, W - 1, H * K}, bf16), torch::randn({B, W - 1, H * V}, bf16)};
}

}  // namespace

// gdn_decode_fused in each form captured once and replayed with new inputs: equals the eager
// call on a twin state and windows, bit for bit (same kernel, same inputs).
TEST(FusedDecode, GdnKernelGraphReplay) {
  REQUIRE_FUSED_DECODE();
  const int64_t B = 2, H = 3, K = 96, V = 192, W = 4;  // the 1.3B head, 6 column tiles in a cluster
  for (auto form : gdn_forms(K, V)) {
    SCOPED_TRACE(form_name(form));
    torch::manual_seed(7);
    const auto bf16 = gpu(torch::kBFloat16);
    auto a = bf16_gdn_weights(H, K, V, W, form);
    a.q = torch::randn({B, H * K}, bf16), a.k = torch::randn({B, H * K}, bf16);
    a.v = torch::randn({B, H * V}, bf16), a.gate = torch::randn({B, H * V}, bf16);
    a.a = torch::randn({B, H}, bf16), a.b = torch::randn({B, H}, bf16);
    auto graph_st = random_gdn_state(B, H, K, V, W);
    std::vector<Tensor> eager_st;
    for (const auto& t : graph_st) eager_st.push_back(t.clone());
    auto call = [&](std::vector<Tensor>& st) { return ops::gdn_decode_fused(a, st[0], st[1], st[2], st[3]); };

    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    call(graph_st);  // warm-up (kernel attributes), applied to both
    call(eager_st);
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    auto y = call(graph_st);
    graph.capture_end();
    for (int replay = 0; replay < 3; ++replay) {
      for (Tensor* t : {&a.q, &a.k, &a.v, &a.gate, &a.a, &a.b}) t->copy_(torch::randn_like(*t));
      graph.replay();
      auto y_eager = call(eager_st);
      torch::cuda::synchronize();
      EXPECT_TRUE(torch::equal(y, y_eager)) << "replay " << replay;
      for (size_t i = 0; i < eager_st.size(); ++i)
        EXPECT_TRUE(torch::equal(graph_st[i], eager_st[i])) << "state tensor " << i << ", replay " << replay;
    }
  }
}

// Steps launched back to back (each kernel a programmatic dependent of the step before it on
// the same state and windows, in one graph) equal the same steps with the host waiting between
// them, bit for bit: no step reads the state before the step before it has finished writing it.
// With state_settled (the register form loads S before its wait) each step follows a copy of its
// inputs, as it follows the input projection in the layer.
TEST(FusedDecode, GdnStepsBackToBackInAGraph) {
  REQUIRE_FUSED_DECODE();
  const int64_t B = 8, H = 16, K = 96, V = 192, W = 4, steps = 6;  // the 1.3B layer at batch 8
  for (bool settled : {false, true})
  for (auto form : gdn_forms(K, V)) {
    SCOPED_TRACE(::testing::Message() << form_name(form) << (settled ? " state_settled" : ""));
    torch::manual_seed(11);
    const auto bf16 = gpu(torch::kBFloat16);
    auto a = bf16_gdn_weights(H, K, V, W, form);
    a.state_settled = settled;
    // Every step's inputs, made before the graph so that nothing runs between its kernels but
    // the copies of the settled case.
    std::vector<ops::GdnDecodeArgs> inputs(steps, a);
    std::vector<Tensor> sources;
    for (auto& in : inputs) {
      in.q = torch::randn({B, H * K}, bf16), in.k = torch::randn({B, H * K}, bf16);
      in.v = torch::randn({B, H * V}, bf16), in.gate = torch::randn({B, H * V}, bf16);
      in.a = torch::randn({B, H}, bf16), in.b = torch::randn({B, H}, bf16);
      sources.push_back(in.q.clone());
    }
    auto graph_st = random_gdn_state(B, H, K, V, W);
    std::vector<Tensor> waited_st;
    for (const auto& t : graph_st) waited_st.push_back(t.clone());
    std::vector<Tensor> waited_y;
    for (const auto& in : inputs) {
      waited_y.push_back(ops::gdn_decode_fused(in, waited_st[0], waited_st[1], waited_st[2], waited_st[3]));
      torch::cuda::synchronize();
    }

    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    std::vector<Tensor> graph_y;
    for (int64_t i = 0; i < steps; ++i) {
      if (settled) inputs[i].q.copy_(sources[i]);
      graph_y.push_back(ops::gdn_decode_fused(inputs[i], graph_st[0], graph_st[1], graph_st[2], graph_st[3]));
    }
    graph.capture_end();
    graph.replay();
    torch::cuda::synchronize();
    for (int64_t i = 0; i < steps; ++i) EXPECT_TRUE(torch::equal(graph_y[i], waited_y[i])) << "step " << i;
    for (size_t i = 0; i < graph_st.size(); ++i)
      EXPECT_TRUE(torch::equal(graph_st[i], waited_st[i])) << "state tensor " << i;
  }
}

#endif  // LT2_WITH_CUDA
