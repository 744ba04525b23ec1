// The inference engine on the CPU: mixed-length batches decode like each sequence alone, the
// decode plan steps like the plain decode, the memory planner counts exactly what is allocated,
// and wrong use gets a clear error.
#include <gtest/gtest.h>

#include <cmath>

#include "common/engine_testing.h"
#include "lt2/infer/bench.h"
#include "lt2/infer/memory_plan.h"
#include "lt2/mixers/dsa.h"
#include "lt2/mixers/full_attention.h"
#include "lt2/mixers/registry.h"
#include "mixers/mixer_testing.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"

using namespace lt2;
using lt2::testing::make_test_model;
using lt2::testing::tiny_config;

namespace {

ModelConfig engine_config(const std::string& pattern, ModelForm form = ModelForm::LT2) {
  auto cfg = tiny_config(pattern, form);
  cfg.mixer_options["gdn"] = json{{"chunk_size", 4}};
  cfg.mixer_options["dsa"] = json{{"topk", 4}, {"index_heads", 2}, {"index_head_dim", 8}};
  cfg.mixer_options["window"] = json{{"window", 3}, {"windows", {2, 4, 0}}};  // per loop; 0 = full
  // Blocks of 4 (compression stride 2), 2 selected blocks, window 3: a few tokens cross them all.
  cfg.mixer_options["nsa"] = json{{"form", "paper"}, {"compress_block", 4}, {"compress_stride", 2},
                                  {"select_block", 4}, {"select_count", 2}, {"local_blocks", 1},
                                  {"window", 3}, {"compress_hidden", 8}};
  return cfg;
}

// Full attention that declines per-sequence positions: stands in for a mixer the engine refuses.
struct FixedStartAttention : FullAttentionImpl {
  explicit FixedStartAttention(const ModelConfig& cfg) : FullAttentionImpl(cfg) { caps_.seq_pos = false; }
  std::string kind() const override { return "fixed-start"; }
};

}  // namespace

// Hybrids; each registered mixer alone runs the same check in tests/mixers/test_mixer_invariants.cpp.
TEST(Engine, MixedLengthBatchDecodesLikeEachSequenceAlone) {
  // Prompt lengths around the DSA top-k (4) and the GDN chunk (4); prefill in chunks of 3.
  for (const std::string pattern :
       {"interleaved:1:1:gdn:full", "interleaved:1:1:gdn:dsa", "interleaved:1:1:gdn:window"}) {
    SCOPED_TRACE(pattern);
    EngineOptions eo;
    eo.max_batch = 3;
    eo.max_len = 16;
    eo.prefill_chunk = 3;
    lt2::testing::expect_engine_matches_per_sequence(make_test_model(engine_config(pattern)), eo, {2, 7, 5}, 4,
                                                     1e-10);
  }
}

TEST(Engine, NsaMixedLengthBatch) {
  // Both forms (paper: separate K/V per branch; simplified: one shared K/V) with mean and MLP
  // compression; prompts and decoded lengths cross compression blocks (4, stride 2 or 4),
  // selection blocks (4, two selected) and the window (3).
  for (const std::string form : {"paper", "simplified"}) {
    for (const std::string compression : {"mean", "mlp"}) {
      SCOPED_TRACE(form + " " + compression);
      auto cfg = engine_config("interleaved:1:1:gdn:nsa");
      cfg.mixer_options["nsa"]["form"] = form;
      cfg.mixer_options["nsa"]["compression"] = compression;
      if (form == "simplified") cfg.mixer_options["nsa"]["compress_stride"] = 4;
      EngineOptions eo;
      eo.max_batch = 3;
      eo.max_len = 16;
      eo.prefill_chunk = 3;
      lt2::testing::expect_engine_matches_per_sequence(make_test_model(cfg), eo, {2, 9, 5}, 5, 1e-10);
    }
  }
}

TEST(Engine, LatentDsaMixedLengthBatch) {
  // DSA's shared latent KV (keys [c | k_r], values c) with the top-k below the longer prompts.
  auto cfg = engine_config("interleaved:1:1:gdn:dsa");
  cfg.mixer_options["dsa"] = json{{"topk", 4}, {"index_heads", 2}, {"index_head_dim", 8}, {"attention", "latent"},
                                  {"latent_dim", 8}, {"latent_rope_dim", 4}};
  EngineOptions eo;
  eo.max_batch = 3;
  eo.max_len = 16;
  lt2::testing::expect_engine_matches_per_sequence(make_test_model(cfg), eo, {3, 8, 1}, 4, 1e-10);
}

TEST(Engine, OuroMixedLengthBatch) {
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_len = 12;
  lt2::testing::expect_engine_matches_per_sequence(make_test_model(engine_config("full", ModelForm::Ouro)), eo,
                                                   {6, 1}, 3, 1e-10);
}

namespace {

// A decode step at per-sequence positions through a plan compiled for one state, and the plain
// step on an equal state: the same logits and the same states after, bit for bit. The plan is
// returned for its report.
DecodePlan expect_plan_steps_like_plain_decode(LoopedLM m) {
  torch::NoGradGuard ng;
  m->eval();
  m->pack_for_inference();
  const int64_t B = 2, L = 12;
  std::vector<std::unique_ptr<ModelState>> states;
  for (int i = 0; i < 2; ++i) {
    states.push_back(m->make_state(B, L, torch::TensorOptions().dtype(torch::kFloat64)));
    torch::manual_seed(7);
    for (auto& s : states.back()->mixers)
      for (auto& t : s->tensors()) t.normal_(0.0, 0.1);
  }
  auto plan = m->compile_decode_plan(*states[0]);
  EXPECT_EQ(plan.size(), static_cast<int64_t>(states[0]->mixers.size()));
  ForwardOptions plain;
  plain.seq_pos = torch::tensor({3L, 8L});
  ForwardOptions planned = plain;
  planned.decode_plan = &plan;
  const auto tokens = torch::tensor({5L, 11L}).view({B, 1});
  const auto got = m->forward(tokens, states[0].get(), planned).logits;
  const auto want = m->forward(tokens, states[1].get(), plain).logits;
  EXPECT_TRUE(torch::equal(got, want)) << "logits differ by " << lt2::testing::rel_err(got, want);
  for (size_t i = 0; i < states[0]->mixers.size(); ++i) {
    const auto a = states[0]->mixers[i]->tensors(), b = states[1]->mixers[i]->tensors();
    for (size_t j = 0; j < a.size(); ++j) EXPECT_TRUE(torch::equal(a[j], b[j])) << "state " << i << " tensor " << j;
  }
  return plan;
}

}  // namespace

// Every registered mixer that decodes with per-sequence positions, and the model forms and
// patterns around them (Ouro's sandwich norm and exit gate, a hybrid, random slots with vote
// draws): the plan's applications line up with the model's (loop, layer) states. On the CPU no
// mixer has a fused form (the fused kernels are CUDA's), so the plan says every application runs
// its block; tests/gpu/test_engine_gpu.cpp checks what it fuses on a GPU.
TEST(DecodePlan, StepsLikeThePlainDecodeForEveryMixer) {
  for (const auto& v : lt2::testing::mixer_variants()) {
    SCOPED_TRACE(v.label);
    auto m = make_test_model(lt2::testing::variant_config(v));
    if (!m->mixers()[0]->caps().seq_pos) continue;
    const auto plan = expect_plan_steps_like_plain_decode(m);
    EXPECT_EQ(plan.fused_count(), 0);
    EXPECT_EQ(plan.describe(), cat("0/", plan.size(), " applications fused (", v.name, " 0/", plan.size(), ")"));
  }
  for (const auto& [pattern, form] : {std::pair{"full", ModelForm::Ouro}, std::pair{"interleaved:1:1:gdn:full", ModelForm::LT2},
                                      std::pair{"random:1:1", ModelForm::LT2}}) {
    SCOPED_TRACE(pattern);
    expect_plan_steps_like_plain_decode(make_test_model(engine_config(pattern, form)));
  }
}

TEST(DecodePlan, TheEngineCompilesOnePerBucket) {
  auto m = make_test_model(engine_config("interleaved:1:1:gdn:full"));
  m->eval();
  EngineOptions eo;
  eo.max_batch = 4;
  eo.max_len = 8;
  Engine engine(m, eo);
  const auto& cfg = m->config();
  for (int64_t n = 1; n <= 4; ++n) {
    const auto& plan = engine.decode_plan(n);
    EXPECT_EQ(plan.state().batch, n == 3 ? 4 : n) << "the bucket of " << n << " sequences";
    EXPECT_EQ(plan.size(), cfg.n_loops * cfg.n_layers);
    EXPECT_EQ(plan.describe(), "0/6 applications fused (gdn 0/3, full 0/3)");
  }
}

TEST(Engine, FewerSequencesThanSlotsUseASmallerBucket) {
  // Two live sequences in a 4-slot engine decode through bucket 2 (1, 2, 4 are the buckets).
  EngineOptions eo;
  eo.max_batch = 4;
  eo.max_len = 12;
  auto m = make_test_model(engine_config("interleaved:1:1:gdn:full"));
  m->eval();
  Engine probe(m, eo);
  EXPECT_EQ(probe.buckets(), (std::vector<int64_t>{1, 2, 4}));
  lt2::testing::expect_engine_matches_per_sequence(m, eo, {4, 2}, 3, 1e-10);
}

TEST(Engine, ClearErrors) {
  auto m = make_test_model(engine_config("full"));
  m->eval();
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_len = 4;
  Engine engine(m, eo);
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { engine.prefill(2, torch::zeros({2}, torch::kLong)); }, "slot 2");
  expect_error([&] { engine.prefill(0, torch::zeros({5}, torch::kLong)); }, "max_len");
  expect_error([&] { engine.decode(torch::zeros({3}, torch::kLong)); }, "max_batch");
  expect_error([&] { engine.decode_plan(3); }, "bucket");
  engine.prefill(0, torch::zeros({4}, torch::kLong));
  expect_error([&] { engine.decode(torch::zeros({1}, torch::kLong)); }, "full");
  auto fixed = make_test_model(engine_config("full"));
  fixed->eval();
  fixed->layers[1]->as<BlockImpl>()->mixer = std::make_shared<FixedStartAttention>(fixed->config());
  expect_error([&] { Engine e(fixed, eo); }, "'fixed-start'");
}

TEST(Engine, FillRandomDeclaresTheContext) {
  auto m = make_test_model(engine_config("interleaved:1:1:gdn:dsa"));
  m->eval();
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_len = 20;
  Engine engine(m, eo);
  engine.fill_random(10, 1);
  EXPECT_EQ(engine.length(0), 10);
  EXPECT_EQ(engine.length(1), 10);
  auto logits = engine.decode(torch::tensor({1, 2}, torch::kLong));
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
  EXPECT_EQ(engine.length(1), 11);
}

// A hybrid; each registered mixer alone runs the same check in tests/mixers/test_mixer_invariants.cpp.
TEST(MemoryPlan, StateBytesEqualWhatIsAllocated) {
  const std::string pattern = "interleaved:1:1:gdn:full";
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto m = make_test_model(engine_config(pattern), 1, dtype);
    const int64_t batch = 3, max_len = 17;
    auto plan = plan_memory(*m, batch, max_len, dtype, 8, 5);
    auto state = m->make_state(batch, max_len, torch::TensorOptions().dtype(dtype));
    int64_t allocated = 0;
    for (const auto& s : state->mixers)
      for (const auto& t : s->tensors()) allocated += t.nbytes();
    EXPECT_EQ(plan.state_bytes, allocated) << pattern;
    int64_t weights = 0;
    for (const auto& p : m->parameters()) weights += p.nbytes();
    EXPECT_EQ(plan.weight_bytes, weights) << pattern;
    EXPECT_GT(plan.workspace_bytes, 0);
  }
}

// The serve start-up's batch cap: the most rows whose state and workspace fit, found by search,
// agrees with the plan row by row; none fit in a few bytes.
TEST(MemoryPlan, MaxRowsThatFitIsTheLargestBatchThePlanFits) {
  auto m = make_test_model(engine_config("interleaved:1:1:gdn:full"), 1, torch::kFloat32);
  const int64_t max_len = 64, chunk = 16;
  const auto need = [&](int64_t rows) {
    const auto p = plan_memory(*m, rows, max_len, torch::kFloat32, chunk, max_len);
    return p.state_bytes + p.workspace_bytes;
  };
  for (int64_t rows : {1, 5, 37}) {
    // The least memory in which `rows` fit (fits_in's margin: 5% + 1 GiB).
    const auto available = static_cast<int64_t>(std::ceil(double(need(rows) + (int64_t(1) << 30)) / 0.95));
    ASSERT_TRUE(fits_in(need(rows), available));
    ASSERT_FALSE(fits_in(need(rows + 1), available));
    EXPECT_EQ(max_rows_that_fit(*m, max_len, torch::kFloat32, chunk, available), rows);
  }
  EXPECT_EQ(max_rows_that_fit(*m, max_len, torch::kFloat32, chunk, 1000), 0);
}

// DSA's inference forward makes dense index logits, then attention scores, over every key in
// blocks of query rows, with every row's top-k mask: the prefill workspace holds the larger block
// and the mask (a bool per score); smaller blocks, a smaller workspace.
TEST(MemoryPlan, DsaPrefillWorkspaceHoldsOneQueryBlock) {
  const int64_t max_len = 64, chunk = 16;
  auto full = make_test_model(engine_config("full"), 1, torch::kFloat32);
  auto dsa = make_test_model(engine_config("dsa"), 1, torch::kFloat32);
  auto mixer = std::dynamic_pointer_cast<DSAImpl>(dsa->mixers()[0]);
  ASSERT_TRUE(mixer);
  const auto workspace = [&](LoopedLMImpl& m) {
    return plan_memory(m, 1, max_len, torch::kFloat32, chunk, 0).workspace_bytes;
  };
  const int64_t whole = mixer->prefill_workspace_bytes(1, chunk, max_len);  // every row in one block
  EXPECT_EQ(workspace(*dsa), workspace(*full) + whole);
  for (const auto& m : dsa->mixers()) std::dynamic_pointer_cast<DSAImpl>(m)->query_block_bytes = 1;  // a row a block
  const int64_t one_row = mixer->prefill_workspace_bytes(1, chunk, max_len);
  EXPECT_LT(one_row, whole);
  EXPECT_GT(one_row, chunk * max_len) << "a row's scores beside every row's mask";
  EXPECT_EQ(workspace(*dsa), workspace(*full) + one_row);
}

TEST(MemoryPlan, DecodeBytesCountWeightsPerLoopAndTheCache) {
  // Full attention: every stack weight once per loop, the head once, one embedding row per
  // sequence, and K and V of context + 1 tokens per (layer, loop).
  auto cfg = engine_config("full");
  auto m = make_test_model(cfg, 1, torch::kFloat32);
  const int64_t B = 2, C = 9;
  auto plan = plan_memory(*m, B, 32, torch::kFloat32, 8, C);
  const int64_t emb = cfg.vocab_size * cfg.d_model, params = m->num_parameters();
  const int64_t head = cfg.tie_embeddings ? emb : emb;  // untied: its own V x d matrix
  const int64_t stack = params - emb - (cfg.tie_embeddings ? 0 : head);
  const int64_t cache = cfg.n_loops * cfg.n_layers * 2 * B * cfg.kv_heads() * (C + 1) * cfg.dim_head();
  EXPECT_EQ(plan.decode_step_bytes, 4 * (stack * cfg.n_loops + head + B * cfg.d_model + cache));
  EXPECT_FALSE(fits_in(plan.total_bytes(), plan.total_bytes()));  // the margin is required
  EXPECT_TRUE(fits_in(plan.total_bytes(), plan.total_bytes() * 2 + (int64_t(2) << 30)));
}

TEST(MemoryPlan, NsaDecodeBytesCountTheRowsEachBranchReads) {
  // Per (layer, loop): K and V of every compressed block, and of each K/V set the rows its
  // branches read, at most the context + 1 = 7 tokens held: l = 4 compressed, min(n l', 7) = 7
  // selected, w = 3 in the window. The paper form has a K/V set per branch; the simplified form
  // one set for all three (7 rows).
  for (const std::string form : {"paper", "simplified"}) {
    SCOPED_TRACE(form);
    auto cfg = engine_config("nsa");
    cfg.mixer_options["nsa"]["form"] = form;
    const int64_t stride = form == "paper" ? 2 : 4;
    cfg.mixer_options["nsa"]["compress_stride"] = stride;
    auto m = make_test_model(cfg, 1, torch::kFloat32);
    const int64_t B = 2, max_len = 32, C = 6;
    auto plan = plan_memory(*m, B, max_len, torch::kFloat32, 8, C);
    const int64_t emb = cfg.vocab_size * cfg.d_model;
    const int64_t stack = m->num_parameters() - emb - (cfg.tie_embeddings ? 0 : emb);
    const int64_t row = B * cfg.kv_heads() * cfg.dim_head();  // K or V of one token, all sequences
    const int64_t rows = nsa_num_blocks(max_len, 4, stride) + (form == "paper" ? 4 + 7 + 3 : 7);
    const int64_t states = cfg.n_loops * cfg.n_layers * 2 * row * rows;
    EXPECT_EQ(plan.decode_step_bytes, 4 * (stack * cfg.n_loops + emb + B * cfg.d_model + states));
  }
}

TEST(Engine, PackedProjectionsGiveTheSameModel) {
  // pack_for_inference (FFN w1/w3, attention q/k/v/gate, GDN's inputs) changes no value: the
  // packed model's forward and decode equal an unpacked copy's.
  for (const std::string pattern : {"interleaved:1:1:gdn:full", "dsa", "window"}) {
    SCOPED_TRACE(pattern);
    auto packed = make_test_model(engine_config(pattern), 5), plain = make_test_model(engine_config(pattern), 5);
    packed->pack_for_inference();
    torch::NoGradGuard ng;
    auto tok = lt2::testing::random_tokens(2, 9, packed->config().vocab_size);
    EXPECT_LT(lt2::testing::rel_err(packed->forward(tok).logits, plain->forward(tok).logits), 1e-12);
    lt2::testing::expect_decode_matches_forward(*packed, tok);
    // The parameters are views of the packed matrices: an update to one shows in the forward.
    packed->layers[0]->as<BlockImpl>()->ffn->w1->weight.mul_(2);
    EXPECT_GT(lt2::testing::rel_err(packed->forward(tok).logits, plain->forward(tok).logits), 1e-6);
  }
}

TEST(Bench, DecodeAndPrefillCellsOnTheCpu) {
  // The bench on a tiny preset: every (path, batch, context) cell runs and reports its bytes; a
  // memory limit below the plan turns cells into OOM rows without running them.
  BenchOptions o;
  o.models = {"tiny-full-gdn"};
  o.contexts = {8, 16};
  o.batches = {2};
  o.steps = 1;
  o.warmup = 0;
  o.dtype = "fp32";
  o.device = "cpu";
  o.prefill_chunk = 8;
  o.memory_limit_gb = 4;
  auto cells = bench_decode(o, /*copy_gbs=*/0);
  ASSERT_EQ(cells.size(), 4u);  // reference first (the engine packs the model), then the engine
  EXPECT_EQ(cells.front().path, "reference");
  EXPECT_EQ(cells.back().path, "engine");
  for (const auto& c : cells) {
    EXPECT_FALSE(c.oom);
    EXPECT_GT(c.tokens_per_s, 0);
    EXPECT_GT(c.gb_per_step, 0);
  }
  EXPECT_GT(cells[1].gb_per_step, cells[0].gb_per_step);  // the KV cache grows with the context
  auto prefill = bench_prefill(o);
  ASSERT_EQ(prefill.size(), 2u);
  EXPECT_GT(prefill[1].tokens_per_s, 0);
  o.memory_limit_gb = 1;  // below the 1 GiB safety margin alone
  for (const auto& c : bench_decode(o, 0)) {
    EXPECT_TRUE(c.oom);
    EXPECT_EQ(c.ms, 0);
  }
  EXPECT_NE(bench_table(cells).find("| decode | tiny-full-gdn | engine | 16 | 2 |"), std::string::npos);
  EXPECT_EQ(cells_from_json(nlohmann::json{{"cells", {cells[0].to_json()}}}).front().context, 8);
  EXPECT_EQ(cells[0].decode_plan, "");  // the reference path has none
  EXPECT_EQ(cells_from_json(nlohmann::json{{"cells", {cells.back().to_json()}}}).front().decode_plan,
            cells.back().decode_plan);
  EXPECT_NE(cells.back().decode_plan.find("applications fused"), std::string::npos);
}

// Staging rows, copy_row and snapshot/restore (the server's continuous batching and prefix cache):
// a prompt prefilled in pieces, moved between rows, or resumed from a snapshot of its prefix decodes
// exactly like the same prompt prefilled from scratch, for every mixer that decodes with per-sequence
// positions, hybrids and Ouro form.
namespace {
void expect_resume_exact(LoopedLM m, int64_t prefix, int64_t total, int64_t steps) {
  torch::NoGradGuard ng;
  m->eval();
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_len = total + steps + 1;
  eo.prefill_chunk = 3;
  eo.staging_rows = 2;
  Engine e(m, eo);
  ASSERT_EQ(e.rows(), 4);
  torch::manual_seed(11);
  const int64_t V = m->config().vocab_size;
  auto prompt = torch::randint(V, {total}, torch::kLong);
  // Reference: slot 0 from scratch. Candidate: a prefix into staging row 2, snapshot, garbage into
  // row 3, restore there, extend with the rest, then move into slot 1.
  auto want = e.prefill(0, prompt);
  e.prefill(2, prompt.narrow(0, 0, prefix));
  auto snap = e.snapshot(2);
  EXPECT_EQ(snap.length, prefix);
  e.prefill(3, torch::randint(V, {total}, torch::kLong));  // garbage the restore must overwrite
  e.restore(3, snap);
  EXPECT_EQ(e.length(3), prefix);
  auto got = e.extend(3, prompt.narrow(0, prefix, total - prefix));
  EXPECT_LT(lt2::testing::rel_err(got, want), 1e-10) << "prefill resumed at " << prefix;
  e.copy_row(3, 1);
  EXPECT_EQ(e.length(1), total);
  for (int64_t s = 0; s < steps; ++s) {
    auto next = torch::randint(V, {1}, torch::kLong);
    auto logits = e.decode(torch::cat({next, next}));  // the same token into both slots
    EXPECT_LT(lt2::testing::rel_err(logits[1], logits[0]), 1e-10) << "decode step " << s;
  }
}
}  // namespace

TEST(Engine, ResumedFromASnapshotDecodesLikeFromScratch) {
  std::vector<std::string> patterns{"interleaved:1:1:gdn:full", "interleaved:1:1:gdn:window",
                                    "interleaved:1:1:gdn:dsa"};
  for (const auto& info : mixer_registry()) {  // every mixer alone, where the engine takes it
    auto m = make_test_model(engine_config(info.name));
    if (m->first_mixer_without_seq_pos().empty()) patterns.push_back(info.name);
  }
  for (const auto& pattern : patterns)
    for (int64_t prefix : {1, 3, 5, 9}) {  // around the GDN chunk (4), the window (2-4), DSA top-k (4)
      SCOPED_TRACE(pattern + ", prefix " + std::to_string(prefix));
      expect_resume_exact(make_test_model(engine_config(pattern)), prefix, 11, 4);
    }
}

TEST(Engine, OuroResumedFromASnapshotDecodesLikeFromScratch) {
  for (const std::string pattern : {"full", "interleaved:1:1:gdn:full"})
    for (int64_t prefix : {2, 6}) {
      SCOPED_TRACE(pattern);
      expect_resume_exact(make_test_model(engine_config(pattern, ModelForm::Ouro)), prefix, 10, 3);
    }
}

TEST(Engine, SnapshotsHoldOnlyTheTokensOfAttentionCaches) {
  // A KV cache snapshots its first `length` rows, not its capacity; a recurrent state is whole.
  auto m = make_test_model(engine_config("full"));
  m->eval();
  EngineOptions eo;
  eo.max_batch = 1;
  eo.max_len = 40;
  Engine e(m, eo);
  e.prefill(0, torch::randint(61, {4}, torch::kLong));
  const auto small = e.snapshot(0).bytes();
  e.prefill(0, torch::randint(61, {20}, torch::kLong));
  EXPECT_EQ(e.snapshot(0).bytes(), 5 * small);
  EXPECT_THROW(e.copy_row(0, 1), Error);  // no staging rows: row 1 does not exist
}
