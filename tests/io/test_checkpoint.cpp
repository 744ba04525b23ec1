// Checkpoint folders: bit-exact LoopedLM round trips, extra files, all-or-nothing saves, strict
// loading with errors that name the key and the shapes, sharded weights, config dispatch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/testing.h"
#include "io/io_testing.h"
#include "lt2/io/checkpoint.h"
#include "lt2/model/checkpoint_io.h"

using namespace lt2;
using lt2::testing::expect_error;
using lt2::testing::TempDir;
using lt2::testing::tiny_config;

namespace {

LoopedLM make_model(const ModelConfig& cfg, torch::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  LoopedLM m(cfg);
  m->to(dtype);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())  // make the zero-initialised gates non-trivial
    if (p.key() == "rho" || p.key().find("wgate") != std::string::npos) p.value().normal_(0, 0.3);
  return m;
}

void expect_same_parameters(const LoopedLM& a, const LoopedLM& b) {
  auto ta = module_tensors(*a), tb = module_tensors(*b);
  ASSERT_EQ(ta.size(), tb.size());
  for (const auto& [name, t] : ta) {
    ASSERT_TRUE(tb.count(name)) << name;
    EXPECT_EQ(t.scalar_type(), tb[name].scalar_type()) << name;
    EXPECT_TRUE(torch::equal(t, tb[name])) << name;
  }
}

}  // namespace

class CheckpointRoundTrip
    : public ::testing::TestWithParam<std::tuple<ModelForm, torch::ScalarType, bool>> {};

TEST_P(CheckpointRoundTrip, BitExact) {
  auto [form, dtype, tied] = GetParam();
  auto cfg = tiny_config("full", form);
  cfg.tie_embeddings = tied;
  auto model = make_model(cfg, dtype, 11);
  TempDir dir;
  const std::string ck = dir / "ck";  // created by the save
  save_checkpoint(ck, model);
  EXPECT_EQ(dir.list("ck"), (std::vector<std::string>{"config.json", "model.safetensors"}));

  // Tied weights are stored once: the file holds exactly the model's tensors.
  SafetensorsFile f(ck + "/model.safetensors");
  EXPECT_EQ(f.names().size(), module_tensors(*model).size());
  EXPECT_EQ(f.contains("output.weight"), !tied);
  EXPECT_EQ(f.metadata().at("format"), "pt");

  auto loaded = load_checkpoint(ck);
  EXPECT_EQ(loaded->config().to_json(), cfg.to_json());
  expect_same_parameters(model, loaded);
  torch::NoGradGuard ng;
  torch::manual_seed(5);
  auto tokens = torch::randint(cfg.vocab_size, {2, 9}, torch::kLong);
  ForwardOptions opts;
  opts.loop_logits = true;
  auto a = model->forward(tokens, nullptr, opts), b = loaded->forward(tokens, nullptr, opts);
  EXPECT_TRUE(torch::equal(a.logits, b.logits));
  for (int64_t l = 0; l < cfg.n_loops; ++l) EXPECT_TRUE(torch::equal(a.loop_logits[l], b.loop_logits[l]));
  if (form == ModelForm::Ouro) {
    EXPECT_TRUE(torch::equal(a.exit_probs, b.exit_probs));
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, CheckpointRoundTrip,
                         ::testing::Values(std::make_tuple(ModelForm::LT2, torch::kFloat32, false),
                                           std::make_tuple(ModelForm::LT2, torch::kFloat64, true),
                                           std::make_tuple(ModelForm::Ouro, torch::kFloat32, false),
                                           std::make_tuple(ModelForm::Ouro, torch::kFloat64, false)));

TEST(Checkpoint, LoadDtypeOption) {
  auto model = make_model(tiny_config(), torch::kFloat64, 2);
  TempDir dir;
  save_checkpoint(dir.path(), model);
  auto f32 = load_checkpoint(dir.path(), torch::kFloat32);
  for (const auto& p : f32->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(f32->tok_embeddings->weight, model->tok_embeddings->weight.to(torch::kFloat32)));
  expect_error([&] { load_checkpoint(dir.path(), torch::kLong); }, {"floating-point", "Long"});
}

TEST(Checkpoint, ExtraFilesAndTensorMaps) {
  auto model = make_model(tiny_config(), torch::kFloat32, 3);
  TempDir dir;
  TensorMap opt = {{"step", torch::tensor(int64_t{42})},
                   {"exp_avg.tok_embeddings.weight", torch::randn({61, 32})},
                   {"flags", torch::tensor({true, false})}};
  save_checkpoint(dir.path(), model,
                  {safetensors_writer("optimizer.safetensors", opt), text_writer("trainer_state.json", "{\"step\": 42}\n")});
  EXPECT_EQ(dir.list(), (std::vector<std::string>{"config.json", "model.safetensors", "optimizer.safetensors",
                                                  "trainer_state.json"}));
  auto back = load_tensor_map(dir / "optimizer.safetensors");
  ASSERT_EQ(back.size(), opt.size());
  for (const auto& [k, t] : opt) EXPECT_TRUE(torch::equal(back[k], t)) << k;
  EXPECT_EQ(lt2::testing::read_bytes(dir / "trainer_state.json"), "{\"step\": 42}\n");
}

TEST(Checkpoint, FailedSaveKeepsTheExistingCheckpoint) {
  auto first = make_model(tiny_config(), torch::kFloat32, 4);
  auto second = make_model(tiny_config(), torch::kFloat32, 5);
  TempDir dir;
  save_checkpoint(dir.path(), first, {text_writer("trainer_state.json", "first")});
  const std::string old_weights = lt2::testing::read_bytes(dir / "model.safetensors");
  // The second save fails while writing its last file, after the weights were written.
  FileWriter failing{"trainer_state.json", [](std::ostream& out) {
                       out << "partial";
                       throw Error("simulated failure");
                     }};
  expect_error([&] { save_checkpoint(dir.path(), second, {failing}); }, {"simulated failure"});
  EXPECT_EQ(dir.list(), (std::vector<std::string>{"config.json", "model.safetensors", "trainer_state.json"}));
  EXPECT_EQ(lt2::testing::read_bytes(dir / "model.safetensors"), old_weights);
  EXPECT_EQ(lt2::testing::read_bytes(dir / "trainer_state.json"), "first");
  expect_same_parameters(load_checkpoint(dir.path()), first);
  // A save that succeeds replaces every file.
  save_checkpoint(dir.path(), second);
  expect_same_parameters(load_checkpoint(dir.path()), second);
  expect_error([&] { write_folder_atomic(dir.path(), {text_writer("a/b", "x")}); }, {"not a plain file name"});
  expect_error([&] { write_folder_atomic(dir.path(), {text_writer("a", "x"), text_writer("a", "y")}); },
               {"'a' is written twice"});
}

TEST(Checkpoint, StrictLoadingNamesKeysAndShapes) {
  auto cfg = tiny_config();
  auto model = make_model(cfg, torch::kFloat32, 6);
  auto weights = module_tensors(*model);
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  auto target = make_model(cfg, torch::kFloat32, 7);
  const auto before = module_tensors(*target);
  auto load = [&] { load_weights_into(*target, SafetensorsFile(path)); };

  auto missing = weights;
  missing.erase("layers.1.ffn.w2.weight");
  save_safetensors(path, missing);
  expect_error(load, {path, "1 problem", "missing key 'layers.1.ffn.w2.weight'", "expected shape [32, 48] F32"});

  auto extra = weights;
  extra["layers.9.ffn.w2.weight"] = torch::zeros({3, 4});
  save_safetensors(path, extra);
  expect_error(load, {"unexpected key 'layers.9.ffn.w2.weight' with shape [3, 4] F32"});

  auto wrong_shape = weights;
  wrong_shape["layers.0.mixer.wk.weight"] = torch::zeros({8, 32});
  save_safetensors(path, wrong_shape);
  expect_error(load, {"shape mismatch for key 'layers.0.mixer.wk.weight'", "expected [16, 32], found [8, 32]"});

  auto wrong_dtype = weights;
  wrong_dtype["norm.weight"] = torch::zeros({32}, torch::kInt32);
  save_safetensors(path, wrong_dtype);
  expect_error(load, {"dtype mismatch for key 'norm.weight'", "expected a floating-point dtype (model: F32)",
                      "found I32"});

  // All problems at once.
  auto all = missing;
  all["extra"] = torch::zeros({1});
  all["layers.0.mixer.wk.weight"] = torch::zeros({8, 32});
  save_safetensors(path, all);
  expect_error(load, {"3 problems", "missing key", "unexpected key 'extra'", "shape mismatch"});

  // A failed load leaves the model as it was.
  for (const auto& [k, t] : module_tensors(*target)) EXPECT_TRUE(torch::equal(t, before.at(k))) << k;

  // bf16 weights load into fp32 parameters (converted); a name map renames keys.
  TensorMap renamed;
  for (const auto& [k, t] : weights) renamed["m." + k] = t.to(torch::kBFloat16);
  save_safetensors(path, renamed);
  NameMap map;
  for (const auto& [k, t] : weights) map[k] = "m." + k;
  load_weights_into(*target, SafetensorsFile(path), map);
  for (const auto& [k, t] : module_tensors(*target))
    EXPECT_TRUE(torch::equal(t, weights[k].to(torch::kBFloat16).to(torch::kFloat32))) << k;
  map.erase("norm.weight");  // looked up under its own name, which the file lacks
  expect_error([&] { load_weights_into(*target, SafetensorsFile(path), map); },
               {"missing key 'norm.weight'", "unexpected key 'm.norm.weight'"});
  map["norm.weight"] = "m.norm.weight";
  map.erase("output.weight");
  expect_error([&] { load_weights_into(*target, SafetensorsFile(path), map, {"m.output.weight"}); },
               {"missing key 'output.weight'"});
  map["output.weight"] = "nope";
  expect_error([&] { load_weights_into(*target, SafetensorsFile(path), map); },
               {"missing key 'nope' (model tensor 'output.weight')", "expected shape [61, 32]"});
}

TEST(Checkpoint, FolderErrors) {
  auto model = make_model(tiny_config(), torch::kFloat32, 8);
  TempDir dir;
  expect_error([&] { load_checkpoint(dir / "nowhere"); }, {"nowhere", "does not exist"});
  expect_error([&] { load_checkpoint(dir.path()); }, {"config.json", "cannot open"});
  save_checkpoint(dir.path(), model);
  // A config whose shape disagrees with the weights.
  auto cfg = tiny_config();
  cfg.d_model = 48;
  lt2::testing::write_bytes(dir / "config.json", cfg.to_json().dump());
  expect_error([&] { load_checkpoint(dir.path()); }, {"model.safetensors", "24 problems",
                "shape mismatch for key 'layers.0.ffn.w1.weight': expected [48, 48], found [48, 32]",
                "... and 4 more"});
  // Unknown model_type.
  lt2::testing::write_bytes(dir / "config.json", R"({"model_type": "llama", "hidden_size": 32})");
  expect_error([&] { load_checkpoint(dir.path()); }, {"config.json", "unknown model_type \"llama\"", "ouro"});
  // Bad config field (ModelConfig's own validation).
  lt2::testing::write_bytes(dir / "config.json", R"({"form": "lt3"})");
  expect_error([&] { load_checkpoint(dir.path()); }, {"'form' must be"});
  lt2::testing::write_bytes(dir / "config.json", model->config().to_json().dump());
  std::filesystem::remove(dir / "model.safetensors");
  expect_error([&] { load_checkpoint(dir.path()); }, {"neither model.safetensors nor model.safetensors.index.json"});
}

TEST(Checkpoint, WeightsAreCheckedFromTheHeadersAlone) {
  auto model = make_model(tiny_config(), torch::kFloat32, 8);
  TempDir dir;
  save_checkpoint(dir.path(), model);
  const int64_t n = static_cast<int64_t>(module_tensors(*model).size());
  EXPECT_EQ(check_checkpoint_weights(dir.path(), model), n);
  const std::string weights = dir / "model.safetensors";
  const std::string good = lt2::testing::read_bytes(weights);
  // Truncated: the header promises more data than the file holds.
  lt2::testing::write_bytes(weights, good.substr(0, good.size() - 100));
  expect_error([&] { check_checkpoint_weights(dir.path(), model); }, {weights, "truncated"});
  // A wrong-shaped tensor and a missing one, both named.
  auto tensors = module_tensors(*model);
  tensors["layers.0.mixer.wq.weight"] = torch::zeros({4, 4});
  tensors.erase("norm.weight");
  save_safetensors(weights, tensors);
  expect_error([&] { check_checkpoint_weights(dir.path(), model); },
               {weights, "2 problems", "shape mismatch for key 'layers.0.mixer.wq.weight': expected [32, 32], found [4, 4]",
                "missing key 'norm.weight'"});
  // The weights file itself missing.
  std::filesystem::remove(weights);
  expect_error([&] { check_checkpoint_weights(dir.path(), model); },
               {"neither model.safetensors nor model.safetensors.index.json"});
}

TEST(Checkpoint, ShardedWeights) {
  auto model = make_model(tiny_config(), torch::kFloat32, 9);
  TempDir dir;
  save_checkpoint(dir.path(), model);
  std::filesystem::remove(dir / "model.safetensors");
  TensorMap a, b;
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (const auto& [k, t] : module_tensors(*model)) {
    const bool first = k.rfind("layers.0.", 0) == 0;
    (first ? a : b)[k] = t;
    index["weight_map"][k] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  save_safetensors(dir / "model-00001-of-00002.safetensors", a);
  save_safetensors(dir / "model-00002-of-00002.safetensors", b);
  lt2::testing::write_bytes(dir / "model.safetensors.index.json", index.dump());
  expect_same_parameters(load_checkpoint(dir.path()), model);
  EXPECT_EQ(check_checkpoint_weights(dir.path(), model), static_cast<int64_t>(module_tensors(*model).size()));

  // A shard with a tensor the index does not list, and an index entry its shard lacks.
  a["stray"] = torch::zeros({2});
  save_safetensors(dir / "model-00001-of-00002.safetensors", a);
  expect_error([&] { load_checkpoint(dir.path()); }, {"index.json", "'model-00001-of-00002.safetensors'",
                                                      "holds tensor 'stray'", "does not list"});
  a.erase("stray");
  save_safetensors(dir / "model-00001-of-00002.safetensors", a);
  index["weight_map"]["ghost"] = "model-00002-of-00002.safetensors";
  lt2::testing::write_bytes(dir / "model.safetensors.index.json", index.dump());
  expect_error([&] { load_checkpoint(dir.path()); }, {"tensor 'ghost' is listed in shard"});
}
