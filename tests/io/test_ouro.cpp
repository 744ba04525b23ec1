// Ouro import: a small Ouro-format checkpoint (bf16 weights under HF keys + an Ouro config.json)
// loads into LoopedLM, whose every loop's logits and exit distribution match an independent
// plain-libtorch evaluation of Ouro's forward (Ouro's published modeling code) in float64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "common/testing.h"
#include "io/io_testing.h"
#include "lt2/io/ouro.h"
#include "lt2/model/checkpoint_io.h"

using namespace lt2;
using lt2::testing::expect_error;
using lt2::testing::rel_err;
using lt2::testing::TempDir;
using torch::Tensor;

namespace {

// A tiny Ouro shape with GQA and a head dim that is not hidden / heads.
json tiny_ouro_config() {
  return {{"architectures", {"OuroForCausalLM"}},
          {"model_type", "ouro"},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"hidden_act", "silu"},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 50000.0},
          {"rope_scaling", nullptr},
          {"max_position_embeddings", 128},
          {"vocab_size", 53},
          {"total_ut_steps", 3},
          {"early_exit_threshold", 0.9},
          {"tie_word_embeddings", false},
          {"use_sliding_window", false},
          {"torch_dtype", "bfloat16"}};
}

// Random weights under Ouro's keys, in bf16 as Ouro ships them.
TensorMap random_ouro_weights(const json& c, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t d = c["hidden_size"], f = c["intermediate_size"], L = c["num_hidden_layers"];
  const int64_t H = c["num_attention_heads"], KV = c["num_key_value_heads"], D = c["head_dim"];
  const int64_t V = c["vocab_size"];
  auto linear = [](int64_t out, int64_t in) { return torch::randn({out, in}) / std::sqrt(double(in)); };
  auto gain = [](int64_t n) { return 1.0 + 0.2 * torch::randn({n}); };
  TensorMap w;
  w["model.embed_tokens.weight"] = torch::randn({V, d});
  for (int64_t i = 0; i < L; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w[p + "self_attn.q_proj.weight"] = linear(H * D, d);
    w[p + "self_attn.k_proj.weight"] = linear(KV * D, d);
    w[p + "self_attn.v_proj.weight"] = linear(KV * D, d);
    w[p + "self_attn.o_proj.weight"] = linear(d, H * D);
    w[p + "mlp.gate_proj.weight"] = linear(f, d);
    w[p + "mlp.up_proj.weight"] = linear(f, d);
    w[p + "mlp.down_proj.weight"] = linear(d, f);
    for (const char* n : {"input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                          "post_attention_layernorm_2"})
      w[p + n + ".weight"] = gain(d);
  }
  w["model.norm.weight"] = gain(d);
  w["model.early_exit_gate.weight"] = 0.3 * torch::randn({1, d});
  w["model.early_exit_gate.bias"] = 0.5 * torch::randn({1});
  w["lm_head.weight"] = linear(V, d);
  for (auto& kv : w) kv.second = kv.second.to(torch::kBFloat16);
  return w;
}

void write_ouro_folder(const std::string& dir, const json& config, const TensorMap& weights) {
  std::filesystem::create_directories(dir);
  lt2::testing::write_bytes(dir + "/config.json", config.dump(2));
  save_safetensors(dir + "/model.safetensors", weights, {{"format", "pt"}});
}

// ---- Independent reference: Ouro's forward written out with plain libtorch ops ----------------

Tensor ref_rms_norm(const Tensor& x, const Tensor& w, double eps) {
  return w * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

Tensor ref_rotate_half(const Tensor& x) {  // (x1, x2) -> (-x2, x1) over the last dim
  const int64_t h = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

struct RefOutput {
  std::vector<Tensor> loop_logits;  // T x [B, S, V]
  Tensor exit_probs;                // [B, S, T]
};

// w: Ouro keys -> float64 tensors. tokens: [B, S].
RefOutput ouro_reference(const TensorMap& w, const json& c, const Tensor& tokens) {
  const int64_t d = c["hidden_size"], L = c["num_hidden_layers"], T = c["total_ut_steps"];
  const int64_t H = c["num_attention_heads"], KV = c["num_key_value_heads"], D = c["head_dim"];
  const double eps = c["rms_norm_eps"], theta = c["rope_theta"];
  const int64_t B = tokens.size(0), S = tokens.size(1);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  // RoPE tables (HF Llama convention): inv_freq_i = theta^(-2i/D), emb = cat(freqs, freqs).
  auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, D, 2, f64) / double(D));  // [D/2]
  auto freqs = torch::outer(torch::arange(S, f64), inv_freq);                          // [S, D/2]
  auto emb = torch::cat({freqs, freqs}, -1);                                           // [S, D]
  auto cos = emb.cos(), sin = emb.sin();
  auto causal = torch::ones({S, S}, torch::kBool).tril();  // [S, S], true = may attend
  auto W = [&](const std::string& k) { return w.at(k); };

  RefOutput out;
  std::vector<Tensor> lambdas;
  Tensor h = W("model.embed_tokens.weight").index_select(0, tokens.flatten()).view({B, S, d});
  for (int64_t ut = 0; ut < T; ++ut) {
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      // Attention with sandwich norm.
      auto a = ref_rms_norm(h, W(p + "input_layernorm.weight"), eps);
      auto q = a.matmul(W(p + "self_attn.q_proj.weight").t()).view({B, S, H, D}).transpose(1, 2);   // [B, H, S, D]
      auto k = a.matmul(W(p + "self_attn.k_proj.weight").t()).view({B, S, KV, D}).transpose(1, 2);  // [B, KV, S, D]
      auto v = a.matmul(W(p + "self_attn.v_proj.weight").t()).view({B, S, KV, D}).transpose(1, 2);
      q = q * cos + ref_rotate_half(q) * sin;
      k = k * cos + ref_rotate_half(k) * sin;
      k = k.repeat_interleave(H / KV, 1);  // query head j reads kv head j / (H / KV)
      v = v.repeat_interleave(H / KV, 1);
      auto scores = q.matmul(k.transpose(-1, -2)) / std::sqrt(double(D));  // [B, H, S, S]
      scores = scores.masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity());
      auto o = torch::softmax(scores, -1).matmul(v);                          // [B, H, S, D]
      o = o.transpose(1, 2).reshape({B, S, H * D}).matmul(W(p + "self_attn.o_proj.weight").t());
      h = h + ref_rms_norm(o, W(p + "input_layernorm_2.weight"), eps);
      // SwiGLU MLP with sandwich norm.
      auto m = ref_rms_norm(h, W(p + "post_attention_layernorm.weight"), eps);
      auto g = torch::silu(m.matmul(W(p + "mlp.gate_proj.weight").t()));
      auto u = m.matmul(W(p + "mlp.up_proj.weight").t());
      auto f = (g * u).matmul(W(p + "mlp.down_proj.weight").t());
      h = h + ref_rms_norm(f, W(p + "post_attention_layernorm_2.weight"), eps);
    }
    h = ref_rms_norm(h, W("model.norm.weight"), eps);  // after every loop; feeds the next loop
    out.loop_logits.push_back(h.matmul(W("lm_head.weight").t()));
    lambdas.push_back(torch::sigmoid(h.matmul(W("model.early_exit_gate.weight").t()) +
                                     W("model.early_exit_gate.bias")).squeeze(-1));  // [B, S]
  }
  // p_t = lambda_t prod_{j<t} (1 - lambda_j) for t < T; the last loop takes the rest.
  std::vector<Tensor> p;
  auto survive = torch::ones({B, S}, f64);
  for (int64_t t = 0; t + 1 < T; ++t) {
    p.push_back(lambdas[t] * survive);
    survive = survive * (1 - lambdas[t]);
  }
  p.push_back(survive);
  out.exit_probs = torch::stack(p, -1);
  return out;
}

}  // namespace

TEST(Ouro, ConfigMapping) {
  auto c = tiny_ouro_config();
  EXPECT_TRUE(is_ouro_config(c));
  auto cfg = ouro_model_config(c, "test");
  EXPECT_EQ(cfg.form, ModelForm::Ouro);
  EXPECT_EQ(cfg.d_model, 32);
  EXPECT_EQ(cfg.ffn_dim(), 48);
  EXPECT_EQ(cfg.n_layers, 2);
  EXPECT_EQ(cfg.n_heads, 4);
  EXPECT_EQ(cfg.kv_heads(), 2);
  EXPECT_EQ(cfg.dim_head(), 16);
  EXPECT_EQ(cfg.vocab_size, 53);
  EXPECT_EQ(cfg.n_loops, 3);
  EXPECT_EQ(cfg.max_seq_len, 128);
  EXPECT_DOUBLE_EQ(cfg.rope_theta, 50000.0);
  EXPECT_DOUBLE_EQ(cfg.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(cfg.early_exit_threshold, 0.9);
  EXPECT_EQ(cfg.rope_style, RopeStyle::Half);
  EXPECT_EQ(cfg.layer_pattern, "full");
  EXPECT_TRUE(cfg.exit_gate);
  EXPECT_FALSE(cfg.loop_gate);
  EXPECT_FALSE(cfg.attn_output_gate);
  EXPECT_FALSE(cfg.tie_embeddings);
  cfg.validate();
  // Defaults when optional fields are absent.
  for (const char* k : {"num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps"})
    c.erase(k);
  auto d = ouro_model_config(c, "test");
  EXPECT_EQ(d.kv_heads(), 4);
  EXPECT_EQ(d.dim_head(), 8);
  EXPECT_DOUBLE_EQ(d.rope_theta, 1e6);
  EXPECT_EQ(d.n_loops, 4);
  // The key map covers every parameter of the model it describes, one to one.
  auto map = ouro_key_map(cfg);
  LoopedLM model(cfg);
  std::set<std::string> keys;
  for (const auto& [name, t] : module_tensors(*model)) {
    ASSERT_TRUE(map.count(name)) << name;
    keys.insert(map[name]);
  }
  EXPECT_EQ(map.size(), module_tensors(*model).size());
  EXPECT_EQ(keys.size(), map.size());
  EXPECT_EQ(map["layers.1.ffn.w3.weight"], "model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(map["layers.0.mixer_post_norm.weight"], "model.layers.0.input_layernorm_2.weight");
  EXPECT_EQ(map["layers.0.ffn_norm.weight"], "model.layers.0.post_attention_layernorm.weight");
}

TEST(Ouro, ConfigErrors) {
  auto bad = [](const char* key, json value) {
    auto c = tiny_ouro_config();
    if (value.is_null()) c.erase(key);
    else c[key] = value;
    return c;
  };
  expect_error([&] { ouro_model_config(bad("hidden_size", nullptr), "cfg.json"); },
               {"cfg.json", "required field 'hidden_size' is missing"});
  expect_error([&] { ouro_model_config(bad("num_hidden_layers", "two"), "cfg.json"); },
               {"cfg.json", "'num_hidden_layers' must be an integer, found string \"two\""});
  // Every integer field takes only integers: 2.5 loops is not 2.
  for (const char* key : {"total_ut_steps", "hidden_size", "num_key_value_heads", "head_dim", "max_position_embeddings"})
    expect_error([&] { ouro_model_config(bad(key, 2.5), "cfg.json"); },
                 {"cfg.json: field '" + std::string(key) + "' must be an integer, found number 2.5"});
  expect_error([&] { ouro_model_config(bad("tie_word_embeddings", 1), "cfg.json"); },
               {"'tie_word_embeddings' must be true or false, found integer 1"});
  expect_error([&] { ouro_model_config(bad("rope_scaling", {{"type", "yarn"}}), "cfg.json"); },
               {"'rope_scaling' is not supported", "yarn"});
  expect_error([&] { ouro_model_config(bad("hidden_act", "gelu"), "cfg.json"); }, {"'hidden_act'", "gelu"});
  expect_error([&] { ouro_model_config(bad("use_sliding_window", true), "cfg.json"); }, {"use_sliding_window"});
  expect_error([&] { ouro_model_config(bad("model_type", "qwen2"), "cfg.json"); }, {"not an Ouro config"});
}

TEST(Ouro, FolderWithoutModelTypeIsRefusedNamingTheField) {
  auto c = tiny_ouro_config();
  c.erase("model_type");
  TempDir dir;
  write_ouro_folder(dir.path(), c, random_ouro_weights(tiny_ouro_config(), 3));
  expect_error([&] { load_checkpoint_config(dir.path()); },
               {"config.json", "no 'model_type'", "\"ouro\"", "'architectures'"});
  c.erase("architectures");  // still a Hugging Face config by its fields
  lt2::testing::write_bytes(dir / "config.json", c.dump());
  expect_error([&] { load_checkpoint_config(dir.path()); }, {"no 'model_type'", "'hidden_size'"});
}

TEST(Ouro, LogitsMatchAnIndependentReference) {
  const json c = tiny_ouro_config();
  const TensorMap weights = random_ouro_weights(c, 17);
  TempDir dir;
  write_ouro_folder(dir.path(), c, weights);

  auto model = load_checkpoint(dir.path(), torch::kFloat64);
  model->eval();
  EXPECT_EQ(check_checkpoint_weights(dir.path(), model), static_cast<int64_t>(weights.size()));
  const auto& cfg = model->config();
  EXPECT_EQ(cfg.form, ModelForm::Ouro);
  EXPECT_EQ(cfg.n_loops, 3);
  EXPECT_FALSE(model->rho.defined());
  // Every weight is the bf16 value, exactly.
  const auto map = ouro_key_map(cfg);
  for (const auto& [name, t] : module_tensors(*model)) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat64) << name;
    EXPECT_TRUE(torch::equal(t, weights.at(map.at(name)).to(torch::kFloat64))) << name;
  }

  TensorMap w64;
  for (const auto& [k, t] : weights) w64[k] = t.to(torch::kFloat64);
  torch::manual_seed(23);
  auto tokens = torch::randint(c["vocab_size"].get<int64_t>(), {2, 11}, torch::kLong);
  torch::NoGradGuard ng;
  auto ref = ouro_reference(w64, c, tokens);
  ForwardOptions opts;
  opts.loop_logits = true;
  opts.exit_at_loop = 3;
  auto out = model->forward(tokens, nullptr, opts);
  ASSERT_EQ(out.loop_logits.size(), 3u);
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(out.loop_logits[t].scalar_type(), torch::kFloat64);
    EXPECT_LT(rel_err(out.loop_logits[t], ref.loop_logits[t]), 1e-10) << "loop " << t + 1;
  }
  EXPECT_LT(rel_err(out.exit_probs, ref.exit_probs), 1e-10);
  EXPECT_LT(rel_err(out.logits, ref.loop_logits[2]), 1e-10);
  // The reference is not degenerate: loops differ and the exit distribution is spread.
  EXPECT_GT(rel_err(ref.loop_logits[0], ref.loop_logits[2]), 1e-2);
  EXPECT_GT(ref.exit_probs.min().item<double>(), 1e-5);
  EXPECT_GT(ref.exit_probs.mean(std::vector<int64_t>{0, 1}).min().item<double>(), 0.05);  // every loop takes mass

  // Default load: fp32 master weights converted from bf16.
  auto f32 = load_checkpoint(dir.path());
  for (const auto& p : f32->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  auto out32 = f32->forward(tokens, nullptr, opts);
  EXPECT_LT(rel_err(out32.loop_logits[2], ref.loop_logits[2]), 1e-4);
}

TEST(Ouro, TiedEmbeddings) {
  json c = tiny_ouro_config();
  c["tie_word_embeddings"] = true;
  TensorMap weights = random_ouro_weights(c, 19);
  TempDir dir;
  weights.erase("lm_head.weight");
  write_ouro_folder(dir.path(), c, weights);
  auto model = load_checkpoint(dir.path());
  EXPECT_FALSE(model->output);
  // HF writers may keep the tied duplicate: it is ignored.
  weights["lm_head.weight"] = weights["model.embed_tokens.weight"];
  write_ouro_folder(dir.path(), c, weights);
  EXPECT_TRUE(torch::equal(load_checkpoint(dir.path())->tok_embeddings->weight,
                           weights["model.embed_tokens.weight"].to(torch::kFloat32)));
}

TEST(Ouro, StrictLoadingNamesOuroKeys) {
  json c = tiny_ouro_config();
  TensorMap weights = random_ouro_weights(c, 29);
  TempDir dir;
  auto w = weights;
  w.erase("model.norm.weight");
  w["model.layers.0.self_attn.q_proj.bias"] = torch::zeros({64}, torch::kBFloat16);
  w["model.layers.1.mlp.down_proj.weight"] = torch::zeros({32, 40}, torch::kBFloat16);
  write_ouro_folder(dir.path(), c, w);
  expect_error([&] { load_checkpoint(dir.path()); },
               {"3 problems", "missing key 'model.norm.weight' (model tensor 'norm.weight'): expected shape [32]",
                "unexpected key 'model.layers.0.self_attn.q_proj.bias' with shape [64] BF16",
                "shape mismatch for key 'model.layers.1.mlp.down_proj.weight' (model tensor "
                "'layers.1.ffn.w2.weight'): expected [32, 48], found [32, 40]"});
  // A config that does not validate names the field.
  c["num_key_value_heads"] = 3;
  write_ouro_folder(dir.path(), c, weights);
  expect_error([&] { load_checkpoint(dir.path()); }, {"'n_heads' (4) must be a multiple of 'n_kv_heads' (3)"});
}
