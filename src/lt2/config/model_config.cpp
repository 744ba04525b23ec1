#include "lt2/config/model_config.h"

#include <cmath>
#include <tuple>

#include "lt2/config/layer_pattern.h"
#include "lt2/util/fs.h"

namespace lt2 {

std::string to_string(ModelForm f) { return f == ModelForm::LT2 ? "lt2" : "ouro"; }
std::string to_string(RopeStyle s) { return s == RopeStyle::Interleaved ? "interleaved" : "half"; }

int64_t ModelConfig::ffn_dim() const {
  if (ffn_hidden > 0) return ffn_hidden;
  int64_t h = static_cast<int64_t>(ffn_mult * static_cast<double>((2 * 4 * d_model) / 3));
  return (h + 255) / 256 * 256;
}

double ModelConfig::init_scale() const {
  return init_std > 0 ? init_std : 1.0 / std::sqrt(static_cast<double>(d_model));
}

json ModelConfig::options_for(const std::string& mixer) const {
  auto it = mixer_options.find(mixer);
  return it == mixer_options.end() ? json::object() : *it;
}

void ModelConfig::validate() const {
  const std::string w = "model config '" + name + "'";
  auto positive = [&](const char* field, int64_t v) {
    LT2_CHECK(v > 0, w, ": '", field, "' must be > 0, found ", v);
  };
  LT2_CHECK(vocab_size >= 0, w, ": 'vocab_size' must be > 0 (or 0 = take it from the training data), found ", vocab_size);
  positive("d_model", d_model);
  positive("n_layers", n_layers);
  positive("n_heads", n_heads);
  positive("n_loops", n_loops);
  positive("max_seq_len", max_seq_len);
  LT2_CHECK(n_kv_heads >= 0, w, ": 'n_kv_heads' must be >= 0 (0 = n_heads), found ", n_kv_heads);
  LT2_CHECK(n_heads % kv_heads() == 0, w, ": 'n_heads' (", n_heads,
            ") must be a multiple of 'n_kv_heads' (", kv_heads(), ")");
  LT2_CHECK(head_dim > 0 || d_model % n_heads == 0, w, ": 'd_model' (", d_model,
            ") must be divisible by 'n_heads' (", n_heads, ") when 'head_dim' is 0");
  LT2_CHECK(dim_head() % 2 == 0, w, ": the head dim must be even for RoPE, found ", dim_head());
  LT2_CHECK(ffn_hidden >= 0, w, ": 'ffn_hidden' must be >= 0, found ", ffn_hidden);
  LT2_CHECK(ffn_mult > 0 && ffn_mult <= 64, w, ": 'ffn_mult' must be in (0, 64], found ", ffn_mult);
  // Shapes beyond any real model are refused before anything is sized from them (a config that
  // claims 10^16 layers would otherwise allocate a name for each).
  for (const auto& [field, v, max] : {std::tuple{"vocab_size", vocab_size, int64_t{1} << 24},
                                      {"d_model", d_model, int64_t{1} << 18}, {"n_layers", n_layers, int64_t{4096}},
                                      {"n_loops", n_loops, int64_t{4096}}, {"n_heads", n_heads, int64_t{1} << 14},
                                      {"n_kv_heads", n_kv_heads, int64_t{1} << 14}, {"head_dim", head_dim, int64_t{1} << 14},
                                      {"ffn_hidden", ffn_hidden, int64_t{1} << 22}, {"max_seq_len", max_seq_len, int64_t{1} << 24}})
    LT2_CHECK(v <= max, w, ": '", field, "' must be at most ", max, ", found ", v);
  LT2_CHECK(rope_theta > 0, w, ": 'rope_theta' must be > 0, found ", rope_theta);
  LT2_CHECK(norm_eps > 0 && norm_eps < 1, w, ": 'norm_eps' must be in (0, 1), found ", norm_eps);
  LT2_CHECK(init_std >= 0, w, ": 'init_std' must be >= 0 (0 = d_model^-1/2), found ", init_std);
  LT2_CHECK(early_exit_threshold > 0 && early_exit_threshold <= 1, w,
            ": 'early_exit_threshold' must be in (0, 1], found ", early_exit_threshold);
  LT2_CHECK(!(form == ModelForm::Ouro && loop_gate), w,
            ": 'loop_gate' (LT2's rho) is only for form 'lt2'; set it false for form 'ouro'");
  LT2_CHECK(!(form == ModelForm::LT2 && exit_gate), w,
            ": 'exit_gate' is only for form 'ouro'");
  LT2_CHECK(mixer_options.is_object(), w, ": 'mixer' must be an object of per-mixer settings");
  // The pattern's syntax; its mixer names are checked against the registry when a model is built.
  layer_pattern_names(*this);
}

json ModelConfig::to_json() const {
  return json{{"name", name},
              {"form", to_string(form)},
              {"vocab_size", vocab_size},
              {"d_model", d_model},
              {"n_layers", n_layers},
              {"n_heads", n_heads},
              {"n_kv_heads", n_kv_heads},
              {"head_dim", head_dim},
              {"ffn_hidden", ffn_hidden},
              {"ffn_mult", ffn_mult},
              {"n_loops", n_loops},
              {"layer_pattern", layer_pattern},
              {"rope_theta", rope_theta},
              {"rope_style", to_string(rope_style)},
              {"norm_eps", norm_eps},
              {"max_seq_len", max_seq_len},
              {"tie_embeddings", tie_embeddings},
              {"attn_output_gate", attn_output_gate},
              {"loop_gate", loop_gate},
              {"exit_gate", exit_gate},
              {"early_exit_threshold", early_exit_threshold},
              {"init_std", init_std},
              {"mixer", mixer_options}};
}

ModelConfig ModelConfig::from_json(const json& j, const std::string& where) {
  json_reject_unknown(j,
                      {"name", "form", "vocab_size", "d_model", "n_layers", "n_heads",
                       "n_kv_heads", "head_dim", "ffn_hidden", "ffn_mult", "n_loops",
                       "layer_pattern", "rope_theta", "rope_style", "norm_eps", "max_seq_len",
                       "tie_embeddings", "attn_output_gate", "loop_gate", "exit_gate",
                       "early_exit_threshold", "init_std", "mixer", "comment"},
                      where);
  ModelConfig c;
  json_get(j, "name", c.name, where);
  std::string form = to_string(c.form), rope = to_string(c.rope_style);
  json_get(j, "form", form, where);
  if (form == "lt2") c.form = ModelForm::LT2;
  else if (form == "ouro") c.form = ModelForm::Ouro;
  else throw Error(cat(where, ": 'form' must be \"lt2\" or \"ouro\", found \"", form, "\""));
  if (c.form == ModelForm::Ouro) {  // Ouro's defaults differ; explicit fields still win below
    c.loop_gate = false;
    c.exit_gate = true;
    c.attn_output_gate = false;
    c.rope_style = RopeStyle::Half;
    c.rope_theta = 1e6;
    c.norm_eps = 1e-6;
    rope = "half";
  }
  json_get(j, "rope_style", rope, where);
  if (rope == "interleaved") c.rope_style = RopeStyle::Interleaved;
  else if (rope == "half") c.rope_style = RopeStyle::Half;
  else throw Error(cat(where, ": 'rope_style' must be \"interleaved\" or \"half\", found \"", rope, "\""));
  json_get(j, "vocab_size", c.vocab_size, where);
  json_get(j, "d_model", c.d_model, where);
  json_get(j, "n_layers", c.n_layers, where);
  json_get(j, "n_heads", c.n_heads, where);
  json_get(j, "n_kv_heads", c.n_kv_heads, where);
  json_get(j, "head_dim", c.head_dim, where);
  json_get(j, "ffn_hidden", c.ffn_hidden, where);
  json_get(j, "ffn_mult", c.ffn_mult, where);
  json_get(j, "n_loops", c.n_loops, where);
  json_get(j, "layer_pattern", c.layer_pattern, where);
  json_get(j, "rope_theta", c.rope_theta, where);
  json_get(j, "norm_eps", c.norm_eps, where);
  json_get(j, "max_seq_len", c.max_seq_len, where);
  json_get(j, "tie_embeddings", c.tie_embeddings, where);
  json_get(j, "attn_output_gate", c.attn_output_gate, where);
  json_get(j, "loop_gate", c.loop_gate, where);
  json_get(j, "exit_gate", c.exit_gate, where);
  json_get(j, "early_exit_threshold", c.early_exit_threshold, where);
  json_get(j, "init_std", c.init_std, where);
  json_get(j, "mixer", c.mixer_options, where);
  c.validate();
  return c;
}

ModelConfig ModelConfig::load(const std::string& path) {
  return from_json(load_json_file(path), "'" + path + "'");
}

void ModelConfig::save(const std::string& path) const { write_file_atomic(path, to_json().dump(2) + "\n"); }

}  // namespace lt2
