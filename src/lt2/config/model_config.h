// ModelConfig: the shape of a looped model, as JSON (load, save, validate).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lt2/util/json.h"

namespace lt2 {

// How the loop is wired (the LT2 and Ouro papers).
//   lt2:  pre-norm blocks; h_tau = F(h_{tau-1}) + rho_tau * h_{tau-1}; one final norm; CE on the last loop.
//   ouro: sandwich-norm blocks; the final norm after every loop feeds the next loop; exit gate.
enum class ModelForm { LT2, Ouro };
// RoPE conventions: Lingua's interleaved pairs (LT2) or rotate-half (Ouro / HF Llama).
enum class RopeStyle { Interleaved, Half };

struct ModelConfig {
  std::string name = "unnamed";
  ModelForm form = ModelForm::LT2;
  int64_t vocab_size = 264;  // 0 = taken from the training data (`lt2 train` fills it in)
  int64_t d_model = 128;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 0;   // 0 = n_heads (MHA)
  int64_t head_dim = 0;     // 0 = d_model / n_heads
  int64_t ffn_hidden = 0;   // 0 = round_up_256(ffn_mult * int(2 * 4d / 3))
  double ffn_mult = 1.0;
  int64_t n_loops = 4;
  std::string layer_pattern = "full";  // see model/pattern.h
  double rope_theta = 1e4;
  RopeStyle rope_style = RopeStyle::Interleaved;
  double norm_eps = 1e-5;
  int64_t max_seq_len = 4096;
  bool tie_embeddings = false;
  bool attn_output_gate = true;   // SDPA output gate on softmax-attention layers
  bool loop_gate = true;          // LT2's per-loop residual gate rho (form lt2 only)
  bool exit_gate = false;         // Ouro's exit gate (form ouro only)
  double early_exit_threshold = 1.0;  // Ouro: exit at the first loop whose cumulative p >= q
  double init_std = 0.0;          // 0 = d_model^-1/2 (truncated at +-3 std)
  json mixer_options = json::object();  // per-mixer settings: {"gdn": {...}, "window": {...}}

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t dim_head() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  int64_t ffn_dim() const;
  double init_scale() const;
  // Options for one mixer kind ("gdn", ...): an object, empty when the config names none.
  json options_for(const std::string& mixer) const;

  // Throws lt2::Error naming the bad field and its allowed values.
  void validate() const;
  json to_json() const;
  static ModelConfig from_json(const json& j, const std::string& where = "model config");
  static ModelConfig load(const std::string& path);
  void save(const std::string& path) const;
};

std::string to_string(ModelForm f);
std::string to_string(RopeStyle s);

}  // namespace lt2
