// GPU (CTest label `gpu`): ops::sparse_attention_decode, the fused sparse flash-decoding kernel,
// against float64 (sparse_attention_decode_reference on float64 copies) on fresh random inputs:
// every (Dk, Dv) instance, groups 1, 3, 4, 8, 16, batches 1, 3, 8, index lists from 1 to 2048
// entries with distinct rows in random order, counts differing per sequence (1 and n included),
// the latent form (values = the keys' first 512 dims), caches and queries with non-contiguous
// strides; fp32 relative RMS error < 1e-5, bf16 and fp16 < 5e-3. Every cache row a sequence does
// not select is NaN, and the kernel also runs with NaN-poisoned output and split workspaces, so a
// stray read or a missing write shows. Replayed from a CUDA graph with new counts, indices and
// queries it equals the eager call. The latent preset in bf16 / fp16 (the tensor-core form) also on
// its own: counts set per sequence (0, below a tile, at n), one split and several. With DSA's
// output absorption and gate folded into the combine: against float64 and the unfolded path, and
// replayed from a graph. Skips where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "lt2/kernels/sparse_attention_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

const auto f64 = torch::kFloat64;

struct Case {
  int64_t B, Hq, Hkv, Dk, Dv, L, n;
  bool latent;  // v = k.narrow(-1, 0, Dv): one cache, each row read once
};

struct Inputs {
  Tensor q, k, v, indices, counts;
  double scale;
};

// Per sequence: n distinct rows of [0, L) in random order, and counts in [1, n] with the first
// sequence at 1 and the last at n. On the GPU.
std::pair<Tensor, Tensor> random_selection(int64_t B, int64_t L, int64_t n) {
  auto counts = torch::randint(1, n + 1, {B}, torch::kInt64);
  counts[0] = 1;
  if (B > 1) counts[B - 1] = n;
  std::vector<Tensor> rows;
  for (int64_t b = 0; b < B; ++b) rows.push_back(torch::randperm(L, torch::kInt64).narrow(0, 0, n));
  return {torch::stack(rows).cuda(), counts.cuda()};
}

// Caches with a batch stride of two sequences (every other one of a larger buffer, offset by one)
// and rows 8 elements longer than the head dim; q with a head stride of Dk + 8.
Inputs make_inputs(const Case& c, torch::ScalarType dt) {
  Inputs in;
  auto k_buf = torch::randn({2 * c.B + 1, c.Hkv, c.L, c.Dk + 8}, gpu(dt));
  in.k = k_buf.slice(0, 1, 2 * c.B + 1, 2).narrow(3, 0, c.Dk);
  if (c.latent) {
    in.v = in.k.narrow(3, 0, c.Dv);
  } else {
    auto v_buf = torch::randn({2 * c.B + 1, c.Hkv, c.L, c.Dv + 8}, gpu(dt));
    in.v = v_buf.slice(0, 1, 2 * c.B + 1, 2).narrow(3, 0, c.Dv);
  }
  in.q = (torch::randn({c.B, c.Hq, c.Dk + 8}, gpu(torch::kFloat32)) * 2).to(dt).narrow(2, 0, c.Dk);
  std::tie(in.indices, in.counts) = random_selection(c.B, c.L, c.n);
  in.scale = 1.0 / std::sqrt(static_cast<double>(c.Dk));
  return in;
}

// NaN in every cache row that a sequence does not select (its rows past counts[b] included).
void poison_unselected(Tensor cache, const Tensor& indices, const Tensor& counts) {
  const int64_t B = cache.size(0), L = cache.size(2);
  auto idx = indices.cpu(), cnt = counts.cpu();
  auto selected = torch::zeros({B, L}, torch::kBool);
  for (int64_t b = 0; b < B; ++b) selected[b].index_put_({idx[b].narrow(0, 0, cnt[b].item<int64_t>())}, true);
  cache.masked_fill_(~selected.cuda().view({B, 1, L, 1}), std::nan(""));
}

Tensor reference64(const Inputs& in, const Tensor& absorb = {}, const Tensor& gate = {}) {
  auto to64 = [](const Tensor& t) { return t.defined() ? t.to(f64) : t; };
  return ops::sparse_attention_decode_reference(in.q.to(f64), in.k.to(f64), in.v.to(f64), in.indices,
                                                in.counts, in.scale, to64(absorb), to64(gate));
}

#ifdef LT2_WITH_CUDA
// The kernel launched directly, its output and split workspaces filled with NaN first: every
// output element and every partial the combine reads must be written. Returns the output.
Tensor run_poisoned(const Inputs& in) {
  const int64_t B = in.q.size(0), Hq = in.q.size(1), Hkv = in.k.size(1), Dv = in.v.size(3);
  const int splits = kernels::sparse_attention_decode_num_splits(
      static_cast<int>(B), static_cast<int>(Hkv), static_cast<int>(Hq / Hkv),
      static_cast<int>(in.indices.size(1)), c10::cuda::current_device());
  const float nan = std::nanf("");
  auto out = torch::full({B, Hq, Dv}, nan, in.q.options().memory_format(torch::MemoryFormat::Contiguous));
  auto partial_out = torch::full({B, Hq, splits, Dv}, nan, gpu(torch::kFloat32));
  auto partial_lse = torch::full({B, Hq, splits}, nan, gpu(torch::kFloat32));
  kernels::SparseAttentionDecodeParams p{};
  p.q = in.q.data_ptr();
  p.q_batch_stride = in.q.stride(0), p.q_head_stride = in.q.stride(1);
  p.k_cache = in.k.data_ptr(), p.v_cache = in.v.data_ptr();
  p.k_batch_stride = in.k.stride(0), p.k_head_stride = in.k.stride(1), p.k_row_stride = in.k.stride(2);
  p.v_batch_stride = in.v.stride(0), p.v_head_stride = in.v.stride(1), p.v_row_stride = in.v.stride(2);
  p.indices = in.indices.data_ptr<int64_t>();
  p.counts = in.counts.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.partial_out = splits > 1 ? partial_out.data_ptr<float>() : nullptr;
  p.partial_lse = splits > 1 ? partial_lse.data_ptr<float>() : nullptr;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.head_dim_k = in.k.size(3), p.head_dim_v = Dv;
  p.max_len = in.k.size(2), p.n = in.indices.size(1), p.num_splits = splits;
  p.scale = static_cast<float>(in.scale);
  p.dtype = in.q.scalar_type() == torch::kBFloat16  ? kernels::DType::BFloat16
            : in.q.scalar_type() == torch::kFloat16 ? kernels::DType::Float16
                                                    : kernels::DType::Float32;
  kernels::sparse_attention_decode(p, c10::cuda::getCurrentCUDAStream().stream());
  // The latent preset's tensor-core form runs fewer splits than the workspace holds: its partials
  // fill the first [B, Hq, used, Dv] of it.
  const int used = kernels::sparse_attention_decode_splits_used(p);
  EXPECT_GE(used, 1);
  EXPECT_LE(used, splits);
  if (used > 1) {
    EXPECT_FALSE(torch::isnan(partial_out.flatten().narrow(0, 0, B * Hq * used * Dv)).any().item<bool>())
        << "a split partial left unwritten";
    EXPECT_FALSE(torch::isnan(partial_lse.flatten().narrow(0, 0, B * Hq * used)).any().item<bool>())
        << "a split lse left unwritten";
  }
  return out;
}

// The splits the launcher runs for in's shapes (without launching), and the count callers size the
// workspace with.
std::pair<int, int> splits_of(const Inputs& in) {
  kernels::SparseAttentionDecodeParams p{};
  p.k_cache = in.k.data_ptr(), p.v_cache = in.v.data_ptr();
  p.k_batch_stride = in.k.stride(0), p.k_head_stride = in.k.stride(1), p.k_row_stride = in.k.stride(2);
  p.v_batch_stride = in.v.stride(0), p.v_head_stride = in.v.stride(1), p.v_row_stride = in.v.stride(2);
  p.batch = in.q.size(0), p.q_heads = in.q.size(1), p.kv_heads = in.k.size(1);
  p.head_dim_k = in.k.size(3), p.head_dim_v = in.v.size(3), p.max_len = in.k.size(2), p.n = in.indices.size(1);
  p.num_splits = kernels::sparse_attention_decode_num_splits(p.batch, p.kv_heads, p.q_heads / p.kv_heads, p.n,
                                                             c10::cuda::current_device());
  p.dtype = in.q.scalar_type() == torch::kBFloat16  ? kernels::DType::BFloat16
            : in.q.scalar_type() == torch::kFloat16 ? kernels::DType::Float16
                                                    : kernels::DType::Float32;
  return {kernels::sparse_attention_decode_splits_used(p), p.num_splits};
}
#endif

}  // namespace

TEST(FusedSparseAttention, MatchesFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  const std::vector<Case> cases{
      // DSA's latent preset at batch 1 (a count of 1 here; LatentTensorCoreForm sets counts):
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
  for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      if (dt == torch::kFloat16 && i % 3 != 0) continue;  // fp16 on a third of the shapes
      SCOPED_TRACE(::testing::Message() << dt << " B" << c.B << " Hq" << c.Hq << " Hkv" << c.Hkv << " Dk"
                                        << c.Dk << " Dv" << c.Dv << " L" << c.L << " n" << c.n
                                        << (c.latent ? " latent" : ""));
      torch::manual_seed(static_cast<uint64_t>(1000 * i + c.n));
      auto in = make_inputs(c, dt);
      poison_unselected(in.k, in.indices, in.counts);
      if (!c.latent) poison_unselected(in.v, in.indices, in.counts);
      ASSERT_TRUE(ops::sparse_attention_decode_supported(in.q, in.k, in.v));
      auto out = ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale);
      EXPECT_EQ(out.sizes(), torch::IntArrayRef({c.B, c.Hq, c.Dv}));
      EXPECT_EQ(out.scalar_type(), dt);
      EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << "a NaN row was read or an output left unwritten";
      EXPECT_LT(rel_err(out, reference64(in)), tolerance(dt));
#ifdef LT2_WITH_CUDA
      EXPECT_TRUE(torch::equal(run_poisoned(in), out)) << "output with NaN-poisoned buffers differs";
#endif
    }
}

// DSA's latent preset in bf16 / fp16 (Dk 576, Dv 512 aliased in the keys, 16 query heads over one
// kv head): the launcher routes these to the tensor-core form (32-key tiles; fp32 and every other
// shape take the CUDA-core kernel). Counts set per sequence: below n, one below a tile (1, 7, 17),
// one at n, one that leaves a split's last tile partial and later splits empty; also a count of 0
// (zeros). Which path each case hits (n 2048 on a 132-SM H200; tc::splits):
//   B 1, n 2048: 32 splits of 2 tiles + combine (the workspace holds 128);
//   B 8, n 2048: 16 splits of 4 tiles + combine;
//   B 3, n 2048: 32 splits + combine, one count 0;
//   B 1 and B 3, n 40 (2 tiles, the second partial): one split, `out` written without the combine;
//   B 3, n 100 (4 tiles): 2 splits + combine; the count-5 sequence leaves split 1 empty.
TEST(FusedSparseAttention, LatentTensorCoreForm) {
  REQUIRE_FUSED_DECODE();
  struct TcCase {
    int64_t B, L, n;
    std::vector<int64_t> counts;
  };
  const std::vector<TcCase> cases{
      {1, 3000, 2048, {2048}},
      {1, 2500, 2048, {1500}},
      {8, 2100, 2048, {2048, 1, 17, 1000, 2047, 33, 640, 1999}},
      {3, 2100, 2048, {700, 0, 2048}},
      {1, 100, 40, {40}},
      {3, 100, 40, {40, 7, 33}},
      {3, 300, 100, {100, 5, 64}},
  };
  for (auto dt : {torch::kBFloat16, torch::kFloat16})
    for (size_t i = 0; i < cases.size(); ++i) {
      const TcCase& tcase = cases[i];
      const Case c{tcase.B, 16, 1, 576, 512, tcase.L, tcase.n, true};
      torch::manual_seed(static_cast<uint64_t>(7000 + 100 * i + c.n));
      auto in = make_inputs(c, dt);
      in.counts = torch::tensor(tcase.counts, torch::kInt64).cuda();
      poison_unselected(in.k, in.indices, in.counts);
      int used = 0, workspace = 0;
#ifdef LT2_WITH_CUDA
      std::tie(used, workspace) = splits_of(in);
#endif
      SCOPED_TRACE(::testing::Message() << dt << " B" << c.B << " L" << c.L << " n" << c.n << " splits " << used
                                        << " of " << workspace);
      auto out = ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale);
      EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << "a NaN row was read or an output left unwritten";
      // Sequences with a count of 0 give zeros (the reference's softmax over nothing is NaN).
      auto nonempty = (in.counts > 0).nonzero().flatten();
      auto empty = (in.counts == 0).nonzero().flatten();
      if (empty.numel() > 0) {
        auto zeroed = out.index_select(0, empty);
        EXPECT_TRUE(torch::equal(zeroed, torch::zeros_like(zeroed))) << "a count of 0 must give zeros";
      }
      EXPECT_LT(rel_err(out.index_select(0, nonempty), reference64(in).index_select(0, nonempty)), tolerance(dt));
#ifdef LT2_WITH_CUDA
      EXPECT_TRUE(torch::equal(run_poisoned(in), out)) << "output with NaN-poisoned buffers differs";
      if (c.n == 2048) {
        EXPECT_GT(used, 1);
      }
      if (c.n == 2048 && c.B == 1) {
        EXPECT_LT(used, workspace) << "not the tensor-core form's split count";
      }
      if (c.n == 40) {
        EXPECT_EQ(used, 1);
      }
#endif
    }
}

// The output absorption and its gate folded into the combine, y = (o absorb[h]^T) * sigmoid(gate),
// against float64 and against the unfolded path (o, then gemv_batched where it applies, else the
// product in fp32 on o): DSA's latent preset (Dy 128) at batch 1 and 8 (the tensor-core form's 32
// and 16 splits), a short list and one split (partials written without a combine of several);
// clusters of 1, 2 and 4 blocks (Dv 64, 128, 256) at odd Dy; 32 sequences. With and without the
// gate, the gate a strided view.
TEST(FusedSparseAttention, FoldedAbsorptionMatchesReference) {
  REQUIRE_FUSED_DECODE();
  struct FoldCase {
    Case c;
    int64_t Dy;
  };
  const std::vector<FoldCase> cases{
      {{1, 16, 1, 576, 512, 3000, 2048, true}, 128},  // lt2-gdn-dsa-1.3b, batch 1
      {{8, 16, 1, 576, 512, 2100, 2048, true}, 128},  // ... batch 8
      {{3, 16, 1, 576, 512, 500, 100, true}, 128},
      {{2, 16, 1, 576, 512, 40, 12, true}, 128},      // one split
      {{3, 6, 2, 64, 64, 50, 20, false}, 40},         // a cluster of one block
      {{5, 4, 1, 128, 128, 200, 37, false}, 24},      // two blocks
      {{32, 8, 1, 256, 256, 300, 64, false}, 128},    // four blocks, 32 sequences
  };
  for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& [c, Dy] = cases[i];
      if (dt == torch::kFloat16 && i % 2 != 0) continue;
      for (bool gated : {true, false}) {
        SCOPED_TRACE(::testing::Message() << dt << " B" << c.B << " Hq" << c.Hq << " Hkv" << c.Hkv << " Dk" << c.Dk
                                          << " Dv" << c.Dv << " n" << c.n << " Dy" << Dy << (gated ? " gated" : ""));
        torch::manual_seed(static_cast<uint64_t>(500 * i + c.n + gated));
        auto in = make_inputs(c, dt);
        poison_unselected(in.k, in.indices, in.counts);
        if (!c.latent) poison_unselected(in.v, in.indices, in.counts);
        const auto absorb =
            (torch::randn({c.Hq, Dy, c.Dv}, gpu(torch::kFloat32)) / std::sqrt(static_cast<double>(c.Dv))).to(dt);
        const auto gate = gated ? (torch::randn({c.B, c.Hq, Dy + 8}, gpu(torch::kFloat32)) * 2).to(dt).narrow(2, 4, Dy)
                                : Tensor();
        ASSERT_TRUE(ops::sparse_attention_absorb_supported(in.q, in.k, in.v, absorb, gate));
        auto y = ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale, absorb, gate);
        EXPECT_EQ(y.sizes(), torch::IntArrayRef({c.B, c.Hq, Dy}));
        EXPECT_TRUE(torch::isfinite(y).all().item<bool>()) << "a NaN row was read or an output left unwritten";
        EXPECT_LT(rel_err(y, reference64(in, absorb, gate)), tolerance(dt));
        auto o = ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale);
        Tensor unfolded;
        if (ops::gemv_batched_applies(o, absorb, gate)) {
          unfolded = torch::empty_like(y);
          ops::gemv_batched(o, absorb, unfolded, gate);
        } else {
          unfolded = torch::einsum("bhc,hjc->bhj", {o.to(torch::kFloat32), absorb.to(torch::kFloat32)});
          if (gated) unfolded = unfolded * torch::sigmoid(gate.to(torch::kFloat32));
        }
        EXPECT_LT(rel_err(y, unfolded), tolerance(dt)) << "against the unfolded path";
      }
    }
}

TEST(FusedSparseAttention, Unsupported) {
  REQUIRE_FUSED_DECODE();
  auto q = torch::randn({2, 4, 96}, gpu(torch::kBFloat16));
  auto k = torch::randn({2, 1, 10, 96}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_decode_supported(q, k, k));  // head dim 96
  auto q17 = torch::randn({1, 17, 64}, gpu(torch::kBFloat16));
  auto k17 = torch::randn({1, 1, 10, 64}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_decode_supported(q17, k17, k17));  // 17 query heads per kv head
  auto k_odd = torch::randn({1, 1, 10, 72}, gpu(torch::kBFloat16)).narrow(3, 4, 64);  // rows 8 bytes off
  auto q1 = torch::randn({1, 4, 64}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_decode_supported(q1, k_odd, k_odd));
  auto idx = torch::zeros({1, 4}, gpu(torch::kInt64)), cnt = torch::ones({1}, gpu(torch::kInt64));
  EXPECT_THROW(ops::sparse_attention_decode(q1, k_odd, k_odd, idx, cnt, 1.0), lt2::Error);
  auto k1 = torch::randn({1, 1, 10, 64}, gpu(torch::kBFloat16));
  EXPECT_THROW(ops::sparse_attention_decode(q1, k1, k1, idx.to(torch::kInt32), cnt, 1.0), lt2::Error);
  EXPECT_THROW(ops::sparse_attention_decode(q1, k1, k1, idx, cnt.cpu(), 1.0), lt2::Error);
  // The folded absorption: absorb [Hq, Dy, Dv], gate [B, Hq, Dy], Dy <= 128, Dv a multiple of 64.
  auto absorb = torch::randn({4, 32, 64}, gpu(torch::kBFloat16));
  EXPECT_TRUE(ops::sparse_attention_absorb_supported(q1, k1, k1, absorb));
  EXPECT_FALSE(ops::sparse_attention_absorb_supported(q1, k1, k1, torch::randn({4, 129, 64}, gpu(torch::kBFloat16))));
  EXPECT_FALSE(ops::sparse_attention_absorb_supported(q1, k1, k1, absorb.transpose(1, 2).contiguous().transpose(1, 2)));
  EXPECT_THROW(ops::sparse_attention_decode(q1, k1, k1, idx, cnt, 1.0, torch::randn({4, 32, 63}, gpu(torch::kBFloat16))),
               lt2::Error);
  EXPECT_THROW(ops::sparse_attention_decode(q1, k1, k1, idx, cnt, 1.0, absorb, torch::randn({1, 4, 31}, gpu(torch::kBFloat16))),
               lt2::Error);
  EXPECT_THROW(ops::sparse_attention_decode(q1, k1, k1, idx, cnt, 1.0, {}, torch::randn({1, 4, 32}, gpu(torch::kBFloat16))),
               lt2::Error);  // a gate without absorb
  auto q96 = torch::randn({1, 4, 96}, gpu(torch::kBFloat16)), k96 = torch::randn({1, 1, 10, 96}, gpu(torch::kBFloat16));
  EXPECT_FALSE(ops::sparse_attention_absorb_supported(q96, k96, k96, torch::randn({4, 32, 96}, gpu(torch::kBFloat16))));
}

#ifdef LT2_WITH_CUDA

// Captured once, replayed with new counts, indices and queries: equals the eager call.
TEST(FusedSparseAttention, GraphReplayWithNewSelection) {
  REQUIRE_FUSED_DECODE();
  const std::vector<std::pair<Case, torch::ScalarType>> cases{
      {{3, 16, 1, 576, 512, 3000, 2048, true}, torch::kBFloat16},  // tensor-core form, 32 splits
      {{1, 16, 1, 576, 512, 3000, 2048, true}, torch::kFloat16},   // tensor-core form at batch 1
      {{8, 16, 1, 576, 512, 2100, 2048, true}, torch::kBFloat16},  // tensor-core form at batch 8
      {{2, 16, 1, 576, 512, 200, 40, true}, torch::kBFloat16},     // tensor-core form, one split
      {{2, 16, 16, 128, 128, 1000, 300, false}, torch::kFloat32}};
  for (const auto& [c, dt] : cases) {
    SCOPED_TRACE(::testing::Message() << dt << " Dk" << c.Dk << " Hkv" << c.Hkv);
    torch::manual_seed(11);
    auto in = make_inputs(c, dt);
    // Warm-up (reserves the kernel's shared memory), capture, replays and eager calls all on one
    // side stream (capture needs a non-default one).
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    auto out = ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale);
    graph.capture_end();
    for (int replay = 0; replay < 3; ++replay) {
      auto [indices, counts] = random_selection(c.B, c.L, c.n);
      in.indices.copy_(indices);
      in.counts.copy_(counts.flip(0));  // the full list first, a count of 1 last
      if (c.B == 1) in.counts.fill_(c.n - 700 * replay);  // (random_selection's lone count is 1)
      in.q.copy_(torch::randn(in.q.sizes(), gpu(dt)));
      graph.replay();
      auto eager = ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale);
      torch::cuda::synchronize();
      EXPECT_TRUE(torch::equal(out, eager)) << "replay " << replay;
      EXPECT_LT(rel_err(out, reference64(in)), tolerance(dt)) << "replay " << replay;
    }
  }
}

// The folded absorption captured once, replayed with new selections, queries and gates: equals the
// eager call.
TEST(FusedSparseAttention, FoldedAbsorptionGraphReplay) {
  REQUIRE_FUSED_DECODE();
  const Case c{8, 16, 1, 576, 512, 2100, 2048, true};
  torch::manual_seed(13);
  auto in = make_inputs(c, torch::kBFloat16);
  const auto absorb = torch::randn({c.Hq, 128, c.Dv}, gpu(torch::kBFloat16)) / std::sqrt(static_cast<double>(c.Dv));
  auto gate = torch::randn({c.B, c.Hq, 128}, gpu(torch::kBFloat16));
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  auto call = [&] { return ops::sparse_attention_decode(in.q, in.k, in.v, in.indices, in.counts, in.scale, absorb, gate); };
  call();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto y = call();
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    auto [indices, counts] = random_selection(c.B, c.L, c.n);
    in.indices.copy_(indices), in.counts.copy_(counts);
    in.q.copy_(torch::randn(in.q.sizes(), gpu(torch::kBFloat16)));
    gate.copy_(torch::randn_like(gate));
    graph.replay();
    auto eager = call();
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::equal(y, eager)) << "replay " << replay;
    EXPECT_LT(rel_err(y, reference64(in, absorb, gate)), tolerance(torch::kBFloat16)) << "replay " << replay;
  }
}

#endif  // LT2_WITH_CUDA
