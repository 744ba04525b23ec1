// Ouro checkpoints (ByteDance's Ouro, HF format): an HF folder whose config.json has model_type "ouro" and
// whose model.safetensors holds bf16 weights under HF names. This maps the config to a ModelConfig
// of form "ouro" and our parameter names to Ouro's keys:
//   model.embed_tokens.weight                              -> tok_embeddings.weight
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight       -> layers.{i}.mixer.{wq,wk,wv,wo}.weight
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight        -> layers.{i}.ffn.{w1,w3,w2}.weight
//   model.layers.{i}.input_layernorm.weight                -> layers.{i}.mixer_norm.weight
//   model.layers.{i}.input_layernorm_2.weight              -> layers.{i}.mixer_post_norm.weight
//   model.layers.{i}.post_attention_layernorm.weight       -> layers.{i}.ffn_norm.weight
//   model.layers.{i}.post_attention_layernorm_2.weight     -> layers.{i}.ffn_post_norm.weight
//   model.norm.weight                                      -> norm.weight
//   model.early_exit_gate.{weight,bias}                    -> exit_gate.{weight,bias}
//   lm_head.weight                                         -> output.weight (absent when tied)
#pragma once
#include <set>
#include <string>

#include "lt2/config/model_config.h"
#include "lt2/io/checkpoint.h"
#include "lt2/util/json.h"

namespace lt2 {

// True when an HF config.json describes an Ouro model (model_type "ouro").
bool is_ouro_config(const json& config);

// Ouro's config.json fields as a ModelConfig of form "ouro": hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, vocab_size (required); num_key_value_heads, head_dim,
// rms_norm_eps, rope_theta, max_position_embeddings, total_ut_steps, early_exit_threshold,
// tie_word_embeddings (optional). Sandwich norm, rotate-half RoPE, exit gate on, no SDPA output
// gate, no rho. Features lt2 does not implement (rope_scaling, sliding windows, projection
// biases, activations other than SiLU) are errors. `where` prefixes messages. The result is not
// yet validated (ModelConfig::validate, which LoopedLM's constructor runs).
ModelConfig ouro_model_config(const json& config, const std::string& where);

// Our parameter name -> Ouro checkpoint key, for every parameter of a LoopedLM built from `cfg`.
NameMap ouro_key_map(const ModelConfig& cfg);

// Keys an Ouro checkpoint may hold that lt2 does not load: lm_head.weight of a tied model (HF
// writers sometimes keep the duplicate).
std::set<std::string> ouro_ignored_keys(const ModelConfig& cfg);

}  // namespace lt2
