// lt2 distill on a tiny Ouro-form teacher (GQA, float64) written by the test: the student's copied
// weights, the student with every layer kept equals the teacher, the losses against independent
// references, stage 1 moving only the student mixers, exact resume of every stage, the selection
// report, the errors, and all stages end to end.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/testing.h"
#include "io/io_testing.h"
#include "lt2/distill/losses.h"
#include "lt2/distill/pipeline.h"
#include "lt2/distill/selection.h"
#include "lt2/io/ouro.h"
#include "lt2/io/safetensors.h"
#include "lt2/model/checkpoint_io.h"
#include "lt2/train/trainer.h"
#include "lt2/util/fs.h"
#include "train/train_testing.h"

namespace {

namespace fs = std::filesystem;
using namespace lt2;
using namespace lt2::distill;
using lt2::testing::expect_error;

// The teacher: Ouro form (sandwich norm, exit gate), 2 layers of full attention with 4 query heads
// over 2 KV heads, 3 loops, float64.
LoopedLM tiny_teacher(uint64_t seed = 7) {
  return lt2::testing::make_test_model(lt2::testing::tiny_config("full", ModelForm::Ouro), seed, torch::kFloat64);
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = (fs::temp_directory_path() / ("lt2_distill_" + name)).string();
  remove_tree(dir);
  make_dirs(dir);
  return dir;
}

// A teacher checkpoint and a token shard in `dir`, and a distillation config of a few steps a stage.
struct Setup {
  std::string dir, teacher, shard;
  json config;
};

Setup setup(const std::string& name) {
  Setup s;
  s.dir = fresh_dir(name);
  s.teacher = s.dir + "/teacher";
  save_checkpoint(s.teacher, tiny_teacher());
  s.shard = lt2::testing::write_pattern_shard(s.dir + "/data", 3000, 1);
  s.config = {
      {"train", {{"train_data", s.shard}, {"device", "cpu"}, {"batch_size", 2}, {"seq_len", 16}, {"eval_batches", 1},
                 {"eval_every", 0}, {"log_every", 100}, {"warmup", 2}}},
      {"student", {{"mixer", "gdn"}, {"keep_fraction", 0.5}}},
      {"align", {{"steps", 4}, {"lr", 1e-2}}},
      {"select", {{"method", "shared"}, {"probe_steps", 2}, {"eval_batches", 1}}},
      {"kd", {{"steps", 4}, {"lr", 1e-2}, {"other_lr", 1e-3}}},
      {"long", {{"steps", 4}, {"seq_len", 24}, {"lr", 1e-3}}}};
  return s;
}

std::string run(const Setup& s, const std::string& stages, const std::string& out, bool resume = false,
                const json& patch = json::object()) {
  DistillRun r;
  r.teacher = s.teacher;
  json c = s.config;
  c.merge_patch(patch);
  r.config = DistillConfig::from_json(c, "test config");
  r.out = s.dir + "/" + out;
  r.resume = resume;
  return run_distill(r, parse_stages(stages));
}

std::map<std::string, torch::Tensor> weights_of(const std::string& checkpoint) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : load_checkpoint(checkpoint)->named_parameters()) out[p.key()] = p.value();
  return out;
}

void expect_same_weights(const std::string& a, const std::string& b) {
  const auto wa = weights_of(a), wb = weights_of(b);
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << name << ": " << a << " vs " << b;
}

TEST(Student, CopiesTheTeachersWeights) {
  auto teacher = tiny_teacher();
  auto student = build_student(*teacher, StudentOptions{});
  const auto& cfg = student->config();
  EXPECT_EQ(cfg.layer_pattern, "gdn,gdn");
  EXPECT_EQ(cfg.mixer_options["gdn"]["head_dim"], 8);  // d / H = the teacher's head dim
  EXPECT_EQ(cfg.mixer_options["gdn"]["expand_v"], 1.0);
  EXPECT_EQ(cfg.mixer_options["gdn"]["use_gate"], true);
  auto t = teacher->named_parameters(), s = student->named_parameters();
  int64_t compared = 0;
  for (const auto& p : s) {
    if (p.key().find(".mixer.") != std::string::npos) continue;
    EXPECT_TRUE(torch::equal(p.value(), t[p.key()])) << p.key();
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(t.size()) - 2 * 4);  // all but the 4 attention matrices a layer
  const int64_t H = 4, D = 8, groups = 2;
  for (int l = 0; l < 2; ++l) {
    const std::string at = "layers." + std::to_string(l) + ".mixer.";
    EXPECT_TRUE(torch::equal(s[at + "q_proj.weight"], t[at + "wq.weight"]));
    EXPECT_TRUE(torch::equal(s[at + "o_proj.weight"], t[at + "wo.weight"]));
    // GQA: query head h reads KV head h / groups.
    for (int64_t h = 0; h < H; ++h)
      for (const char* kv : {"k", "v"}) {
        const auto got = s[at + kv + "_proj.weight"].narrow(0, h * D, D);
        const auto want = t[at + "w" + kv + ".weight"].narrow(0, (h / groups) * D, D);
        EXPECT_TRUE(torch::equal(got, want)) << at << kv << " head " << h;
      }
  }
}

// An Ouro checkpoint folder (HF keys, model_type "ouro") is a teacher as it is: the student takes its
// attention matrices under their Ouro names.
TEST(Student, FromAnOuroFolder) {
  const std::string dir = fresh_dir("ouro") + "/ouro";
  const json config = {{"model_type", "ouro"}, {"hidden_size", 32}, {"intermediate_size", 48},
                       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                       {"rms_norm_eps", 1e-6}, {"rope_theta", 1e6}, {"vocab_size", 61}, {"total_ut_steps", 3},
                       {"tie_word_embeddings", false}};
  auto source = tiny_teacher();  // our names; written under Ouro's keys
  TensorMap weights;
  const auto keys = ouro_key_map(ouro_model_config(config, "test"));
  for (const auto& p : source->named_parameters()) weights[keys.at(p.key())] = p.value().to(torch::kFloat32);
  make_dirs(dir);
  write_file_atomic(dir + "/config.json", config.dump());
  save_safetensors(dir + "/model.safetensors", weights, {});
  TrainConfig train;
  auto teacher = load_teacher(dir, train);
  EXPECT_EQ(teacher->config().form, ModelForm::Ouro);
  auto student = build_student(*teacher, StudentOptions{});
  auto s = student->named_parameters();
  EXPECT_TRUE(torch::equal(s["layers.1.mixer.q_proj.weight"], weights.at("model.layers.1.self_attn.q_proj.weight")));
  EXPECT_TRUE(torch::equal(s["layers.1.mixer.o_proj.weight"], weights.at("model.layers.1.self_attn.o_proj.weight")));
  EXPECT_TRUE(torch::equal(s["exit_gate.weight"], weights.at("model.early_exit_gate.weight")));
}

TEST(Student, EveryLayerKeptEqualsTheTeacher) {
  auto teacher = tiny_teacher();
  StudentOptions opts;
  opts.keep = {0, 1};
  auto student = build_student(*teacher, opts);
  teacher->eval();
  student->eval();
  const auto tokens = torch::randint(61, {2, 12}, torch::kLong);
  ForwardOptions fo;
  fo.loop_logits = true;
  torch::NoGradGuard ng;
  const auto a = teacher->forward(tokens, nullptr, fo), b = student->forward(tokens, nullptr, fo);
  EXPECT_TRUE(torch::equal(a.logits, b.logits));
  for (size_t t = 0; t < a.loop_logits.size(); ++t) EXPECT_TRUE(torch::equal(a.loop_logits[t], b.loop_logits[t]));
  const auto kl = kd_loss(*teacher, *student, tokens, loop_weights(teacher->config(), {}));
  EXPECT_LT(std::abs(kl.item<double>()), 1e-13);
}

// The chunked KL over the loop exits against KL formed from both models' whole logits (float64).
TEST(Losses, ChunkedKlEqualsTheDirectKl) {
  auto teacher = tiny_teacher();
  auto student = build_student(*teacher, StudentOptions{});
  const auto tokens = torch::randint(61, {2, 10}, torch::kLong);
  const std::vector<double> w{0.2, 0.3, 0.5};
  ForwardOptions fo;
  fo.loop_logits = true;
  fo.exit_at_loop = 3;
  torch::NoGradGuard ng;
  const auto t = teacher->forward(tokens, nullptr, fo), s = student->forward(tokens, nullptr, fo);
  double direct = 0;
  for (int l = 0; l < 3; ++l) {
    const auto lp = torch::log_softmax(t.loop_logits[l], -1), lq = torch::log_softmax(s.loop_logits[l], -1);
    direct += w[l] * (lp.exp() * (lp - lq)).sum(-1).mean().item<double>();
  }
  EXPECT_GT(direct, 1e-3);
  for (int64_t chunk : {int64_t{1}, int64_t{7}, int64_t{0}}) {
    ops::HeadLossOptions o;
    o.chunk_tokens = chunk;
    const double chunked = kd_loss(*teacher, *student, tokens, w, o).item<double>();
    EXPECT_LT(std::abs(chunked - direct) / direct, 1e-12) << "chunk " << chunk;
  }
  // The schedules: rising for Ouro, the last loop for LT2, a configured one normalised.
  EXPECT_EQ(loop_weights(teacher->config(), {}), (std::vector<double>{1.0 / 6, 2.0 / 6, 3.0 / 6}));
  EXPECT_EQ(loop_weights(lt2::testing::tiny_config(), {}), (std::vector<double>{0, 0, 1}));
  EXPECT_EQ(loop_weights(teacher->config(), {1, 0, 3}), (std::vector<double>{0.25, 0, 0.75}));
}

// A window student whose window covers the sequence is the teacher's attention again: the
// alignment loss is 0 only if each (layer, loop) pair sees the teacher's own input.
TEST(Losses, AlignmentComparesEachLayerAndLoopOnTheTeachersInput) {
  auto teacher = tiny_teacher();
  StudentOptions window;
  window.mixer = "window";
  window.mixer_options = {{"window", 64}};
  auto same = build_student(*teacher, window);
  const auto tokens = torch::randint(61, {2, 12}, torch::kLong);
  EXPECT_LT(alignment_loss(*teacher, *same, tokens, {0, 1}).item<double>(), 1e-14);
  window.mixer_options = {{"window", 2}};
  auto narrow = build_student(*teacher, window);
  const double one = alignment_loss(*teacher, *narrow, tokens, {1}).item<double>();
  EXPECT_GT(one, 1e-3);
  // By hand for layer 1: the teacher's mixer input in each loop, the RMS error per token.
  std::vector<torch::Tensor> inputs, outputs;
  ForwardOptions fo;
  fo.compute_logits = false;
  fo.mixer_tap = [&](int64_t layer, int64_t, const torch::Tensor& in, const torch::Tensor& out) {
    if (layer == 1) inputs.push_back(in.clone()), outputs.push_back(out.clone());
  };
  torch::NoGradGuard ng;
  teacher->forward(tokens, nullptr, fo);
  ASSERT_EQ(inputs.size(), 3u);
  double want = 0;
  for (int loop = 0; loop < 3; ++loop) {
    const auto o = narrow->mixers()[1]->forward(inputs[loop], Positions(0, loop));
    want += ((o - outputs[loop]).pow(2).sum(-1).sqrt() / std::sqrt(32.0)).mean().item<double>() / 3;
  }
  EXPECT_LT(std::abs(one - want) / want, 1e-12);
}

TEST(Stages, AlignmentMovesOnlyTheStudentMixers) {
  const auto s = setup("align");
  run(s, "align", "out");
  const auto before = weights_of(s.dir + "/out/init-align"), after = weights_of(stage_student(s.dir + "/out", Stage::Align));
  int64_t moved = 0;
  for (const auto& [name, t] : before) {
    const bool mixer = name.find(".mixer.") != std::string::npos;
    if (mixer) moved += !torch::equal(t, after.at(name));
    else EXPECT_TRUE(torch::equal(t, after.at(name))) << name << " moved";
  }
  EXPECT_GT(moved, 10) << "the student mixers did not train";
  EXPECT_TRUE(path_exists(s.dir + "/out/align/metrics.jsonl"));
}

// Each stage run in two parts (2 steps, then --resume to 4) ends with the weights of one whole run.
TEST(Stages, ResumeIsExactInEveryStage) {
  const auto s = setup("resume");
  run(s, "align", "whole");
  run(s, "kd", "whole");
  run(s, "long", "whole");
  for (const char* stage : {"align", "kd", "long"}) {
    run(s, stage, "split", false, {{stage, {{"steps", 2}}}});
    run(s, stage, "split", true);
    expect_same_weights(stage_student(s.dir + "/whole", parse_stages(stage)[0]),
                        stage_student(s.dir + "/split", parse_stages(stage)[0]));
  }
}

TEST(Select, ReportRanksEveryLayerAndResumes) {
  const auto s = setup("select");
  const json both = {{"select", {{"method", "both"}}}};
  run(s, "align", "out");
  run(s, "select", "out", false, both);
  const std::string dir = s.dir + "/out/select";
  const auto report = load_json_file(dir + "/selection.json");
  ASSERT_EQ(report["rankings"].size(), 2u);
  EXPECT_EQ(report["rankings"][0]["method"], "shared");
  EXPECT_EQ(report["rankings"][0]["probes"], 0);  // every layer scored on the aligned student
  EXPECT_EQ(report["rankings"][1]["probes"], 3);  // the baseline and one per layer
  EXPECT_EQ(report["k"], 1);                       // round(0.5 x 2 layers)
  EXPECT_EQ(report["keep"].size(), 1u);
  for (const auto& r : report["rankings"]) {
    ASSERT_EQ(r["scores"].size(), 2u);
    for (const auto& sc : r["scores"])
      EXPECT_DOUBLE_EQ(sc["gain"].get<double>(), r["baseline_kl"].get<double>() - sc["kl"].get<double>());
  }
  EXPECT_TRUE(report.contains("comparison"));
  EXPECT_NE(read_file(dir + "/selection.md").find("| layer |"), std::string::npos);
  EXPECT_FALSE(path_exists(dir + "/probe-exhaustive-baseline")) << "probe folders are removed once measured";
  // Interrupted before the report, one probe short: the resumed selection redoes only that one.
  auto probes = load_json_file(dir + "/probes.json");
  probes.erase("exhaustive/1");
  write_file_atomic(dir + "/probes.json", probes.dump());
  remove_tree(dir + "/selection.json");
  run(s, "select", "out", true, both);
  EXPECT_EQ(load_json_file(dir + "/selection.json"), report);
  // The kd stage keeps the selected layer.
  run(s, "kd", "out");
  const auto kd = load_checkpoint(stage_student(s.dir + "/out", Stage::Kd));
  EXPECT_EQ(kd->layer_mixers()[report["keep"][0].get<int64_t>()], "full");
}

TEST(Select, TopLayersAndSpearman) {
  const std::vector<LayerScore> a{{0, 0, 0.5}, {1, 0, 0.1}, {2, 0, 0.9}, {3, 0, 0.1}};
  EXPECT_EQ(top_layers(a, 2), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(top_layers(a, 3), (std::vector<int64_t>{0, 1, 2}));  // ties: the lower layer
  EXPECT_DOUBLE_EQ(spearman(a, a), 1.0);
  const std::vector<LayerScore> reversed{{0, 0, 0.5}, {1, 0, 0.8}, {2, 0, 0.1}, {3, 0, 0.9}};
  EXPECT_LT(spearman(a, reversed), 0);
}

TEST(Errors, MismatchesAndBadSettingsSayWhatWasExpected) {
  auto teacher = tiny_teacher();
  auto other = lt2::testing::tiny_config("full", ModelForm::Ouro);
  other.vocab_size = 99;
  expect_error([&] { check_student_of(teacher->config(), other); },
                             {"vocab_size is 99 in the student but 61 in the teacher"});
  other = teacher->config();
  other.d_model = 64;
  expect_error([&] { check_student_of(teacher->config(), other); }, {"d_model is 64"});
  StudentOptions bad;
  bad.keep = {5};
  expect_error([&] { build_student(*teacher, bad); }, {"keep lists layer 5", "layers 0..1"});
  bad = {};
  bad.mixer = "full";
  expect_error([&] { build_student(*teacher, bad); }, {"not be 'full'"});
  bad.mixer = "nope";
  expect_error([&] { build_student(*teacher, bad); }, {"unknown student mixer 'nope'"});
  expect_error([&] { loop_weights(teacher->config(), {1, 2}); }, {"2 entries", "3 loops"});
  expect_error([&] { parse_stages("distil"); }, {"unknown stage 'distil'"});
  expect_error([&] { DistillConfig::from_json({{"select", {{"method", "fast"}}}}, "cfg"); },
                             {"shared, exhaustive or both", "fast"});
  expect_error([&] { DistillConfig::from_json({{"kd", {{"lr", 0}}}}, "cfg"); }, {"stage 'kd'", "'lr' must be > 0"});

  // A shard whose vocabulary exceeds the teacher's; a later stage before the earlier one ran.
  auto s = setup("errors");
  ShardWriter w(s.dir + "/wide.bin", 500);
  w.write(std::vector<int32_t>(400, 499));
  w.close();
  expect_error([&] { run(s, "align", "wide", false, {{"train", {{"train_data", s.dir + "/wide.bin"}}}}); },
                             {"vocabulary 500", "vocab_size is 61"});
  expect_error([&] { run(s, "kd", "empty"); }, {"no checkpoint of stage 'align'", "--stage align"});
  // A student aligned to another teacher cannot go on with this one.
  run(s, "align", "out");
  save_checkpoint(s.teacher, lt2::testing::make_test_model(other, 3, torch::kFloat64));
  expect_error([&] { run(s, "kd", "out"); }, {"does not match the teacher", "d_model is 32 in the student but 64"});
}

TEST(EndToEnd, AllStagesGiveALoadableHybrid) {
  const auto s = setup("all");
  const json probe = {{"select", {{"shared_probe_steps", 2}}}};  // the shared ranking after a probe
  const std::string student = run(s, "all", "out", false, probe);
  EXPECT_EQ(student, stage_student(s.dir + "/out", Stage::Long));
  auto m = load_checkpoint(student);
  const auto& kinds = m->layer_mixers();
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), "full"), 1);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), "gdn"), 1);
  m->eval();
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::isfinite(m->forward(torch::randint(50, {1, 8}, torch::kLong)).logits).all().item<bool>());
  // Everything done: a resumed run skips every stage and names the same student.
  EXPECT_EQ(run(s, "all", "out", true, probe), student);
}

}  // namespace
