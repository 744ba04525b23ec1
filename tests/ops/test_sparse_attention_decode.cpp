// sparse_attention_decode_reference (ops/sparse_attention/sparse_attention_decode.h) against a dense float64
// computation over the whole cache, where a row takes part when it is among the first counts[b]
// indices of its sequence: fresh random inputs, GQA groups 1, 4 and 16, the latent form (values =
// the keys' first Dv dims), counts differing per sequence (1 and n included), unused entries
// holding -1, caches with non-contiguous batch and row strides. Plus the input checks, and the
// fused entry point refusing CPU tensors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "lt2/kernels/sparse_attention_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"
#include "lt2/util/error.h"

namespace {

using lt2::testing::rel_err;
using torch::Tensor;

const auto f64 = torch::kFloat64;

struct Case {
  int64_t B, Hq, Hkv, Dk, Dv, L, n;
  bool latent;  // v = k.narrow(-1, 0, Dv)
};

struct DecodeInputs {
  Tensor q, k, v, indices, counts;
  double scale;
};

// Caches with a batch stride of two sequences (every other one of a larger buffer, offset by one)
// and rows 8 elements longer than the head dim; distinct indices per sequence in random order,
// entries past the count set to -1.
DecodeInputs make_inputs(const Case& c, torch::ScalarType dt) {
  DecodeInputs in;
  const int64_t pad = 8;
  auto k_buf = torch::randn({2 * c.B + 1, c.Hkv, c.L, c.Dk + pad}).to(dt);
  in.k = k_buf.slice(0, 1, 2 * c.B + 1, 2).narrow(3, 0, c.Dk);
  if (c.latent) {
    in.v = in.k.narrow(3, 0, c.Dv);
  } else {
    auto v_buf = torch::randn({2 * c.B + 1, c.Hkv, c.L, c.Dv + pad}).to(dt);
    in.v = v_buf.slice(0, 1, 2 * c.B + 1, 2).narrow(3, 0, c.Dv);
  }
  in.q = (torch::randn({c.B, c.Hq, c.Dk}) * 2).to(dt);  // sharper softmax than unit scores
  in.counts = torch::randint(1, c.n + 1, {c.B}, torch::kInt64);
  in.counts[0] = 1;
  if (c.B > 1) in.counts[c.B - 1] = c.n;
  std::vector<Tensor> rows;
  for (int64_t b = 0; b < c.B; ++b) {
    auto r = torch::randperm(c.L, torch::kInt64).narrow(0, 0, c.n).clone();
    r.narrow(0, in.counts[b].item<int64_t>(), c.n - in.counts[b].item<int64_t>()).fill_(-1);
    rows.push_back(r);
  }
  in.indices = torch::stack(rows);
  in.scale = 1.0 / std::sqrt(static_cast<double>(c.Dk));
  return in;
}

// Dense float64 attention over every cache row, restricted to the selected ones by a mask.
Tensor dense_reference(const DecodeInputs& in) {
  const int64_t B = in.q.size(0), Hq = in.q.size(1), L = in.k.size(2), G = Hq / in.k.size(1);
  std::vector<Tensor> outs;
  for (int64_t b = 0; b < B; ++b) {
    auto selected = torch::zeros({L}, torch::kBool);
    selected.index_put_({in.indices[b].narrow(0, 0, in.counts[b].item<int64_t>())}, true);
    auto kb = in.k[b].to(f64).repeat_interleave(G, 0);  // [Hq, L, Dk]
    auto vb = in.v[b].to(f64).repeat_interleave(G, 0);  // [Hq, L, Dv]
    auto scores = torch::matmul(kb, in.q[b].to(f64).unsqueeze(-1)).squeeze(-1) * in.scale;  // [Hq, L]
    scores = scores.masked_fill(~selected, -std::numeric_limits<double>::infinity());
    outs.push_back(torch::matmul(torch::softmax(scores, -1).unsqueeze(1), vb).squeeze(1));  // [Hq, Dv]
  }
  return torch::stack(outs);
}

}  // namespace

TEST(SparseAttentionDecode, ReferenceMatchesDenseFloat64) {
  const std::vector<Case> cases{
      {3, 4, 4, 64, 64, 50, 20, false},      // G 1
      {2, 8, 2, 128, 128, 40, 40, false},    // G 4, every row of the list used by the last sequence
      {3, 16, 1, 64, 64, 30, 17, false},     // G 16
      {3, 16, 1, 576, 512, 60, 33, true},    // the latent form
      {1, 4, 1, 256, 256, 9, 1, false},      // one index
  };
  for (auto dt : {torch::kFloat64, torch::kFloat32, torch::kBFloat16})
    for (const auto& c : cases) {
      SCOPED_TRACE(::testing::Message() << dt << " B" << c.B << " Hq" << c.Hq << " Hkv" << c.Hkv << " Dk"
                                        << c.Dk << " Dv" << c.Dv << " L" << c.L << " n" << c.n
                                        << (c.latent ? " latent" : ""));
      torch::manual_seed(c.B * 1000 + c.Hq * 10 + c.n);
      const auto in = make_inputs(c, dt);
      auto out =
          lt2::ops::sparse_attention_decode_reference(in.q, in.k, in.v, in.indices, in.counts, in.scale);
      EXPECT_EQ(out.sizes(), torch::IntArrayRef({c.B, c.Hq, c.Dv}));
      EXPECT_EQ(out.scalar_type(), dt);
      const double tol = dt == f64 ? 1e-12 : dt == torch::kFloat32 ? 1e-5 : 5e-3;
      EXPECT_LT(rel_err(out, dense_reference(in)), tol);
    }
}

TEST(SparseAttentionDecode, RejectsBadInputs) {
  torch::manual_seed(3);
  const auto in = make_inputs({2, 4, 2, 64, 64, 20, 8, false}, torch::kFloat32);
  auto ref = [&](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& idx, const Tensor& cnt) {
    return lt2::ops::sparse_attention_decode_reference(q, k, v, idx, cnt, in.scale);
  };
  EXPECT_THROW(ref(in.q, in.k, in.v, in.indices.to(torch::kInt32), in.counts), lt2::Error);
  EXPECT_THROW(ref(in.q, in.k, in.v, in.indices, in.counts.narrow(0, 0, 1)), lt2::Error);
  EXPECT_THROW(ref(in.q.narrow(1, 0, 3), in.k, in.v, in.indices, in.counts), lt2::Error);  // 3 over 2 heads
  EXPECT_THROW(ref(in.q, in.k, in.v.narrow(2, 0, 10), in.indices, in.counts), lt2::Error);
  EXPECT_THROW(ref(in.q.to(torch::kFloat64), in.k, in.v, in.indices, in.counts), lt2::Error);
  // The fused entry point takes CUDA tensors only.
  EXPECT_FALSE(lt2::ops::sparse_attention_decode_supported(in.q, in.k, in.v));
  EXPECT_THROW(lt2::ops::sparse_attention_decode_fused(in.q, in.k, in.v, in.indices, in.counts, in.scale),
               lt2::Error);
}

TEST(SparseAttentionDecode, KernelInstances) {
  using lt2::kernels::sparse_attention_decode_supported;
  for (int d : {64, 128, 256}) EXPECT_TRUE(sparse_attention_decode_supported(d, d, 1)) << d;
  EXPECT_TRUE(sparse_attention_decode_supported(576, 512, 16));
  EXPECT_TRUE(sparse_attention_decode_supported(128, 128, 3));
  EXPECT_FALSE(sparse_attention_decode_supported(576, 576, 1));
  EXPECT_FALSE(sparse_attention_decode_supported(96, 96, 1));
  EXPECT_FALSE(sparse_attention_decode_supported(128, 64, 1));
  EXPECT_FALSE(sparse_attention_decode_supported(128, 128, 17));
  EXPECT_FALSE(sparse_attention_decode_supported(128, 128, 0));
}
