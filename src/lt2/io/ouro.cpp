#include "lt2/io/ouro.h"

namespace lt2 {

bool is_ouro_config(const json& config) {
  return config.is_object() && config.contains("model_type") && config["model_type"] == "ouro";
}

ModelConfig ouro_model_config(const json& j, const std::string& where) {
  LT2_CHECK(is_ouro_config(j), where, ": not an Ouro config (model_type must be \"ouro\")");
  // Features of the HF config family that lt2 does not implement: refuse rather than mis-load.
  std::string act = "silu";
  json_get(j, "hidden_act", act, where);
  LT2_CHECK(act == "silu", where, ": 'hidden_act' must be \"silu\" (SwiGLU), found \"", act, "\"");
  LT2_CHECK(!j.contains("rope_scaling") || j["rope_scaling"].is_null(), where,
            ": 'rope_scaling' is not supported, found ", j.value("rope_scaling", json()).dump());
  for (const char* flag : {"use_sliding_window", "attention_bias", "mlp_bias"}) {
    bool on = false;
    json_get(j, flag, on, where);
    LT2_CHECK(!on, where, ": '", flag, "' true is not supported (lt2's Ouro form has none)");
  }
  if (j.contains("layer_types") && j["layer_types"].is_array())
    for (const auto& t : j["layer_types"])
      LT2_CHECK(t == "full_attention", where, ": only \"full_attention\" layers are supported, found ",
                t.dump(), " in 'layer_types'");

  ModelConfig c;  // Ouro form: sandwich norm, norm after every loop, exit gate
  c.form = ModelForm::Ouro;
  c.layer_pattern = "full";
  c.loop_gate = false;
  c.exit_gate = true;
  c.attn_output_gate = false;
  c.rope_style = RopeStyle::Half;
  c.rope_theta = 1e6;  // Ouro's released value; the config's own value wins below
  c.norm_eps = 1e-6;
  c.n_loops = 4;
  c.name = "ouro";
  json_get(j, "_name_or_path", c.name, where);
  c.d_model = json_require<int64_t>(j, "hidden_size", where);
  c.ffn_hidden = json_require<int64_t>(j, "intermediate_size", where);
  c.n_layers = json_require<int64_t>(j, "num_hidden_layers", where);
  c.n_heads = json_require<int64_t>(j, "num_attention_heads", where);
  c.vocab_size = json_require<int64_t>(j, "vocab_size", where);
  json_get(j, "num_key_value_heads", c.n_kv_heads, where);
  json_get(j, "head_dim", c.head_dim, where);
  json_get(j, "rms_norm_eps", c.norm_eps, where);
  json_get(j, "rope_theta", c.rope_theta, where);
  json_get(j, "max_position_embeddings", c.max_seq_len, where);
  json_get(j, "total_ut_steps", c.n_loops, where);
  json_get(j, "early_exit_threshold", c.early_exit_threshold, where);
  json_get(j, "tie_word_embeddings", c.tie_embeddings, where);
  return c;
}

NameMap ouro_key_map(const ModelConfig& cfg) {
  NameMap m;
  m["tok_embeddings.weight"] = "model.embed_tokens.weight";
  for (int64_t i = 0; i < cfg.n_layers; ++i) {
    const std::string ours = "layers." + std::to_string(i) + ".";
    const std::string theirs = "model.layers." + std::to_string(i) + ".";
    for (const auto& [w, proj] : {std::pair{"wq", "q_proj"}, {"wk", "k_proj"}, {"wv", "v_proj"}, {"wo", "o_proj"}})
      m[ours + "mixer." + w + ".weight"] = theirs + "self_attn." + proj + ".weight";
    for (const auto& [w, proj] : {std::pair{"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}})
      m[ours + "ffn." + w + ".weight"] = theirs + "mlp." + proj + ".weight";
    for (const auto& [norm, ln] : {std::pair{"mixer_norm", "input_layernorm"},
                                   {"mixer_post_norm", "input_layernorm_2"},
                                   {"ffn_norm", "post_attention_layernorm"},
                                   {"ffn_post_norm", "post_attention_layernorm_2"}})
      m[ours + norm + ".weight"] = theirs + ln + ".weight";
  }
  m["norm.weight"] = "model.norm.weight";
  if (cfg.exit_gate) {
    m["exit_gate.weight"] = "model.early_exit_gate.weight";
    m["exit_gate.bias"] = "model.early_exit_gate.bias";
  }
  if (!cfg.tie_embeddings) m["output.weight"] = "lm_head.weight";
  return m;
}

std::set<std::string> ouro_ignored_keys(const ModelConfig& cfg) {
  if (cfg.tie_embeddings) return {"lm_head.weight"};
  return {};
}

}  // namespace lt2
