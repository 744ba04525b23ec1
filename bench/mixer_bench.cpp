// One mixer layer's forward and forward+backward time at a training shape, on the chosen device,
// under bf16 autocast on GPU. With --trace, also writes a per-op profile (chrome trace JSON).
// With --core, times the delta-rule recurrence alone instead (ops::delta_rule_chunked on bf16
// q, k, v: gdn one decay per head, kda one per key channel, deltanet none), the counterpart of
// flash-linear-attention's chunk_gated_delta_rule / chunk_kda / chunk_delta_rule; --core --mixer
// window times ops::window_attention (--head-k is the head dim, --window the band) and --core
// --mixer full libtorch's causal SDPA at the same shape, its upper bound; --core --mixer gla
// (one decay per key channel), mamba2 (one per head) or linear (none) times the gated linear
// family's chunked form (ops::gated_linear_chunked; --option gated_prefix_chunks=0 its chunk scan).
//   mixer_bench --model lt2-gdn-100m --mixer gdn --batch 16 --seq 2048 [--trace gdn.json]
//   mixer_bench --core --mixer gdn --batch 8 --seq 4096 --heads 16 --head-k 96 --head-v 192
//   mixer_bench --core --mixer window --window 512 --batch 1 --seq 32768 --head-k 128 --option window_flash=1
//   mixer_bench --model lt2-gdn-1.3b --mixer window --mixer-option window=512 --batch 8 --seq 4096
//   mixer_bench --model lt2-gdn-1.3b --batch 8 --seq 4096 --option short_conv=0   (an A/B of a kernel)
#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include "lt2/config/presets.h"
#include "lt2/infer/kernel_profile.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/nn/precision.h"
#include "lt2/util/error.h"
#include "lt2/util/json.h"
#include "kernel_switches.h"
#include "profile_flags.h"

namespace {
double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Time one mixer layer (forward, forward+backward)"};
  std::string model = "lt2-gdn-100m", mixer = "gdn", trace;
  int64_t batch = 16, seq = 2048, iters = 10;
  app.add_option("--model", model, "Preset whose shape and mixer options to use")->capture_default_str();
  app.add_option("--mixer", mixer, "Mixer name")->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_option("--iters", iters)->capture_default_str();
  app.add_option("--trace", trace, "Write a chrome-trace profile of one forward+backward here");
  bool core = false;
  int64_t heads = 16, head_k = 96, head_v = 192, chunk = 64, window = 512;
  app.add_flag("--core", core,
               "Time the op alone, not the layer: the delta-rule recurrence (gdn, kda, deltanet), "
               "ops::window_attention (window) or causal SDPA (full)");
  app.add_option("--heads", heads, "--core: heads")->capture_default_str();
  app.add_option("--head-k", head_k, "--core: key head dim (window, full: the head dim)")->capture_default_str();
  app.add_option("--window", window, "--core --mixer window: keys each query sees, itself included")
      ->capture_default_str();
  app.add_option("--head-v", head_v, "--core: value head dim")->capture_default_str();
  app.add_option("--chunk", chunk, "--core: chunk size")->capture_default_str();
  bool tf32 = true;
  ProfileFlags profile;
  profile.add_to(app, "CUDA: after timing, print the per-kernel GPU time of this many forward+backward runs");
  app.add_option("--tf32", tf32, "On CUDA: fp32 matmuls on TF32 tensor cores (1, as lt2 train does under bf16) or in fp32 (0)")
      ->capture_default_str();
  std::vector<std::string> mixer_options;
  app.add_option("--mixer-option", mixer_options,
                 "An option of the mixer as name=value (value as JSON, e.g. window=512), over the preset's; "
                 "repeatable");
  KernelSwitchFlags switches;
  switches.add_to(app);
  CLI11_PARSE(app, argc, argv);
  try {
    const KernelSwitchFlags::Scope kernel_switches(switches.assignments);
    const bool cuda = torch::cuda::is_available();
    const auto dev = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    auto sync = [&] { if (cuda) torch::cuda::synchronize(); };
    lt2::Tf32Scope tf32_scope(cuda && tf32);
    std::function<void(bool)> run;
    lt2::Mixer mixer_layer;
    torch::Tensor x;
    std::vector<torch::Tensor> core_inputs;  // q, k, v (attention); q, k, v, beta, g (the recurrences)
    const auto bf16 = torch::TensorOptions().device(dev).dtype(cuda ? torch::kBFloat16 : torch::kFloat32);
    if (core && (mixer == "window" || mixer == "full")) {
      for (int i = 0; i < 3; ++i)  // q, k, v [B, H, T, D]
        core_inputs.push_back(torch::randn({batch, heads, seq, head_k}, bf16).requires_grad_(true));
      run = [&](bool backward) {
        const auto& in = core_inputs;
        auto o = mixer == "window" ? lt2::window_attention(in[0], in[1], in[2], window)
                                   : at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, /*is_causal=*/true);
        if (backward) o.to(torch::kFloat32).square().mean().backward();
      };
    } else if (core) {
      const bool gated = mixer == "gla" || mixer == "mamba2" || mixer == "linear";
      LT2_CHECK(gated || mixer == "gdn" || mixer == "kda" || mixer == "deltanet",
                "--core times the delta-rule recurrence (gdn, kda, deltanet), the gated linear family (gla, mamba2, "
                "linear) or attention (window, full), found ", mixer);
      // The log-gate: none, one per head or one per key channel.
      const auto f32 = bf16.dtype(torch::kFloat32);
      const auto g = mixer == "linear" || mixer == "deltanet" ? torch::Tensor()
                     : mixer == "mamba2" || mixer == "gdn"    ? -torch::rand({batch, seq, heads}, f32)
                                                              : -torch::rand({batch, seq, heads, head_k}, f32);
      auto k = torch::randn({batch, seq, heads, head_k}, bf16);
      core_inputs = {torch::randn({batch, seq, heads, head_k}, bf16), gated ? k : k / k.norm(2, -1, true),
                     torch::randn({batch, seq, heads, head_v}, bf16),
                     gated ? torch::Tensor() : torch::rand({batch, seq, heads}, bf16), g};  // q, k, v, beta, g
      for (auto& t : core_inputs)
        if (t.defined()) t.requires_grad_(true);
      run = [&, gated](bool backward) {
        const auto& in = core_inputs;
        const double scale = 1.0 / std::sqrt(head_k);
        auto r = gated ? lt2::ops::gated_linear_chunked(in[0], in[1], in[2], in[4], scale, {}, chunk)
                       : lt2::ops::delta_rule_chunked(in[0], in[1], in[2], in[3], in[4], scale, {}, chunk);
        if (backward) r.o.to(torch::kFloat32).square().mean().backward();
      };
    } else {
      auto cfg = lt2::load_model_config(model);
      if (cfg.vocab_size == 0) cfg.vocab_size = 256;
      for (const auto& o : mixer_options) {
        const auto [name, value] = split_assignment(o, "--mixer-option");
        cfg.mixer_options[mixer][name] = lt2::json::parse(value);
      }
      mixer_layer = lt2::make_mixer(mixer, cfg, 0);
      mixer_layer->to(dev);
      x = torch::randn({batch, seq, cfg.d_model}, torch::TensorOptions().device(dev)).requires_grad_(true);
      run = [&](bool backward) {
        if (cuda) {
          at::autocast::set_autocast_enabled(at::kCUDA, true);
          at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        }
        auto y = mixer_layer->forward(x, lt2::Positions{});
        if (cuda) {
          at::autocast::set_autocast_enabled(at::kCUDA, false);
          at::autocast::clear_cache();
        }
        if (backward) y.to(torch::kFloat32).square().mean().backward();
      };
    }
    auto time = [&](bool backward) {
      for (int i = 0; i < 3; ++i) run(backward);
      sync();
      double t0 = now_ms();
      for (int64_t i = 0; i < iters; ++i) run(backward);
      sync();
      return (now_ms() - t0) / iters;
    };
    double fwd;
    {
      torch::NoGradGuard ng;
      fwd = time(false);
    }
    double fwd_bwd = time(true);
    if (profile.runs > 0) {
      const auto p = lt2::profile_device_activity([&] { run(true); }, profile.runs, profile.by_op);
      std::printf("%s\n", lt2::kernel_profile_table(p, profile.rows(25)).c_str());
    }
    if (!trace.empty()) {
      torch::autograd::profiler::RecordProfile guard(trace);
      run(true);
      sync();
    }
    lt2::json j{{"model", core ? "core" : model}, {"mixer", mixer}, {"batch", batch}, {"seq", seq},
                {"device", cuda ? "cuda" : "cpu"}, {"forward_ms", fwd}, {"forward_backward_ms", fwd_bwd},
                {"tokens_per_s_fwd_bwd", batch * seq / (fwd_bwd / 1000)}};
    if (mixer_layer) {
      int64_t params = 0;
      for (const auto& p : mixer_layer->parameters()) params += p.numel();
      j["params"] = params;
    }
    j["tf32"] = cuda && tf32;
    j["options"] = switches.assignments;
    if (core) j["core"] = {{"heads", heads}, {"head_k", head_k}, {"head_v", head_v}, {"chunk", chunk}};
    if (core && mixer == "window") j["core"]["window"] = window;
    j["mixer_options"] = mixer_options;
    std::printf("RESULT %s\n", j.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixer_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
