// Packed variable-length batches of both recurrence families (ops::delta_rule_chunked_varlen,
// ops::gated_linear_chunked_varlen): documents packed into one row give, in float64, the outputs,
// final states and gradients (q, k, v, beta, gate, initial states) of each document run alone
// through the naive recurrence, for documents of lengths 0, 1, chunk - 1, chunk, chunk + 1 and
// several chunks, every gate kind, with and without initial states; and the scan's resets on their
// own. Bad cu_seqlens give clear errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/gate_kind.h"
#include "common/testing.h"
#include "lt2/ops/chunking.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "lt2/util/error.h"

namespace {

using lt2::testing::expect_error_containing;
using lt2::testing::Gate;
using lt2::testing::gate_name;
using lt2::testing::rel_err;
using torch::Tensor;

struct Packed {
  Tensor q, k, v, beta, g, s0;  // one row [1, T, ...]; s0 [D, H, K, V] or undefined
  std::vector<int64_t> cu;
  double scale;
};

Packed make_packed(const std::vector<int64_t>& lengths, int64_t H, int64_t K, int64_t V, Gate gate, bool with_state) {
  Packed p;
  p.cu = {0};
  for (int64_t l : lengths) p.cu.push_back(p.cu.back() + l);
  const int64_t T = p.cu.back(), D = static_cast<int64_t>(lengths.size());
  const auto o = torch::TensorOptions().dtype(torch::kFloat64);
  p.q = torch::randn({1, T, H, K}, o);
  p.k = torch::randn({1, T, H, K}, o);
  p.k = p.k / p.k.norm(2, -1, true);
  p.v = torch::randn({1, T, H, V}, o);
  p.beta = torch::sigmoid(torch::randn({1, T, H}, o));
  if (gate == Gate::Head) p.g = -torch::softplus(torch::randn({1, T, H}, o));
  if (gate == Gate::Channel) p.g = -torch::softplus(torch::randn({1, T, H, K}, o));
  if (with_state) p.s0 = 0.5 * torch::randn({D, H, K, V}, o);
  p.scale = 1.0 / std::sqrt(static_cast<double>(K));
  return p;
}

// Document d of x [1, T, ...].
Tensor doc(const Tensor& x, const Packed& p, size_t d) {
  return x.defined() ? x.narrow(1, p.cu[d], p.cu[d + 1] - p.cu[d]) : x;
}

// A recurrence family: its varlen form and its naive reference on inputs {q, k, v, beta, g} (the
// additive family reads no beta).
struct VarlenFamily {
  const char* name;
  bool reads_beta;
  std::function<lt2::ops::RecurrenceResult(const std::vector<Tensor>&, double, const Tensor&,
                                           const std::vector<int64_t>&, int64_t)>
      varlen;
  std::function<lt2::ops::RecurrenceResult(const std::vector<Tensor>&, double, const Tensor&)> recurrent;
};

std::vector<VarlenFamily> varlen_families() {
  using V = const std::vector<Tensor>&;
  return {{"delta rule", true,
           [](V in, double scale, const Tensor& s0, const std::vector<int64_t>& cu, int64_t C) {
             return lt2::ops::delta_rule_chunked_varlen(in[0], in[1], in[2], in[3], in[4], scale, s0, cu, C);
           },
           [](V in, double scale, const Tensor& s0) {
             return lt2::ops::delta_rule_recurrent(in[0], in[1], in[2], in[3], in[4], scale, s0);
           }},
          {"gated linear", false,
           [](V in, double scale, const Tensor& s0, const std::vector<int64_t>& cu, int64_t C) {
             return lt2::ops::gated_linear_chunked_varlen(in[0], in[1], in[2], in[4], scale, s0, cu, C);
           },
           [](V in, double scale, const Tensor& s0) {
             return lt2::ops::gated_linear_recurrent(in[0], in[1], in[2], in[4], scale, s0);
           }}};
}

}  // namespace

TEST(ChunkedVarlen, EqualsEachDocumentAlone) {
  const int64_t H = 2, K = 8, V = 12, C = 64;
  for (const auto& family : varlen_families())
    for (Gate gate : {Gate::None, Gate::Head, Gate::Channel})
      for (bool with_state : {false, true}) {
        SCOPED_TRACE(::testing::Message() << family.name << ", " << gate_name(gate)
                                          << (with_state ? ", initial states" : ""));
        torch::manual_seed(static_cast<int>(gate) * 2 + with_state);
        const auto p = make_packed({1, 63, 0, 64, 65, 1000}, H, K, V, gate, with_state);
        const auto out = family.varlen({p.q, p.k, p.v, p.beta, p.g}, p.scale, p.s0, p.cu, C);
        ASSERT_EQ(out.o.sizes(), torch::IntArrayRef({1, p.cu.back(), H, V}));
        ASSERT_EQ(out.final_state.sizes(), torch::IntArrayRef({6, H, K, V}));
        for (size_t d = 0; d + 1 < p.cu.size(); ++d) {
          const Tensor s0 = with_state ? p.s0.select(0, d).unsqueeze(0) : Tensor();
          if (p.cu[d] == p.cu[d + 1]) {  // an empty document keeps its state
            EXPECT_LT(rel_err(out.final_state.select(0, d),
                              with_state ? s0.squeeze(0) : torch::zeros({H, K, V}, torch::kFloat64)),
                      1e-12);
            continue;
          }
          auto part = [&](const Tensor& x) { return doc(x, p, d); };
          const auto ref = family.recurrent({part(p.q), part(p.k), part(p.v), part(p.beta), part(p.g)}, p.scale, s0);
          EXPECT_LT(rel_err(doc(out.o, p, d), ref.o), 1e-10) << "document " << d;
          EXPECT_LT(rel_err(out.final_state.select(0, d), ref.final_state.squeeze(0)), 1e-10) << "document " << d;
        }
      }
}

TEST(ChunkedVarlen, GradientsEqualEachDocumentAlone) {
  const int64_t H = 2, K = 8, V = 12, C = 16;
  for (const auto& family : varlen_families())
    for (Gate gate : {Gate::None, Gate::Head, Gate::Channel})
      for (bool with_state : {false, true}) {
        SCOPED_TRACE(::testing::Message() << family.name << ", " << gate_name(gate)
                                          << (with_state ? ", initial states" : ""));
        torch::manual_seed(10 + static_cast<int>(gate) * 2 + with_state);
        const auto p = make_packed({1, 15, 16, 0, 17, 40}, H, K, V, gate, with_state);
        const int64_t T = p.cu.back(), D = static_cast<int64_t>(p.cu.size()) - 1;
        const auto d_o = torch::randn({1, T, H, V}, torch::kFloat64);
        const auto d_s = torch::randn({D, H, K, V}, torch::kFloat64);
        auto leaves = [&] {
          std::vector<Tensor> l;
          for (const Tensor* t : {&p.q, &p.k, &p.v, &p.beta, &p.g, &p.s0})
            l.push_back(t->defined() ? t->detach().clone().requires_grad_(true) : Tensor());
          return l;
        };
        auto packed = leaves();
        const auto out = family.varlen({packed[0], packed[1], packed[2], packed[3], packed[4]}, p.scale, packed[5],
                                       p.cu, C);
        ((out.o * d_o).sum() + (out.final_state * d_s).sum()).backward();
        auto alone = leaves();
        Tensor loss = torch::zeros({}, torch::kFloat64);
        for (size_t d = 0; d + 1 < p.cu.size(); ++d) {
          const Tensor s0 = with_state ? alone[5].select(0, d).unsqueeze(0) : Tensor();
          if (p.cu[d] == p.cu[d + 1]) {
            if (with_state) loss = loss + (s0.squeeze(0) * d_s.select(0, d)).sum();
            continue;
          }
          auto part = [&](const Tensor& x) { return doc(x, p, d); };
          const auto ref = family.recurrent({part(alone[0]), part(alone[1]), part(alone[2]), part(alone[3]),
                                             part(alone[4])},
                                            p.scale, s0);
          loss = loss + (ref.o * part(d_o)).sum() + (ref.final_state.squeeze(0) * d_s.select(0, d)).sum();
        }
        loss.backward();
        const char* names[] = {"dq", "dk", "dv", "dbeta", "dg", "d initial_states"};
        for (size_t i = 0; i < packed.size(); ++i) {
          if (!packed[i].defined() || (i == 3 && !family.reads_beta)) continue;
          ASSERT_TRUE(packed[i].grad().defined()) << names[i];
          EXPECT_LT(rel_err(packed[i].grad(), alone[i].grad()), 1e-10) << names[i];
        }
      }
}

// The scan's resets directly: restarting at chunk n from a given state equals two scans.
TEST(ChunkedVarlen, ScanResetsRestartTheState) {
  torch::manual_seed(3);
  const auto o = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t H = 2, N = 5, C = 4, K = 6, V = 8;
  lt2::ops::ChunkScanInputs in{torch::randn({1, H, N, C, K}, o) * 0.2, torch::randn({1, H, N, C, V}, o),
                               torch::randn({1, H, N, K, C}, o) * 0.2, torch::rand({1, H, N, K, 1}, o), Tensor(),
                               Tensor(), false, torch::tensor({0, -1, 1, -1, -1}, torch::kInt32),
                               torch::randn({2, H, K, V}, o)};
  const auto r = lt2::ops::chunk_state_scan(in);
  auto part = [&](int64_t from, int64_t len, int64_t state) {
    return lt2::ops::chunk_state_scan({in.w.narrow(2, from, len), in.u.narrow(2, from, len), in.kt.narrow(2, from, len),
                                       in.carry.narrow(2, from, len), in.reset_states.select(0, state).unsqueeze(0),
                                       Tensor(), false, Tensor(), Tensor()});
  };
  const auto first = part(0, 2, 0), second = part(2, 3, 1);
  EXPECT_LT(rel_err(r.states, torch::cat({first.states, second.states}, 2)), 1e-12);
  EXPECT_LT(rel_err(r.v, torch::cat({first.v, second.v}, 2)), 1e-12);
  EXPECT_LT(rel_err(r.final_state, second.final_state), 1e-12);
}

// The documents' padded token rows (DocumentChunks::to_padded_rows, the layout the CUDA
// preparation reads): each document from a chunk boundary, zeros in its padding, the inverse
// exact, and the chunk layout to_chunks gives is the same rows in chunks.
TEST(ChunkedVarlen, PaddedRowsPlaceEachDocumentAtAChunkBoundary) {
  const std::vector<int64_t> cu{0, 3, 3, 8, 9};  // lengths 3, 0, 5, 1
  const int64_t C = 4, H = 2, X = 3;
  const lt2::ops::DocumentChunks docs(cu, cu.back(), C, torch::kCPU, "test");
  const auto x = torch::randn({1, cu.back(), H, X}, torch::kFloat64);
  const auto rows = docs.to_padded_rows(x);
  ASSERT_EQ(rows.sizes(), torch::IntArrayRef({1, docs.chunks() * C, H, X}));
  EXPECT_EQ(docs.chunks(), 4);  // 1 + 2 + 1 chunks
  const std::vector<std::pair<int64_t, int64_t>> placed{{0, 0}, {3, 4}, {8, 12}};  // (first token, first row)
  const std::vector<int64_t> lengths{3, 5, 1};
  for (size_t d = 0; d < placed.size(); ++d) {
    const auto [token, row] = placed[d];
    const int64_t len = lengths[d], padded = (len + C - 1) / C * C;
    EXPECT_TRUE(torch::equal(rows.narrow(1, row, len), x.narrow(1, token, len))) << "document " << d;
    EXPECT_EQ(rows.narrow(1, row + len, padded - len).abs().sum().item<double>(), 0.0) << "padding of " << d;
  }
  EXPECT_TRUE(torch::equal(docs.from_padded_rows(rows), x));
  const auto chunks = docs.to_chunks(x, torch::kFloat64);  // [1, H, N, C, X]
  EXPECT_TRUE(torch::equal(chunks.permute({0, 2, 3, 1, 4}).reshape({1, -1, H, X}), rows));
}

TEST(ChunkedVarlen, RejectsBadSeqlens) {
  const auto p = make_packed({3, 5}, 1, 4, 4, Gate::Head, false);
  for (const auto& family : varlen_families()) {
    SCOPED_TRACE(family.name);
    auto call = [&](std::vector<int64_t> cu, const Tensor& s0 = {}) {
      return [=] { family.varlen({p.q, p.k, p.v, p.beta, p.g}, p.scale, s0, cu, 4); };
    };
    expect_error_containing(call({0, 3, 7}), "cu_seqlens must run from 0 to T = 8");
    expect_error_containing(call({1, 3, 8}), "cu_seqlens must run from 0");
    expect_error_containing(call({0}), "at least one document");
    expect_error_containing(call({0, 5, 3, 8}), "must not descend");
    expect_error_containing(call({0, 3, 8}, torch::zeros({3, 1, 4, 4}, torch::kFloat64)), "initial_states must be [2, 1, 4, 4]");
    auto two_rows = [](const Tensor& x) { return x.expand({2, -1, -1, -1}); };
    expect_error_containing([&] { family.varlen({two_rows(p.q), two_rows(p.k), two_rows(p.v), p.beta.expand({2, -1, -1}),
                                      p.g.expand({2, -1, -1})}, p.scale, {}, {0, 8}, 4); },
                 "one row");
  }
}
