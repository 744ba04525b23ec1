// The mixer contract's invariants (docs/architecture.md, "The mixer contract"), run over every
// registered mixer and its option variants (mixer_testing.h): registering a mixer is enough to put
// it under this suite. Float64 on the CPU, tiny shapes:
//   - the parallel (chunked) forward == the one-token recurrence `step`, token by token from an
//     empty state (for the linear mixers this is chunked form == naive recurrence);
//   - split prefill: forward(x[:a]) + forward(x[a:], state) (+ a decode step) == forward(x), with
//     splits inside and on the boundary of chunks;
//   - gradients of the reference path (x and every parameter the forward trains) match central
//     finite differences;
//   - capabilities agree with what the mixer does (kind, aux loss, per-loop states);
//   - model invariant: a tiny LoopedLM of that mixer decodes token by token to the logits of one
//     forward, and a split prefill gives the whole one's;
//   - engine invariant: mixed-length batches in the Engine decode like each sequence alone
//     (mixers with per-sequence positions);
//   - the memory plan counts exactly the state and weight bytes the model allocates;
//   - packed documents (Positions::documents): a packed row's outputs and gradients (input and
//     every parameter) equal each document run alone, through the mixer's own path or the
//     per-document fallback (mixers/documents.h), and through a tiny LoopedLM of that mixer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "common/engine_testing.h"
#include "common/testing.h"
#include "lt2/infer/memory_plan.h"
#include "lt2/mixers/documents.h"
#include "lt2/mixers/registry.h"
#include "mixers/mixer_testing.h"
#include "ops/numeric_check.h"

namespace {

using namespace lt2;
using lt2::testing::MixerVariant;
using lt2::testing::f64;
using lt2::testing::rel_err;
using lt2::testing::variant_config;

torch::Tensor random_f64_x(int64_t B, int64_t T, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return torch::randn({B, T, 32}, f64());
}

// The mixer of layer 0 in float64, its zero-initialised gates (SDPA output gate, NSA's position
// terms) given random values so every path counts.
Mixer make_variant_f64(const MixerVariant& v) {
  torch::manual_seed(0);
  auto m = make_mixer(v.name, variant_config(v), 0);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())
    if (p.key().find("wgate") != std::string::npos || p.key().find("pos_") != std::string::npos)
      p.value().normal_(0, 0.3);
  return m;
}

// The loops to test: every loop of the tiny model for mixers with per-loop settings, else loop 0.
std::vector<int64_t> loops_of(const MixerImpl& m) {
  if (!m.caps().per_loop) return {0};
  std::vector<int64_t> loops(lt2::testing::tiny_config().n_loops);
  for (size_t i = 0; i < loops.size(); ++i) loops[i] = static_cast<int64_t>(i);
  return loops;
}

class MixerInvariants : public ::testing::TestWithParam<MixerVariant> {
 protected:
  // Tiny shapes: one intra-op thread (OpenMP's spinning threads slow tiny ops down under ctest -j).
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(MixerInvariants, ForwardEqualsStepByStep) {
  auto m = make_variant_f64(GetParam());
  torch::NoGradGuard ng;
  const int64_t B = 2, T = 11;
  auto x = random_f64_x(B, T);
  for (int64_t loop : loops_of(*m)) {
    auto whole = m->forward(x, {0, loop});
    auto state = m->make_state(B, T + 3, f64(), {loop});
    std::vector<torch::Tensor> ys;
    for (int64_t t = 0; t < T; ++t) ys.push_back(m->step(x.narrow(1, t, 1), {t, loop}, *state));
    EXPECT_LT(rel_err(torch::cat(ys, 1), whole), 1e-10) << "loop " << loop;
    EXPECT_EQ(state->length, T) << "loop " << loop;
  }
}

TEST_P(MixerInvariants, SplitPrefillEqualsWhole) {
  auto m = make_variant_f64(GetParam());
  torch::NoGradGuard ng;
  const int64_t B = 2, T = 12;
  auto x = random_f64_x(B, T, 2);
  for (int64_t loop : loops_of(*m)) {
    auto whole = m->forward(x, {0, loop});
    auto state = m->make_state(B, T + 2, f64(), {loop});
    for (int64_t a : {1, 3, 4, 6, 9}) {  // chunks of 4: inside a chunk and on its boundary
      state->reset();
      auto first = m->forward(x.narrow(1, 0, a), {0, loop}, state.get());
      auto second = m->forward(x.narrow(1, a, T - 1 - a), {a, loop}, state.get());
      auto last = m->step(x.narrow(1, T - 1, 1), {T - 1, loop}, *state);  // decode after the prefill
      EXPECT_LT(rel_err(torch::cat({first, second, last}, 1), whole), 1e-10) << "loop " << loop << " split " << a;
    }
  }
}

TEST_P(MixerInvariants, InputGradientsMatchFiniteDifferences) {
  auto m = make_variant_f64(GetParam());
  for (int64_t loop : loops_of(*m)) {
    SCOPED_TRACE("loop " + std::to_string(loop));
    lt2::testing::expect_gradients_match(
        [&](const std::vector<torch::Tensor>& xs) { return m->forward(xs[0], {0, loop}); }, {random_f64_x(1, 9, 3)});
  }
}

TEST_P(MixerInvariants, ParameterGradientsMatchFiniteDifferences) {
  auto m = make_variant_f64(GetParam());
  // Parameters an auxiliary loss trains get no gradient from the forward (by design), so they are
  // left out; every other parameter is checked.
  std::set<const void*> aux;
  if (auto* a = m->aux_loss())
    for (auto& p : a->parameters()) aux.insert(p.unsafeGetTensorImpl());
  std::vector<torch::Tensor> params;
  for (auto& p : m->parameters())
    if (!aux.count(p.unsafeGetTensorImpl())) params.push_back(p);
  auto x = random_f64_x(1, 9, 4);
  torch::manual_seed(5);
  auto R = torch::randn({1, 9, 32}, f64());
  for (int64_t loop : loops_of(*m)) {
    auto loss = [&] { return (m->forward(x, {0, loop}) * R).sum(); };
    // eps 1e-7: the random direction spans every parameter (|d| ~ 100), so the central
    // difference's O(eps^2) truncation error is large at eps 1e-6 for RetNet (q, k, v enter
    // trilinearly, no q/k norm): measured, the error falls exactly 100x per 10x smaller eps down to
    // 1e-7, where every mixer is below 1.1e-7.
    EXPECT_LT(lt2::testing::gradcheck_directional(loss, params, 3, /*eps=*/1e-7), 1e-6) << "loop " << loop;
  }
}

TEST_P(MixerInvariants, CapabilitiesMatchTheMixer) {
  auto m = make_variant_f64(GetParam());
  EXPECT_EQ(m->kind(), GetParam().name);
  EXPECT_EQ(m->caps().aux_loss, m->aux_loss() != nullptr);
  EXPECT_GE(m->prefill_workspace_bytes(1, 8, 16), 0);
  for (int64_t loop : loops_of(*m)) {
    auto state = m->make_state(2, 16, f64(), {loop});
    EXPECT_GT(state->bytes(), 0);
    EXPECT_EQ(state->length, 0);
    auto half = state->slice(1, 1);
    EXPECT_EQ(half->length, 0);
  }
  if (auto* aux = m->aux_loss()) {
    // Stage Off records nothing; a recording stage records one loss per parallel forward.
    torch::NoGradGuard ng;
    m->forward(random_f64_x(1, 6), {0, 0});
    EXPECT_TRUE(aux->take().empty());
    aux->set_stage(AuxLossStage::Joint);
    m->forward(random_f64_x(1, 6), {0, 0});
    EXPECT_EQ(aux->take().size(), 1u);
    EXPECT_TRUE(aux->take().empty());
    aux->set_stage(AuxLossStage::Off);
    EXPECT_FALSE(aux->parameters().empty());
  }
}

// MixerCaps::input_feeds_products: the mixer reads x only through linear layers, and x's gradient
// comes from one of them, so under bf16 autocast (where each linear rounds its input to bf16) it
// gives the same output and the same gradient from x as from x rounded to bf16 beforehand, the form
// the block hands it (ops::rms_norm_for_products): several products would sum x's gradient in bf16
// instead of fp32. fp32 weights, CPU autocast; a recording aux-loss stage must agree too.
TEST_P(MixerInvariants, InputFeedsProductsMeansOneProductReadsTheInput) {
  torch::manual_seed(0);
  auto m = make_mixer(GetParam().name, variant_config(GetParam()), 0);
  if (!m->caps().input_feeds_products) GTEST_SKIP() << "not claimed";
  {
    torch::NoGradGuard ng;
    for (auto& p : m->named_parameters())
      if (p.key().find("wgate") != std::string::npos || p.key().find("pos_") != std::string::npos)
        p.value().normal_(0, 0.3);
  }
  torch::manual_seed(3);
  const auto x = torch::randn({2, 9, 32}), dy = torch::randn({2, 9, 32});
  auto* aux = m->aux_loss();
  if (aux) aux->set_stage(AuxLossStage::Joint);
  // The output, the recorded aux losses, then x's gradient through the output, all in fp32. x is not
  // a leaf, as the block's norm output is not (autocast casts a leaf once for all its uses).
  auto run = [&](const torch::Tensor& input) {
    const auto leaf = input.detach().requires_grad_(true);
    const auto in = leaf * 1;
    std::vector<torch::Tensor> out;
    {
      lt2::testing::CpuAutocast autocast;
      const auto y = m->forward(in, {0, 0});
      out.push_back(y.detach().to(torch::kFloat32));
      if (aux)
        for (const auto& l : aux->take()) out.push_back(l.detach().to(torch::kFloat32));
      y.backward(dy.to(y.scalar_type()));
    }
    out.push_back(leaf.grad().to(torch::kFloat32));
    return out;
  };
  const auto from_fp32 = run(x), from_bf16 = run(x.to(torch::kBFloat16));
  ASSERT_EQ(from_fp32.size(), from_bf16.size());
  for (size_t i = 0; i < from_fp32.size(); ++i)
    EXPECT_TRUE(torch::equal(from_fp32[i], from_bf16[i]))
        << (i == 0 ? "output" : i + 1 == from_fp32.size() ? "x's gradient" : "aux loss") << " differs";
}

TEST_P(MixerInvariants, ModelDecodeEqualsForward) {
  auto cfg = variant_config(GetParam());
  auto m = lt2::testing::make_test_model(cfg, 11);
  lt2::testing::expect_decode_matches_forward(*m, lt2::testing::random_tokens(2, 9, cfg.vocab_size, 3));
  lt2::testing::expect_split_prefill_matches_whole(*m, lt2::testing::random_tokens(2, 11, cfg.vocab_size, 4),
                                                   {3, 6});
}

TEST_P(MixerInvariants, EngineMatchesPerSequenceForward) {
  auto cfg = variant_config(GetParam());
  auto m = lt2::testing::make_test_model(cfg, 11);
  if (!m->mixers()[0]->caps().seq_pos) GTEST_SKIP() << GetParam().label << " has no per-sequence positions";
  EngineOptions eo;
  eo.max_batch = 3;
  eo.max_len = 16;
  eo.prefill_chunk = 3;
  lt2::testing::expect_engine_matches_per_sequence(m, eo, {2, 7, 5}, 4, 1e-10);
}

TEST_P(MixerInvariants, MemoryPlanCountsWhatIsAllocated) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(torch::toString(dtype));
    auto m = lt2::testing::make_test_model(variant_config(GetParam()), 1, dtype);
    const int64_t batch = 3, max_len = 17;
    auto plan = plan_memory(*m, batch, max_len, dtype, 8, 5);
    auto state = m->make_state(batch, max_len, torch::TensorOptions().dtype(dtype));
    int64_t allocated = 0;
    for (const auto& s : state->mixers)
      for (const auto& t : s->tensors()) allocated += t.nbytes();
    EXPECT_EQ(plan.state_bytes, allocated);
    int64_t weights = 0;
    for (const auto& p : m->parameters()) weights += p.nbytes();
    EXPECT_EQ(plan.weight_bytes, weights);
    EXPECT_GT(plan.workspace_bytes, 0);
  }
}

// Two rows of documents of lengths 1, chunk - 1, chunk, chunk + 1 and several chunks (the tiny
// chunk is 4), in two orders.
std::shared_ptr<const PackedDocuments> packed_rows() {
  return std::make_shared<PackedDocuments>(std::vector<std::vector<int64_t>>{{0, 1, 4, 8, 13}, {0, 9, 14, 18, 21}}, 22);
}

// Document d of row b of x [B, T, ...].
torch::Tensor document(const torch::Tensor& x, const PackedDocuments& docs, int64_t b, size_t d) {
  const auto& s = docs.starts[b];
  const int64_t end = d + 1 < s.size() ? s[d + 1] : docs.T;
  return x.narrow(0, b, 1).narrow(1, s[d], end - s[d]);
}

// Every document of `docs` through `alone`, put back in place: [B, T, ...].
torch::Tensor each_alone(const PackedDocuments& docs, const torch::Tensor& x,
                         const std::function<torch::Tensor(const torch::Tensor&)>& alone) {
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < docs.rows(); ++b) {
    std::vector<torch::Tensor> parts;
    for (size_t d = 0; d < docs.starts[b].size(); ++d) parts.push_back(alone(document(x, docs, b, d)));
    rows.push_back(torch::cat(parts, 1));
  }
  return torch::cat(rows, 0);
}

// Gradients of `loss` with respect to `leaves`, fresh.
std::vector<torch::Tensor> grads_of(const torch::Tensor& loss, const std::vector<torch::Tensor>& leaves) {
  return torch::autograd::grad({loss}, leaves, {}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
}

void expect_grads_equal(const std::vector<torch::Tensor>& packed, const std::vector<torch::Tensor>& alone,
                        const std::vector<std::string>& names) {
  ASSERT_EQ(packed.size(), alone.size());
  for (size_t i = 0; i < packed.size(); ++i) {
    ASSERT_EQ(packed[i].defined(), alone[i].defined()) << names[i];
    if (packed[i].defined()) {
      EXPECT_LT(rel_err(packed[i], alone[i]), 1e-10) << names[i];
    }
  }
}

TEST_P(MixerInvariants, PackedDocumentsEqualEachDocumentAlone) {
  auto m = make_variant_f64(GetParam());
  const auto docs = packed_rows();
  std::vector<torch::Tensor> leaves;
  std::vector<std::string> names{"x"};
  for (auto& p : m->named_parameters()) {
    leaves.push_back(p.value());
    names.push_back(p.key());
  }
  for (int64_t loop : loops_of(*m)) {
    SCOPED_TRACE("loop " + std::to_string(loop));
    auto x = random_f64_x(2, docs->T, 6 + loop).requires_grad_(true);
    torch::manual_seed(7);
    const auto R = torch::randn({2, docs->T, 32}, f64());
    Positions pos{0, loop};
    pos.documents = docs;
    const auto packed = mixer_forward(*m, x, pos);
    const auto alone = each_alone(*docs, x, [&](const torch::Tensor& xd) { return m->forward(xd, {0, loop}); });
    EXPECT_LT(rel_err(packed, alone), 1e-10);
    EXPECT_GT(rel_err(m->forward(x, {0, loop}), alone), 1e-6) << "the rows' documents do not interact: no test";
    auto with_x = leaves;
    with_x.insert(with_x.begin(), x);
    expect_grads_equal(grads_of((packed * R).sum(), with_x), grads_of((alone * R).sum(), with_x), names);
  }
}

TEST_P(MixerInvariants, ModelPackedDocumentsEqualEachDocumentAlone) {
  auto cfg = variant_config(GetParam());
  auto m = lt2::testing::make_test_model(cfg, 12);
  const auto docs = packed_rows();
  const auto tokens = lt2::testing::random_tokens(2, docs->T, cfg.vocab_size, 8);
  torch::manual_seed(9);
  const auto R = torch::randn({2, docs->T, cfg.vocab_size}, f64());
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (auto& p : m->named_parameters()) {
    params.push_back(p.value());
    names.push_back(p.key());
  }
  // The parameters' gradients by backward() (checkpointed loops accumulate them there).
  auto backward_grads = [&](const torch::Tensor& logits) {
    m->zero_grad();
    (logits * R).sum().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : params) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    return g;
  };
  const auto alone = each_alone(*docs, tokens.unsqueeze(-1), [&](const torch::Tensor& t) {
    return m->forward(t.squeeze(-1)).logits;
  });
  const auto alone_grads = backward_grads(alone);
  for (bool checkpoint : {false, true}) {
    SCOPED_TRACE(checkpoint ? "checkpointed loops" : "stored loops");
    ForwardOptions fo;
    fo.documents = docs;
    fo.checkpoint_loops = checkpoint;
    const auto packed = m->forward(tokens, nullptr, fo).logits;
    EXPECT_LT(rel_err(packed, alone), 1e-10);
    expect_grads_equal(backward_grads(packed), alone_grads, names);
  }
}

INSTANTIATE_TEST_SUITE_P(Registered, MixerInvariants, ::testing::ValuesIn(lt2::testing::mixer_variants()),
                         [](const auto& info) { return info.param.label; });

}  // namespace
