#include "lt2/train/flops.h"

#include "lt2/util/environment.h"

namespace lt2 {

double forward_flops_per_token(const LoopedLMImpl& model, int64_t seq_len) {
  const auto& cfg = model.config();
  int64_t block_params = 0;
  for (const auto& p : model.layers->parameters())
    if (p.dim() >= 2) block_params += p.numel();
  const double head = static_cast<double>(cfg.d_model) * static_cast<double>(cfg.vocab_size);
  double flops = 2.0 * (static_cast<double>(cfg.n_loops) * block_params + head);
  // Attention scores and weighted values: 2 matmuls x 2 FLOPs x (seq_len / 2) keys x H x D.
  int64_t attention_layers = 0;
  for (const auto& name : model.layer_mixers()) attention_layers += name == "full";
  flops += static_cast<double>(cfg.n_loops * attention_layers) * 2.0 * static_cast<double>(seq_len) *
           static_cast<double>(cfg.n_heads * cfg.dim_head());
  return flops;
}

double peak_flops(const std::string& device_name) {
  if (const auto tflops = environment().peak_tflops) return *tflops * 1e12;
  if (device_name.find("H100") != std::string::npos || device_name.find("H200") != std::string::npos ||
      device_name.find("GH200") != std::string::npos)
    return 989e12;  // dense bf16, SXM
  if (device_name.find("A100") != std::string::npos) return 312e12;
  if (device_name.find("B200") != std::string::npos) return 2250e12;
  return 0;
}

}  // namespace lt2
