// GPU (CTest label `gpu`): NSA's decode step with per-sequence positions (NSAImpl::step_at) on the
// fused sparse-attention kernel (the selection branch as one (sequence, kv head) row per
// attention, the window branch over a range of the cache) against the same step on the libtorch
// reference (fused decode off): both forms, 4 query heads per kv head, sequences before the
// first compressed block, at block completions and past the window; fp32 relative RMS error
// < 1e-5, bf16 < 5e-3, for the output and for what the step wrote into the state. Captured in a
// CUDA graph and replayed with new positions and tokens, the step equals the eager one. Skips where no CUDA GPU (or no CUDA kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/mixers/nsa.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

constexpr int64_t kBatch = 5, kMaxLen = 96;

// d 256, 8 query heads over 2 kv heads, head dim 64 (a sparse-attention kernel instance); blocks
// of 16 (compression stride 8 in the paper form), 4 selected blocks, window 32.
std::shared_ptr<NSAImpl> make_nsa(const std::string& form, torch::ScalarType dt) {
  auto cfg = lt2::testing::tiny_config("nsa");
  cfg.d_model = 256;
  cfg.n_heads = 8;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.mixer_options["nsa"] = json{{"form", form}, {"compress_block", 16}, {"compress_stride", form == "paper" ? 8 : 16},
                                  {"select_block", 16}, {"select_count", 4}, {"window", 32}, {"compress_hidden", 128}};
  torch::manual_seed(3);
  auto m = std::dynamic_pointer_cast<NSAImpl>(make_mixer("nsa", cfg, 0));
  m->to(torch::kCUDA, dt);
  m->eval();
  torch::NoGradGuard ng;
  m->wg->weight.normal_(0, 0.05);  // every branch contributes
  return m;
}

// A state with random caches (every row a sequence may read holds data).
std::unique_ptr<MixerState> random_state(const NSAImpl& m, torch::ScalarType dt, uint64_t seed) {
  auto s = m.make_state(kBatch, kMaxLen, gpu(dt));
  torch::manual_seed(seed);
  for (auto& t : s->tensors()) t.normal_(0.0, 1.0);
  return s;
}

void copy_state(const MixerState& from, MixerState& to) {
  auto a = from.tensors(), b = to.tensors();
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

// Positions: 0 (no compressed block yet), 15, 63 and 95 (a block completes: p + 1 - 16 a multiple
// of the stride), 40 (mid-block); all but 0 and 15 past the window.
Tensor positions() { return torch::tensor({0L, 15L, 63L, 95L, 40L}, torch::TensorOptions().device(torch::kCUDA)); }

}  // namespace

TEST(FusedNsa, StepMatchesReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  torch::NoGradGuard ng;
  for (const std::string form : {"paper", "simplified"}) {
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(form + " " + name(dt));
      auto m = make_nsa(form, dt);
      auto fused = random_state(*m, dt, 7), reference = random_state(*m, dt, 7);
      auto& s = dynamic_cast<NSAState&>(*fused);
      // The folded selection rows and the window take the kernel.
      const int64_t G = m->n_heads / m->n_kv_heads;
      ASSERT_TRUE(ops::sparse_attention_decode_supported(torch::empty({kBatch * m->n_kv_heads, G, 64}, gpu(dt)),
                                                         s.k[0].view({kBatch * m->n_kv_heads, 1, kMaxLen, 64}),
                                                         s.v[0].view({kBatch * m->n_kv_heads, 1, kMaxLen, 64})));
      ASSERT_TRUE(ops::sparse_attention_decode_supported(torch::empty({kBatch, m->n_heads, 64}, gpu(dt)), s.k[0], s.v[0]));
      torch::manual_seed(9);
      auto x = torch::randn({kBatch, 1, 256}, gpu(dt));
      const Positions pos(0, 0, positions());
      auto got = m->step(x, pos, *fused);
      auto want = [&] {
        FusedDecode off(false);
        return m->step(x, pos, *reference);
      }();
      EXPECT_LT(rel_err(got, want), tolerance(dt));
      // The state updates (cache rows, compressed blocks) come from the projections, on the fused
      // GEMV in one step and on cuBLAS in the other: what each step wrote (the state less the
      // random one it started from) agrees to the kernel tolerance.
      const auto initial = random_state(*m, dt, 7);
      auto a = fused->tensors(), b = reference->tensors(), before = initial->tensors();
      for (size_t i = 0; i < a.size(); ++i) {
        const auto start = before[i].to(torch::kFloat64);
        EXPECT_LT(rel_err(a[i].to(torch::kFloat64) - start, b[i].to(torch::kFloat64) - start), tolerance(dt))
            << "state tensor " << i;
      }
    }
  }
}

#ifdef LT2_WITH_CUDA

// No host read of the positions: a graph captured at one set of positions replays at others.
TEST(FusedNsa, GraphReplayWithNewPositions) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard ng;
  for (const std::string form : {"paper", "simplified"}) {
    SCOPED_TRACE(form);
    const auto dt = torch::kBFloat16;
    auto m = make_nsa(form, dt);
    auto graphed = random_state(*m, dt, 5), eager = random_state(*m, dt, 5);
    auto x = torch::randn({kBatch, 1, 256}, gpu(dt));
    auto p = positions();
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    m->step(x, Positions(0, 0, p), *graphed);  // warm-up (library handles, kernel attributes)
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    auto out = m->step(x, Positions(0, 0, p), *graphed);
    graph.capture_end();
    for (int replay = 0; replay < 3; ++replay) {
      copy_state(*graphed, *eager);
      x.copy_(torch::randn({kBatch, 1, 256}, gpu(dt)));
      p.copy_(torch::randint(kMaxLen, {kBatch}, p.options()));
      graph.replay();
      auto want = m->step(x, Positions(0, 0, p), *eager);
      torch::cuda::synchronize();
      EXPECT_LT(rel_err(out, want), 1e-6) << "replay " << replay;
      auto a = graphed->tensors(), b = eager->tensors();
      for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(rel_err(a[i], b[i]), 1e-6) << "replay " << replay << ", state " << i;
    }
  }
}

#endif  // LT2_WITH_CUDA
