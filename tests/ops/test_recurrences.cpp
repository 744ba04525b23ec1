// The linear-recurrence ops (delta rule and gated linear families, each with no gate, a per-head
// gate and a per-channel gate): chunked == naive recurrence (float64, 1e-10), step == recurrence,
// split prefill == whole prefill, gradient check of the chunked form, lengths that are not a
// multiple of the chunk, strong decays and a 4k-token fp32 run; the chunk scan without W or Kt.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/gate_kind.h"
#include "lt2/ops/chunking.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "ops/numeric_check.h"

namespace {

using lt2::ops::RecurrenceResult;
using lt2::testing::expect_gradients_match;
using lt2::testing::Gate;
using lt2::testing::rel_err;
using torch::Tensor;

struct Family {
  bool delta;  // delta rule (with beta) or additive gated linear
  Gate gate;
  std::string name() const {
    const char* g = gate == Gate::None ? "NoGate" : gate == Gate::Head ? "HeadGate" : "ChannelGate";
    return std::string(delta ? "Delta" : "Additive") + g;
  }
};

// Random op inputs: q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] in (0, 1), g <= 0.
struct Inputs {
  Tensor q, k, v, beta, g;
  double scale;
};

Inputs make_inputs(const Family& f, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V,
                   torch::ScalarType dt, double gate_strength = 1.0) {
  auto o = torch::TensorOptions().dtype(dt);
  Inputs in;
  in.q = torch::randn({B, T, H, K}, o);
  in.k = torch::randn({B, T, H, K}, o);
  if (f.delta) in.k = in.k / in.k.norm(2, -1, true);  // the mixers L2-normalise keys
  in.v = torch::randn({B, T, H, V}, o);
  in.beta = torch::sigmoid(torch::randn({B, T, H}, o));
  if (f.gate == Gate::Head) in.g = -gate_strength * torch::softplus(torch::randn({B, T, H}, o));
  if (f.gate == Gate::Channel) in.g = -gate_strength * torch::softplus(torch::randn({B, T, H, K}, o));
  in.scale = 1.0 / std::sqrt(static_cast<double>(K));
  return in;
}

RecurrenceResult recurrent(const Family& f, const Inputs& in, const Tensor& s0) {
  return f.delta ? lt2::ops::delta_rule_recurrent(in.q, in.k, in.v, in.beta, in.g, in.scale, s0)
                 : lt2::ops::gated_linear_recurrent(in.q, in.k, in.v, in.g, in.scale, s0);
}

RecurrenceResult chunked(const Family& f, const Inputs& in, const Tensor& s0, int64_t C) {
  return f.delta ? lt2::ops::delta_rule_chunked(in.q, in.k, in.v, in.beta, in.g, in.scale, s0, C)
                 : lt2::ops::gated_linear_chunked(in.q, in.k, in.v, in.g, in.scale, s0, C);
}

Tensor step(const Family& f, const Inputs& in, int64_t t, Tensor& S) {
  Tensor g = in.g.defined() ? in.g.select(1, t) : Tensor();
  return f.delta ? lt2::ops::delta_rule_step(in.q.select(1, t), in.k.select(1, t), in.v.select(1, t),
                                             in.beta.select(1, t), g, in.scale, S)
                 : lt2::ops::gated_linear_step(in.q.select(1, t), in.k.select(1, t),
                                               in.v.select(1, t), g, in.scale, S);
}

// Tokens [a, b) of every input.
Inputs slice(const Inputs& in, int64_t a, int64_t b) {
  Inputs s = in;
  s.q = in.q.narrow(1, a, b - a);
  s.k = in.k.narrow(1, a, b - a);
  s.v = in.v.narrow(1, a, b - a);
  s.beta = in.beta.narrow(1, a, b - a);
  if (in.g.defined()) s.g = in.g.narrow(1, a, b - a);
  return s;
}

// The gated family's chunked form has two forms of the chunk-start states (DecodeOptions::
// gated_prefix_chunks): the prefix product (the default at these lengths) and the chunk scan (0).
// The delta rule has one.
std::vector<int64_t> gated_forms(const Family& f) {
  return f.delta ? std::vector<int64_t>{lt2::DecodeOptions{}.gated_prefix_chunks}
                 : std::vector<int64_t>{lt2::DecodeOptions{}.gated_prefix_chunks, 0};
}
std::unique_ptr<lt2::DecodeOptionsGuard> gated_form(int64_t prefix_chunks) {
  lt2::DecodeOptions options;
  options.gated_prefix_chunks = prefix_chunks;
  return std::make_unique<lt2::DecodeOptionsGuard>(options);
}

class Recurrence : public ::testing::TestWithParam<Family> {
 protected:
  // Tiny shapes: one intra-op thread. Under `ctest -j` on 2 cores, OpenMP's spinning threads
  // slow these tests down ~20x.
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(Recurrence, ChunkedMatchesNaiveInFloat64) {
  torch::manual_seed(0);
  const auto f = GetParam();
  for (int64_t prefix_chunks : gated_forms(f)) {
    SCOPED_TRACE(::testing::Message() << "gated_prefix_chunks " << prefix_chunks);
    const auto form = gated_form(prefix_chunks);
    for (int64_t T : {1, 7, 16, 37, 70}) {
      auto in = make_inputs(f, 2, T, 3, 5, 6, torch::kFloat64);
      for (bool with_state : {false, true}) {
        Tensor s0 = with_state ? torch::randn({2, 3, 5, 6}, torch::kFloat64) : Tensor();
        auto ref = recurrent(f, in, s0);
        for (int64_t C : {1, 4, 8, 16, 32, 64}) {  // 32, 64: sub-chunked scores
          auto out = chunked(f, in, s0, C);
          EXPECT_LT(rel_err(out.o, ref.o), 1e-10) << "T " << T << " C " << C << " state " << with_state;
          EXPECT_LT(rel_err(out.final_state, ref.final_state), 1e-10) << "T " << T << " C " << C;
        }
      }
    }
  }
}

TEST_P(Recurrence, StepMatchesNaive) {
  torch::manual_seed(1);
  const auto f = GetParam();
  auto in = make_inputs(f, 2, 19, 2, 4, 3, torch::kFloat64);
  auto s0 = torch::randn({2, 2, 4, 3}, torch::kFloat64);
  auto ref = recurrent(f, in, s0);
  auto S = s0.clone();
  std::vector<Tensor> outs;
  for (int64_t t = 0; t < 19; ++t) outs.push_back(step(f, in, t, S));
  EXPECT_LT(rel_err(torch::stack(outs, 1), ref.o), 1e-12);
  EXPECT_LT(rel_err(S, ref.final_state), 1e-12);
}

TEST_P(Recurrence, SplitPrefillMatchesWhole) {
  torch::manual_seed(2);
  const auto f = GetParam();
  const int64_t T = 29, C = 8;
  auto in = make_inputs(f, 2, T, 2, 4, 5, torch::kFloat64);
  auto whole = chunked(f, in, Tensor(), C);
  for (int64_t a : {1, 5, 8, 13, 16, 28}) {  // mid-chunk and on chunk boundaries
    auto first = chunked(f, slice(in, 0, a), Tensor(), C);
    auto second = chunked(f, slice(in, a, T), first.final_state, C);
    EXPECT_LT(rel_err(torch::cat({first.o, second.o}, 1), whole.o), 1e-10) << "split at " << a;
    EXPECT_LT(rel_err(second.final_state, whole.final_state), 1e-10) << "split at " << a;
  }
}

void expect_chunked_gradients_match(const Family& f, int64_t T, int64_t C) {
  auto in = make_inputs(f, 1, T, 2, 3, 4, torch::kFloat64);
  auto s0 = torch::randn({1, 2, 3, 4}, torch::kFloat64);
  std::vector<Tensor> xs = {in.q, in.k, in.v, s0};
  if (f.delta) xs.push_back(in.beta);
  if (in.g.defined()) xs.push_back(in.g);
  expect_gradients_match(
      [&](const std::vector<Tensor>& x) {
        Inputs a = in;
        a.q = x[0], a.k = x[1], a.v = x[2];
        size_t i = 4;
        if (f.delta) a.beta = x[i++];
        if (in.g.defined()) a.g = x[i++];
        auto r = chunked(f, a, x[3], C);
        return torch::cat({r.o.flatten(), r.final_state.flatten()});
      },
      xs);
}

TEST_P(Recurrence, ChunkedGradientsMatchFiniteDifferences) {
  torch::manual_seed(3);
  const auto f = GetParam();
  for (int64_t prefix_chunks : gated_forms(f)) {
    SCOPED_TRACE(::testing::Message() << "gated_prefix_chunks " << prefix_chunks);
    const auto form = gated_form(prefix_chunks);
    expect_chunked_gradients_match(f, 11, 4);
    if (f.gate == Gate::Channel) expect_chunked_gradients_match(f, 37, 32);  // sub-chunked scores
  }
}

TEST_P(Recurrence, StrongDecaysStayFiniteAndExact) {
  // Per-step log-gates down to about -60: a chunk of 16 sums to far below fp32's exp range, so
  // any absolute (not relative) exponent would overflow.
  torch::manual_seed(4);
  const auto f = GetParam();
  auto in = make_inputs(f, 1, 40, 2, 4, 4, torch::kFloat32, /*gate_strength=*/30.0);
  auto ref = recurrent(f, in, Tensor());
  auto out = chunked(f, in, Tensor(), 16);
  EXPECT_TRUE(torch::isfinite(out.o).all().item<bool>());
  EXPECT_LT(rel_err(out.o, ref.o), 1e-5);
}

TEST_P(Recurrence, LongFp32SequenceStaysFinite) {
  torch::manual_seed(5);
  const auto f = GetParam();
  const int64_t T = 4096;
  auto in = make_inputs(f, 1, T, 2, 8, 8, torch::kFloat32, /*gate_strength=*/0.05);
  if (!f.delta) in.k = in.k / std::sqrt(8.0);
  auto out = chunked(f, in, Tensor(), 64);
  ASSERT_TRUE(torch::isfinite(out.o).all().item<bool>());
  ASSERT_TRUE(torch::isfinite(out.final_state).all().item<bool>());
  Inputs in64 = in;
  in64.q = in.q.to(torch::kFloat64), in64.k = in.k.to(torch::kFloat64), in64.v = in.v.to(torch::kFloat64);
  in64.beta = in.beta.to(torch::kFloat64);
  if (in.g.defined()) in64.g = in.g.to(torch::kFloat64);
  auto ref = chunked(f, in64, Tensor(), 64);  // float64 chunked == float64 recurrence (above)
  EXPECT_LT(rel_err(out.o, ref.o), f.gate == Gate::None ? 1e-3 : 1e-4);
}

// Which token tensors [B, T, H, D] the row-reading CUDA kernels take in place: packed ones and column
// slices of a wider [B, T, width] tensor (tokens evenly spaced, each token's H D elements packed), not
// head-transposed or token-strided views.
TEST(ChunkScan, TokenRowsInPlace) {
  const int64_t B = 2, T = 5, H = 3, D = 4;
  const auto packed = torch::randn({B, T, H, D});
  const auto wide = torch::randn({B, T, 2 * H * D + 8});
  EXPECT_TRUE(lt2::ops::token_rows_in_place(packed));
  EXPECT_TRUE(lt2::ops::token_rows_in_place(wide.narrow(2, H * D, H * D).view({B, T, H, D})));
  EXPECT_TRUE(lt2::ops::token_rows_in_place(wide.narrow(2, 0, H * D).view({B, T, H, D})));
  EXPECT_FALSE(lt2::ops::token_rows_in_place(torch::randn({B, T, D, H}).transpose(2, 3)));   // heads not packed
  EXPECT_FALSE(lt2::ops::token_rows_in_place(torch::randn({B, T, H, 2 * D}).narrow(3, 0, D)));  // heads apart
  EXPECT_FALSE(lt2::ops::token_rows_in_place(torch::randn({T, B, H, D}).transpose(0, 1)));   // sequences interleaved
  EXPECT_FALSE(lt2::ops::token_rows_in_place(torch::randn({B, T, H * D})));                  // not [B, T, H, D]
}

// The chunk scan without W (the gated linear family: V_n = U_n, the result's v is u itself) and its
// adjoint without Kt equal the scan with W = 0: states, v, final state and the gradients of u, kt,
// carry and the initial state (float64, the libtorch loop on the CPU).
TEST(ChunkScan, WithoutWEqualsZeroW) {
  torch::manual_seed(9);
  const auto o = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t B = 2, H = 2, N = 5, C = 4, K = 6, V = 8;
  const auto u = torch::randn({B, H, N, C, V}, o), kt = 0.3 * torch::randn({B, H, N, K, C}, o);
  const auto carry = 0.5 + 0.5 * torch::rand({B, H, N, 1, 1}, o), s0 = torch::randn({B, H, K, V}, o);
  const auto d_states = torch::randn({B, H, N, K, V}, o), d_v = torch::randn({B, H, N, C, V}, o);
  const auto d_final = torch::randn({B, H, K, V}, o);
  auto run = [&](bool zero_w) {
    std::vector<Tensor> leaves;
    for (const Tensor* t : {&u, &kt, &carry, &s0}) leaves.push_back(t->clone().requires_grad_(true));
    const Tensor w = zero_w ? torch::zeros({B, H, N, C, K}, o) : Tensor();
    const auto r = lt2::ops::chunk_state_scan_differentiable(w, leaves[0], leaves[1], leaves[2], leaves[3]);
    ((r.states * d_states).sum() + (r.v * d_v).sum() + (r.final_state * d_final).sum()).backward();
    std::vector<Tensor> out{r.states.detach(), r.v.detach(), r.final_state.detach()};
    for (auto& l : leaves) out.push_back(l.grad());
    return out;
  };
  const auto without = run(false), zero = run(true);
  const char* names[] = {"states", "v", "final state", "du", "dkt", "dcarry", "d initial state"};
  for (size_t i = 0; i < zero.size(); ++i) EXPECT_LT(rel_err(without[i], zero[i]), 1e-12) << names[i];
  torch::NoGradGuard no_grad;
  const auto plain = lt2::ops::chunk_state_scan({Tensor(), u, kt, carry, s0, Tensor(), false, Tensor(), Tensor()});
  EXPECT_TRUE(plain.v.is_same(u)) << "without W the result's v is u itself";
  // Without Kt (the adjoint's form): no write, S = carry * S (+ the addend).
  const auto addend = torch::randn({B, H, N, K, V}, o), w = 0.3 * torch::randn({B, H, N, C, K}, o);
  const auto no_write = lt2::ops::chunk_state_scan({w, u, Tensor(), carry, s0, addend, true, Tensor(), Tensor()});
  const auto zero_kt =
      lt2::ops::chunk_state_scan({w, u, torch::zeros_like(kt), carry, s0, addend, true, Tensor(), Tensor()});
  EXPECT_LT(rel_err(no_write.states, zero_kt.states), 1e-12);
  EXPECT_LT(rel_err(no_write.v, zero_kt.v), 1e-12);
  EXPECT_LT(rel_err(no_write.final_state, zero_kt.final_state), 1e-12);
  lt2::testing::expect_error_containing(
      [&] { lt2::ops::chunk_state_scan({Tensor(), u, Tensor(), carry, s0, Tensor(), false, Tensor(), Tensor()}); },
      "without w, kt must be [B, H, N, K, C]");
}

INSTANTIATE_TEST_SUITE_P(Families, Recurrence,
                         ::testing::Values(Family{true, Gate::None}, Family{true, Gate::Head},
                                           Family{true, Gate::Channel}, Family{false, Gate::None},
                                           Family{false, Gate::Head}, Family{false, Gate::Channel}),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
