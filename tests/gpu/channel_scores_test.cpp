// GPU (CTest label `gpu`): the per-channel decayed-score kernels (kernels/prefill.h, reached through
// ops::decayed_scores with DecodeOptions::channel_scores on): scores and the gradients of a, b and
// G against the float64 libtorch form on the CPU, on random inputs with cumulative log-gates as the
// gated forms build them and strong ones (down to ~-10 a token: the C 64 kernels' reference-row
// factors underflow), strict and inclusive, at chunk sizes 64 (the mixers', on tensor cores), 48, 16
// and 5 and head dims 1 to 256 (off the kernels' 32-channel tiles too); the option off keeps the libtorch
// form on CUDA; the kernels reading token rows (q and k in place, fp32 or bf16); GLA's chunked form
// and its gradients through the kernels against the float64 recurrence; KDA's two scores in one pass,
// forward and backward;
// the chunked forms reading q, k
// and v as column slices of one projection output in place, equal to reading packed copies. Skips
// where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/ops/chunking.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct ScoreCase {
  std::vector<int64_t> batch;
  int64_t C, K;
};

struct Scores {
  Tensor s, da, db, dG;
};

// The scores and, for the score gradient `dS`, the gradients of a, b and G, on `device` in `dt`.
Scores scores_and_grads(const Tensor& a, const Tensor& b, const Tensor& G, const Tensor& dS, bool inclusive,
                        const torch::TensorOptions& on) {
  auto ad = a.to(on).detach().requires_grad_(true), bd = b.to(on).detach().requires_grad_(true);
  auto Gd = G.to(on).detach().requires_grad_(true);
  auto s = ops::decayed_scores(ad, bd, Gd, inclusive);
  s.backward(dS.to(on));
  auto f64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
  return {f64(s), f64(ad.grad()), f64(bd.grad()), f64(Gd.grad())};
}

}  // namespace

TEST(ChannelScoresGpu, MatchFloat64ReferenceWithGradients) {
  REQUIRE_FUSED_DECODE();
  const std::vector<ScoreCase> cases{{{2, 3}, 64, 32},  {{1, 4, 2}, 64, 96}, {{3}, 64, 256}, {{2, 2}, 48, 33},
                                     {{5}, 16, 1},      {{2, 1}, 5, 7},      {{1}, 64, 100}};
  for (const auto& c : cases)
    for (double gate_scale : {0.25, 4.0})
      for (bool inclusive : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "C " << c.C << " K " << c.K << (inclusive ? " inclusive" : " strict")
                                          << " gates x" << gate_scale);
        torch::manual_seed(c.C * 1000 + c.K + inclusive);
        auto shape = c.batch;
        shape.insert(shape.end(), {c.C, c.K});
        const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
        const auto a = torch::randn(shape, f64), b = torch::randn(shape, f64);
        // A chunk's cumulative log-decay: non-increasing, as the gated forms' gates make it, mild or strong.
        const auto G = (torch::log_sigmoid(torch::randn(shape, f64)) * gate_scale).cumsum(-2);
        auto s_shape = c.batch;
        s_shape.insert(s_shape.end(), {c.C, c.C});
        const auto dS = torch::randn(s_shape, f64);
        const auto want = scores_and_grads(a, b, G, dS, inclusive, f64);
        const auto got = scores_and_grads(a, b, G, dS, inclusive, gpu(torch::kFloat32));
        const double tol = tolerance(torch::kFloat32);
        EXPECT_LT(rel_err(got.s, want.s), tol) << "scores";
        EXPECT_LT(rel_err(got.da, want.da), tol) << "da";
        EXPECT_LT(rel_err(got.db, want.db), tol) << "db";
        EXPECT_LT(rel_err(got.dG, want.dG), tol) << "dG";
        // Outside the kept triangle the scores are exactly zero.
        const auto keep = torch::ones({c.C, c.C}, torch::kBool).tril(inclusive ? 0 : -1);
        EXPECT_EQ(got.s.masked_select(keep.logical_not()).abs().max().item<double>(), 0.0);
      }
}

TEST(ChannelScoresGpu, OptionOffKeepsTheLibtorchForm) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(3);
  const auto on = gpu(torch::kFloat32);
  const auto a = torch::randn({2, 64, 40}, on), b = torch::randn({2, 64, 40}, on);
  const auto G = (torch::log_sigmoid(torch::randn({2, 64, 40}, on)) / 4).cumsum(-2);
  torch::NoGradGuard no_grad;
  const auto kernel = ops::decayed_scores(a, b, G, true);
  DecodeOptions off;
  off.channel_scores = false;
  DecodeOptionsGuard guard(off);
  const auto libtorch = ops::decayed_scores(a, b, G, true);
  EXPECT_LT(rel_err(kernel, libtorch), tolerance(torch::kFloat32));
}

// The kernels on token rows (ops::decayed_scores_of_rows: q and k as the chunked forms hold them,
// [B, T, H, K] fp32 or bf16): scores and the gradients of a, b and G against the float64 chunk-layout
// form on the bf16-rounded values, lengths on and off the chunk (and one shorter than a chunk), chunk
// sizes 64 (the tensor-core kernels) and 16, a = b (KDA's strict scores of k with itself: the two
// gradients sum), and the option off (the chunk-layout copies) within the same tolerance. The scores
// and dG are fp32 (fp32's tolerance); da and db come in a's dtype (bf16's tolerance for bf16 rows).
TEST(ChannelScoresGpu, TokenRowsMatchTheChunkLayout) {
  REQUIRE_FUSED_DECODE();
  struct RowCase {
    int64_t B, T, H, K, C;
  };
  const std::vector<RowCase> cases{{2, 64 * 2 + 17, 3, 32, 64}, {1, 40, 2, 100, 64}, {2, 128, 2, 64, 64},
                                   {1, 50, 2, 33, 16}};
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  for (const auto& c : cases)
    for (auto dt : {torch::kFloat32, torch::kBFloat16})
      for (bool same : {false, true})
        for (bool rows_kernel : {true, false}) {
          SCOPED_TRACE(::testing::Message() << "T " << c.T << " K " << c.K << " C " << c.C << " " << dt
                                            << (same ? " a = b" : "") << (rows_kernel ? "" : " option off"));
          torch::manual_seed(c.T * 100 + c.K + same);
          const auto a = torch::randn({c.B, c.T, c.H, c.K}).to(dt).to(torch::kFloat64);
          const auto b = same ? a : torch::randn({c.B, c.T, c.H, c.K}).to(dt).to(torch::kFloat64);
          const auto g = torch::log_sigmoid(torch::randn({c.B, c.T, c.H, c.K}, f64)) / 2;
          const auto G = ops::chunk_cumulative_gate(g, c.B, c.T, c.H, c.C, torch::kFloat64, torch::kCPU);
          const int64_t N = G.size(2);
          const auto dS = torch::randn({c.B, c.H, N, c.C, c.C}, f64);
          // Scores and gradients of a, b and G (b's folded into a's where b is a), in float64.
          auto run = [&](const torch::TensorOptions& rows_on, const torch::TensorOptions& gate_on, bool rows) {
            auto ad = a.to(rows_on).detach().requires_grad_(true);
            auto bd = same ? ad : b.to(rows_on).detach().requires_grad_(true);
            auto Gd = G.to(gate_on).detach().requires_grad_(true);
            const auto s = rows ? ops::decayed_scores_of_rows(ad, bd, Gd, true)
                                : ops::decayed_scores(ops::to_chunks(ad, c.C, torch::kFloat64),
                                                      ops::to_chunks(bd, c.C, torch::kFloat64), Gd, true);
            s.backward(dS.to(s.options()));
            auto cpu64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
            return std::vector<Tensor>{cpu64(s), cpu64(ad.grad()), same ? Tensor() : cpu64(bd.grad()),
                                       cpu64(Gd.grad())};
          };
          const auto want = run(f64, f64, false);
          DecodeOptions options;
          options.channel_score_rows = rows_kernel;
          DecodeOptionsGuard guard(options);
          const auto got = run(gpu(dt), gpu(torch::kFloat32), true);
          const double tol = tolerance(torch::kFloat32), tol_rows = tolerance(dt);
          EXPECT_LT(rel_err(got[0], want[0]), tol) << "scores";
          EXPECT_LT(rel_err(got[1], want[1]), tol_rows) << "da";
          if (!same) {
            EXPECT_LT(rel_err(got[2], want[2]), tol_rows) << "db";
          }
          EXPECT_LT(rel_err(got[3], want[3]), tol) << "dG";
        }
}

// KDA's two scores in one pass (ops::score_row_pair_by_kernel: scale * scores(q, k) inclusive and
// scores(k, k) strict from q's and k's token rows): both against the float64 chunk-layout form on the
// rows' rounded values, at chunk 64 (the tensor-core kernel) and 16, lengths on and off the chunk, fp32
// and bf16 rows; and equal to the two passes of score_rows_by_kernel within fp32's tolerance. Their
// backward in one pass (ops::add_score_row_pair_backward), adding into random prior gradients: dq, dk and
// dG against the priors plus float64 autograd's, and against the two accumulating passes
// (add_score_rows_backward of each score) within the rows' tolerance (dq, dk) and fp32's (dG).
TEST(ChannelScoresGpu, ScoreRowPairMatchesTwoPasses) {
  REQUIRE_FUSED_DECODE();
  struct PairCase {
    int64_t B, T, H, K, C;
  };
  const std::vector<PairCase> cases{{2, 64 * 2 + 17, 3, 64, 64}, {1, 40, 2, 100, 64}, {2, 50, 2, 33, 16}};
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const double scale = 0.125;
  for (const auto& c : cases)
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.T << " K " << c.K << " C " << c.C << " " << dt);
      torch::manual_seed(c.T + c.K);
      const auto q = torch::randn({c.B, c.T, c.H, c.K}).to(dt).to(torch::kFloat64).requires_grad_(true);
      const auto k = torch::randn({c.B, c.T, c.H, c.K}).to(dt).to(torch::kFloat64).requires_grad_(true);
      const auto g = torch::log_sigmoid(torch::randn({c.B, c.T, c.H, c.K}, f64)) / 2;
      const auto G = ops::chunk_cumulative_gate(g, c.B, c.T, c.H, c.C, torch::kFloat64, torch::kCPU)
                         .detach()
                         .requires_grad_(true);
      const auto Kc = ops::to_chunks(k, c.C, torch::kFloat64);
      const auto want_qk = ops::decayed_scores(ops::to_chunks(q, c.C, torch::kFloat64), Kc, G, true) * scale;
      const auto want_kk = ops::decayed_scores(Kc, Kc, G, false);
      const auto d_qk = torch::randn_like(want_qk), d_kk = torch::randn_like(want_kk);
      ((want_qk * d_qk).sum() + (want_kk * d_kk).sum()).backward();
      // Prior gradients the backward adds to, rounded to the dtype they are held in.
      const auto prior_q = torch::randn_like(q).to(dt).to(torch::kFloat64);
      const auto prior_k = torch::randn_like(k).to(dt).to(torch::kFloat64);
      const auto prior_G = torch::randn_like(G).to(torch::kFloat32).to(torch::kFloat64);
      torch::NoGradGuard no_grad;
      const auto qg = q.detach().to(gpu(dt)), kg = k.detach().to(gpu(dt));
      const auto Gg = G.detach().to(gpu(torch::kFloat32)).contiguous();
      const auto [qk, kk] = ops::score_row_pair_by_kernel(qg, kg, Gg, scale);
      auto cpu64 = [](const Tensor& t) { return t.cpu().to(torch::kFloat64); };
      const double tol = tolerance(torch::kFloat32), tol_rows = tolerance(dt);
      EXPECT_LT(rel_err(cpu64(qk), want_qk.detach()), tol) << "scale scores(q, k)";
      EXPECT_LT(rel_err(cpu64(kk), want_kk.detach()), tol) << "scores(k, k)";
      EXPECT_LT(rel_err(qk, ops::score_rows_by_kernel(qg, kg, Gg, true, scale)), tol) << "against its own pass";
      EXPECT_LT(rel_err(kk, ops::score_rows_by_kernel(kg, kg, Gg, false)), tol) << "against its own pass";

      const auto d_qk_g = d_qk.to(gpu(torch::kFloat32)), d_kk_g = d_kk.to(gpu(torch::kFloat32));
      auto priors = [&] {
        return std::vector<Tensor>{prior_q.to(gpu(dt)), prior_k.to(gpu(dt)),
                                   prior_G.to(gpu(torch::kFloat32)).contiguous()};
      };
      const auto pair = priors();
      ops::add_score_row_pair_backward(qg, kg, Gg, d_qk_g, d_kk_g, pair[0], pair[1], pair[2], scale);
      const auto passes = priors();
      ops::add_score_rows_backward(qg, kg, Gg, true, d_qk_g, passes[0], passes[1], passes[2], scale);
      ops::add_score_rows_backward(kg, kg, Gg, false, d_kk_g, passes[1], passes[1], passes[2]);
      EXPECT_LT(rel_err(cpu64(pair[0]), prior_q + q.grad()), tol_rows) << "dq";
      EXPECT_LT(rel_err(cpu64(pair[1]), prior_k + k.grad()), tol_rows) << "dk";
      EXPECT_LT(rel_err(cpu64(pair[2]), prior_G + G.grad()), tol) << "dG";
      for (int i = 0; i < 3; ++i)
        EXPECT_LT(rel_err(cpu64(pair[i]), cpu64(passes[i])), i < 2 ? tol_rows : tol) << "against two passes, " << i;
    }
}

// GLA's chunked form (per-channel gates) through the kernels: output, final state and every
// gradient against the float64 recurrence, with an initial state and a length off the chunk; the
// score kernels inside the preparation's node (writing A_qk scaled) and, channel_score_rows off,
// as a node of their own on the chunk layout (A_qk scaled by the caller).
TEST(ChannelScoresGpu, GatedLinearChunkedGradientsMatchRecurrence) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  torch::manual_seed(5);
  const int64_t B = 2, T = 64 * 3 + 17, H = 2, K = 32, V = 48;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const auto q = torch::randn({B, T, H, K}, f64), k = torch::randn({B, T, H, K}, f64) / 4;
  const auto v = torch::randn({B, T, H, V}, f64);
  const auto g = torch::log_sigmoid(torch::randn({B, T, H, K}, f64)) / 8;
  const auto s0 = 0.5 * torch::randn({B, H, K, V}, f64);
  const auto d_o = torch::randn({B, T, H, V}, f64), d_final = torch::randn({B, H, K, V}, f64);
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  auto run = [&](const torch::TensorOptions& on, bool chunked) {
    std::vector<Tensor> in;
    for (const auto& t : {q, k, v, g, s0}) in.push_back(t.to(on).detach().requires_grad_(true));
    const auto r = chunked ? ops::gated_linear_chunked(in[0], in[1], in[2], in[3], scale, in[4], 64)
                           : ops::gated_linear_recurrent(in[0], in[1], in[2], in[3], scale, in[4]);
    torch::autograd::backward({r.o, r.final_state}, {d_o.to(on), d_final.to(on)});
    std::vector<Tensor> out{r.o.detach().cpu().to(torch::kFloat64), r.final_state.detach().cpu().to(torch::kFloat64)};
    for (const auto& t : in) out.push_back(t.grad().cpu().to(torch::kFloat64));
    return out;
  };
  const auto want = run(f64, false);
  for (bool rows_kernel : {true, false}) {
    SCOPED_TRACE(rows_kernel ? "scores inside the preparation" : "scores a node of their own");
    DecodeOptions options;
    options.channel_score_rows = rows_kernel;
    DecodeOptionsGuard guard(options);
    const auto got = run(gpu(torch::kFloat32), true);
    const char* names[] = {"o", "final state", "dq", "dk", "dv", "dg", "ds0"};
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_LT(rel_err(got[i], want[i]), tolerance(torch::kFloat32)) << names[i];
  }
}

// The chunk gate kernels (ops::chunk_cumulative_gate on CUDA in fp32): G and the gradient of g against
// the float64 libtorch form on the CPU, per channel and per head, lengths on and off the chunk (one
// shorter than a chunk), random gates and a random dG; g packed, a narrowed view (a wider token stride,
// as a slice of a projection) and a per-head gate broadcast over batch and tokens (stride 0, as RetNet's
// fixed decay), whose gradient is the sum over them; the option off keeps libtorch's form on CUDA.
TEST(ChannelScoresGpu, ChunkCumulativeGateMatchesFloat64WithGradient) {
  REQUIRE_FUSED_DECODE();
  struct GateCase {
    std::vector<int64_t> shape;  // [B, T, H] or [B, T, H, K]
    int64_t C;
  };
  const std::vector<GateCase> cases{{{2, 64 * 3 + 17, 3, 40}, 64}, {{1, 5, 2, 64}, 64}, {{2, 128, 4, 33}, 64},
                                    {{3, 130, 4}, 64},             {{2, 50, 3, 7}, 16}};
  for (const auto& c : cases)
    for (const char* layout : {"packed", "narrowed", "broadcast"})
      for (bool kernel : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "g " << torch::IntArrayRef(c.shape) << " C " << c.C << " " << layout
                                          << (kernel ? " kernel" : " libtorch"));
        torch::manual_seed(c.shape[1] * 10 + c.C);
        const int64_t B = c.shape[0], T = c.shape[1], H = c.shape[2];
        const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
        const bool broadcast = std::string(layout) == "broadcast";
        const auto g = torch::log_sigmoid(torch::randn(c.shape, f64));
        const int64_t N = (T + c.C - 1) / c.C, D = c.shape.size() == 4 ? c.shape[3] : 1;
        const auto dG = torch::randn({B, H, N, c.C, D}, f64);
        auto run = [&](const torch::TensorOptions& on) {
          auto leaf = (broadcast ? g[0][0] : g).to(on).detach().requires_grad_(true);
          const auto gate = broadcast ? leaf.expand(c.shape)
                            : std::string(layout) == "narrowed" ? torch::cat({leaf, leaf}, 2).narrow(2, 1, H)
                                                                : leaf;
          auto G = ops::chunk_cumulative_gate(gate, B, T, H, c.C, on.dtype().toScalarType(), leaf.device());
          G.backward(dG.to(on));
          return std::make_pair(G.detach().cpu().to(torch::kFloat64), leaf.grad().cpu().to(torch::kFloat64));
        };
        const auto want = run(f64);
        DecodeOptions options;
        options.chunk_gate = kernel;
        DecodeOptionsGuard guard(options);
        const auto got = run(gpu(torch::kFloat32));
        EXPECT_LT(rel_err(got.first, want.first), tolerance(torch::kFloat32)) << "G";
        EXPECT_LT(rel_err(got.second, want.second), tolerance(torch::kFloat32)) << "dg";
      }
}

// The chunked forms as the mixers call them in training: q, k and v column slices of one packed
// projection output [B, T, width] (rows wider than H K), which the preparation and score kernels read
// in place, against packed copies of the same values (which take the score kernels inside the
// preparation's autograd node, their gradients added where the preparation wrote q's, k's and G's, where
// the slices take them as nodes of their own): outputs, final states and every gradient equal up to the
// order of the kernels' sums and the roundings of the gradients' sums. GLA (additive, per-channel gate: the score
// kernels too), RetNet-like (additive, per-head gate), GDN-like (delta rule, per-head gate) and
// KDA-like (delta rule, per-channel gate), fp32 and bf16, a length off the chunk.
TEST(ChannelScoresGpu, ProjectionSlicesReadInPlace) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  const int64_t B = 2, T = 64 * 2 + 17, H = 2, K = 32, V = 48, width = 2 * H * K + H * V + 8;
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (bool delta : {false, true})
      for (bool per_channel : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dt << (delta ? " delta rule" : " additive")
                                          << (per_channel ? ", per-channel gate" : ", per-head gate"));
        torch::manual_seed(11 + 2 * delta + per_channel);
        const auto P = torch::randn({B, T, width}, gpu(dt)) / 2;
        const auto g = torch::log_sigmoid(torch::randn(per_channel ? std::vector<int64_t>{B, T, H, K}
                                                                   : std::vector<int64_t>{B, T, H},
                                                       gpu(torch::kFloat32))) / 8;
        const auto beta = torch::sigmoid(torch::randn({B, T, H}, gpu(torch::kFloat32)));
        const auto d_o = torch::randn({B, T, H, V}, gpu(dt));
        const auto d_final = torch::randn({B, H, K, V}, gpu(torch::kFloat32));
        const double scale = 1.0 / std::sqrt(static_cast<double>(K));
        // Outputs and the gradients of q, k, v (as one [B, T, H K + H K + H V] block) and g.
        auto run = [&](bool slices) {
          auto leaf = P.detach().clone().requires_grad_(true), gate = g.detach().clone().requires_grad_(true);
          auto part = [&](int64_t start, int64_t heads_dim, int64_t D) {
            auto slice = leaf.narrow(2, start, heads_dim);
            return (slices ? slice : slice.contiguous()).view({B, T, H, D});
          };
          const auto q = part(0, H * K, K), k = part(H * K, H * K, K), v = part(2 * H * K, H * V, V);
          if (slices) {
            EXPECT_TRUE(ops::token_rows_in_place(q) && !q.is_contiguous());
            EXPECT_TRUE(ops::token_rows_in_place(v) && !v.is_contiguous());
          }
          const auto r = delta ? ops::delta_rule_chunked(q, k, v, beta, gate, scale, Tensor(), 64)
                               : ops::gated_linear_chunked(q, k, v, gate, scale, Tensor(), 64);
          torch::autograd::backward({r.o, r.final_state}, {d_o, d_final});
          auto f64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
          return std::vector<Tensor>{f64(r.o), f64(r.final_state), f64(leaf.grad().narrow(2, 0, 2 * H * K + H * V)),
                                     f64(gate.grad())};
        };
        const auto want = run(false), got = run(true);
        const char* names[] = {"o", "final state", "dq, dk, dv", "dg"};
        for (size_t i = 0; i < want.size(); ++i)  // q's, k's and v's gradients in dt: its rounding of the sums
          EXPECT_LT(rel_err(got[i], want[i]), tolerance(i == 2 ? dt : torch::kFloat32)) << names[i];
      }
}
