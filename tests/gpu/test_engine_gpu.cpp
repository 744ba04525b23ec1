// GPU (CTest label `gpu`): the inference engine on CUDA. Mixed-length decode through captured
// CUDA graphs and the fused kernels equals each sequence's plain forward, for every preset family
// at a small size; graph replay equals the eager step on the same state; the decode plan fuses
// every application of the 1.3B presets' layer shapes and decodes as accurately as the forward.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include "common/engine_testing.h"
#include "lt2/config/presets.h"

using namespace lt2;
using lt2::testing::make_test_model;
using lt2::testing::rel_err;
using lt2::testing::tiny_config;


namespace {

// The preset families of `lt2 bench` at a small size: full attention (LT), GDN, Full+GDN,
// GDN+DSA (latent KV, top-k below the context), GDN+NSA (paper form: separate K/V per branch,
// MLP compression; blocks, selection and window below the context), Ouro. Head dims 64 so the
// fused attention runs.
struct Family {
  std::string name, pattern;
  ModelForm form;
};
std::vector<Family> families() {
  return {{"lt", "full", ModelForm::LT2},
          {"lt2-gdn", "gdn", ModelForm::LT2},
          {"lt2-full-gdn", "interleaved:1:1:gdn:full", ModelForm::LT2},
          {"lt2-gdn-dsa", "interleaved:1:1:gdn:dsa", ModelForm::LT2},
          {"lt2-gdn-nsa", "interleaved:1:1:gdn:nsa", ModelForm::LT2},
          {"ouro", "full", ModelForm::Ouro}};
}

ModelConfig family_config(const Family& f) {
  auto cfg = tiny_config(f.pattern, f.form);
  cfg.d_model = 128;
  cfg.n_heads = 2;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.ffn_hidden = 128;
  cfg.mixer_options["gdn"] = json{{"chunk_size", 8}};
  cfg.mixer_options["dsa"] = json{{"topk", 6}, {"index_heads", 2}, {"index_head_dim", 16}, {"attention", "latent"},
                                  {"latent_dim", 32}, {"latent_rope_dim", 8}};
  cfg.mixer_options["nsa"] = json{{"form", "paper"}, {"compress_block", 8}, {"compress_stride", 4},
                                  {"select_block", 8}, {"select_count", 2}, {"local_blocks", 1}, {"window", 6},
                                  {"compress_hidden", 64}};
  return cfg;
}

// make_test_model on the GPU, in eval mode.
LoopedLM cuda_test_model(const ModelConfig& cfg, uint64_t seed, torch::ScalarType dtype) {
  auto m = make_test_model(cfg, seed, dtype);
  m->to(torch::kCUDA);
  m->eval();
  return m;
}

}  // namespace

TEST(EngineGpu, MixedLengthGraphDecodeEqualsForwardFp32) {
  REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (const auto& f : families()) {
    SCOPED_TRACE(f.name);
    auto m = make_test_model(family_config(f), 1, torch::kFloat32);
    m->to(torch::kCUDA);
    EngineOptions eo;
    eo.max_batch = 4;
    eo.max_len = 40;
    eo.prefill_chunk = 7;
    // 3 live sequences: bucket 4 with one padding slot; lengths straddle the DSA top-k.
    lt2::testing::expect_engine_matches_per_sequence(m, eo, {3, 17, 9}, 5, 2e-5);
  }
}

namespace {

// bf16: the engine (graphs, fused kernels, bf16 states and caches) must be about as accurate as
// the bf16 forward pass, both measured against the fp32 forward of the same weights.
void expect_bf16_engine_as_accurate_as_forward(const ModelConfig& cfg, int64_t max_len) {
  torch::NoGradGuard ng;
  auto m32 = cuda_test_model(cfg, 2, torch::kFloat32);
  auto m16 = cuda_test_model(cfg, 2, torch::kBFloat16);
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_len = max_len;
  Engine engine(m16, eo);
  torch::manual_seed(8);
  const int64_t V = m32->config().vocab_size;
  std::vector<torch::Tensor> seqs{torch::randint(V, {12}, torch::kLong), torch::randint(V, {5}, torch::kLong)};
  for (int64_t s = 0; s < 2; ++s) engine.prefill(s, seqs[s]);
  for (int step = 0; step < 4; ++step) {
    auto next = torch::randint(V, {2}, torch::kLong);
    auto got = engine.decode(next).cpu().to(torch::kFloat64);
    for (int64_t s = 0; s < 2; ++s) {
      seqs[s] = torch::cat({seqs[s], next.narrow(0, s, 1)});
      auto tok = seqs[s].cuda().view({1, -1});
      auto exact = m32->forward(tok).logits[0][-1].cpu();
      const double forward_err = rel_err(m16->forward(tok).logits[0][-1].cpu(), exact);
      const double engine_err = rel_err(got[s], exact);
      EXPECT_LT(engine_err, 2 * forward_err + 2e-3)
          << "step " << step << ", slot " << s << ": bf16 forward error " << forward_err;
    }
  }
}

}  // namespace

// DSA and NSA are left out here: their top-k selections flip where bf16 rounding reorders close
// scores (a discontinuity of the method, not an error); their bf16 engines are covered by graph ==
// eager below (and NSA's fused step by tests/gpu/fused_nsa_test.cpp).
TEST(EngineGpu, Bf16DecodeAsAccurateAsBf16Forward) {
  REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (const auto& f : families()) {
    if (f.pattern.find("dsa") != std::string::npos || f.pattern.find("nsa") != std::string::npos) continue;
    SCOPED_TRACE(f.name);
    expect_bf16_engine_as_accurate_as_forward(family_config(f), 32);
  }
}

namespace {

// A 1.3B preset's layer shapes (width, heads, head dims, FFN, DSA's latent dims and top-k) with
// one period of its layer pattern (interleaved 4:1: four GDN layers and one attention layer), two
// loops and a small vocabulary.
ModelConfig preset_shapes(const std::string& preset) {
  auto cfg = load_model_config(preset);
  cfg.n_layers = 5;
  cfg.n_loops = 2;
  cfg.vocab_size = 512;
  return cfg;
}

}  // namespace

// The decode plan the engine compiles fuses every (loop, layer) application of the LT2 1.3B
// presets' shapes in bf16 at batch 1 and 8 (GDN, full attention, latent DSA with its top-k below
// the cache), and decoding through it is about as accurate as the bf16 forward. DSA is in: its
// top-k (2048) covers every key of these short sequences, so no selection can flip.
TEST(EngineGpu, DecodePlanFusesThe13BPresetShapes) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  const int64_t max_len = 2100;  // above DSA's top-k, as at long contexts
  for (const std::string preset : {"lt-1.3b", "lt2-gdn-1.3b", "lt2-full-gdn-1.3b", "lt2-gdn-dsa-1.3b"}) {
    SCOPED_TRACE(preset);
    const auto cfg = preset_shapes(preset);
    {
      torch::NoGradGuard ng;
      auto m = cuda_test_model(cfg, 5, torch::kBFloat16);
      EngineOptions eo;
      eo.max_batch = 8;
      eo.max_len = max_len;
      eo.cuda_graphs = false;
      Engine engine(m, eo);
      for (int64_t n : {1, 8}) {
        const auto& plan = engine.decode_plan(n);
        EXPECT_EQ(plan.size(), cfg.n_layers * cfg.n_loops);
        EXPECT_EQ(plan.fused_count(), plan.size()) << "batch " << n << ": " << plan.describe();
      }
    }
    expect_bf16_engine_as_accurate_as_forward(cfg, max_len);
  }
}

// Ouro's sandwich norm leaves nothing for the plan to fold: every application runs its block
// (whose attention step still takes the fused kernels).
TEST(EngineGpu, DecodePlanRunsOuroBlocksUnfused) {
  REQUIRE_FUSED_DECODE();
  auto m = cuda_test_model(family_config({"ouro", "full", ModelForm::Ouro}), 1, torch::kBFloat16);
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_len = 16;
  eo.cuda_graphs = false;
  Engine engine(m, eo);
  EXPECT_EQ(engine.decode_plan(2).fused_count(), 0) << engine.decode_plan(2).describe();
}

namespace {

// An engine decoding through captured graphs and one decoding eagerly, their states filled alike:
// four decode steps give the same logits and leave the same states (1e-6).
void expect_graph_replay_equals_eager(LoopedLM& m) {
  EngineOptions graphs, eager;
  graphs.max_batch = eager.max_batch = 3;
  graphs.max_len = eager.max_len = 24;
  eager.cuda_graphs = false;
  Engine a(m, graphs), b(m, eager);
  ASSERT_TRUE(a.graphs_captured());
  ASSERT_FALSE(b.graphs_captured());
  a.fill_random(10, 5);
  b.fill_random(10, 5);
  for (int step = 0; step < 4; ++step) {
    auto tok = torch::randint(m->config().vocab_size, {3}, torch::kLong);
    auto la = a.decode(tok).cpu(), lb = b.decode(tok).cpu();
    EXPECT_LT(rel_err(la, lb), 1e-6) << "step " << step;
  }
  for (size_t i = 0; i < a.state().mixers.size(); ++i) {
    auto ta = a.state().mixers[i]->tensors(), tb = b.state().mixers[i]->tensors();
    for (size_t j = 0; j < ta.size(); ++j) EXPECT_LT(rel_err(ta[j].cpu(), tb[j].cpu()), 1e-6) << "state " << i;
  }
}

}  // namespace

TEST(EngineGpu, GraphReplayEqualsEagerStep) {
  REQUIRE_CUDA();
  for (const auto& f : families())
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(f.name + (dt == torch::kBFloat16 ? " bf16" : " fp32"));
      auto m = cuda_test_model(family_config(f), 3, dt);
      expect_graph_replay_equals_eager(m);
    }
}

namespace {

// Two engines over `m` (fp32, no graphs), their states filled alike with `filled` random tokens:
// three decode steps with the fused kernels on and off give the same logits (2e-5).
void expect_fused_matches_reference(LoopedLM& m, int64_t batch, int64_t max_len, int64_t filled, uint64_t seed) {
  EngineOptions eo;
  eo.max_batch = batch;
  eo.max_len = max_len;
  eo.cuda_graphs = false;
  EngineOptions ro = eo;
  ro.decode.fused = false;
  Engine fused(m, eo), reference(m, ro);
  fused.fill_random(filled, seed);
  reference.fill_random(filled, seed);
  for (int step = 0; step < 3; ++step) {
    auto tok = torch::randint(m->config().vocab_size, {batch}, torch::kLong);
    auto lf = fused.decode(tok).cpu();
    auto lr = reference.decode(tok).cpu();
    EXPECT_LT(rel_err(lf, lr), 2e-5) << "step " << step;
  }
}

}  // namespace

TEST(EngineGpu, FusedAndReferenceDecodeAgree) {
  REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (const auto& f : families()) {
    SCOPED_TRACE(f.name);
    auto m = cuda_test_model(family_config(f), 4, torch::kFloat32);
    expect_fused_matches_reference(m, /*batch=*/2, /*max_len=*/24, /*filled=*/11, /*seed=*/9);
  }
}

// The fused DSA decode (indexer scores, top-k select, sparse attention over the selected latent
// rows) runs only where the sparse-attention kernel has an instance: the preset's latent 512 + 64
// dims. At them, the fp32 engine decodes like the libtorch reference, with the top-k (6) well
// below the context so the selection matters.
namespace {

// GDN + DSA at the preset's latent dims (512 + 64), where the fused DSA decode runs.
ModelConfig fused_dsa_config() {
  auto cfg = family_config({"lt2-gdn-dsa", "interleaved:1:1:gdn:dsa", ModelForm::LT2});
  cfg.mixer_options["dsa"] = json{{"topk", 6}, {"index_heads", 16}, {"index_head_dim", 64}, {"attention", "latent"},
                                  {"latent_dim", 512}, {"latent_rope_dim", 64}};
  return cfg;
}

}  // namespace

TEST(EngineGpu, FusedDsaDecodeAgreesWithReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  auto m = cuda_test_model(fused_dsa_config(), 4, torch::kFloat32);
  expect_fused_matches_reference(m, /*batch=*/3, /*max_len=*/40, /*filled=*/23, /*seed=*/5);
}

// The fused DSA decode (positions read on the device) replayed from a graph equals the eager step.
TEST(EngineGpu, FusedDsaGraphReplayEqualsEagerStep) {
  REQUIRE_FUSED_DECODE();
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(dt == torch::kBFloat16 ? "bf16" : "fp32");
    auto m = cuda_test_model(fused_dsa_config(), 3, dt);
    expect_graph_replay_equals_eager(m);
  }
}


// A batch whose state cannot fit the device is refused before anything is allocated, with the
// number of rows that would fit; the device is usable afterwards.
TEST(EngineGpu, BatchBeyondDeviceMemoryIsRefusedWithWhatFits) {
  REQUIRE_CUDA();
  auto m = make_test_model(family_config(families()[0]), 1, torch::kBFloat16);
  m->to(torch::kCUDA);
  m->eval();
  EngineOptions eo;
  eo.max_batch = 4096;
  eo.max_len = 1 << 20;  // ~1 GiB of KV cache a row: ~4 TiB in all
  try {
    Engine engine(m, eo);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rows fit: lower the batch or the context"), std::string::npos) << e.what();
  }
  eo.max_batch = 2;
  eo.max_len = 64;
  Engine small(m, eo);
  EXPECT_EQ(small.decode(torch::tensor({1, 2}, torch::kLong)).size(0), 2);
}
