// One mixer layer's forward and forward+backward time at a training shape, on the chosen device,
// under bf16 autocast on GPU. With --trace, also writes a per-op profile (chrome trace JSON).
//   mixer_bench --model lt2-gdn-100m --mixer gdn --batch 16 --seq 2048 [--trace gdn.json]
#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <chrono>
#include <cstdio>

#include "lt2/config/presets.h"
#include "lt2/mixers/registry.h"
#include "lt2/util/json.h"

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
  CLI11_PARSE(app, argc, argv);
  try {
    auto cfg = lt2::load_model_config(model);
    if (cfg.vocab_size == 0) cfg.vocab_size = 256;
    const bool cuda = torch::cuda::is_available();
    const auto dev = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    auto m = lt2::make_mixer(mixer, cfg, 0);
    m->to(dev);
    auto x = torch::randn({batch, seq, cfg.d_model}, torch::TensorOptions().device(dev)).requires_grad_(true);
    auto sync = [&] { if (cuda) torch::cuda::synchronize(); };
    auto run = [&](bool backward) {
      if (cuda) {
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      }
      auto y = m->forward(x, lt2::Positions{});
      if (cuda) {
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
      }
      if (backward) y.to(torch::kFloat32).square().mean().backward();
    };
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
    if (!trace.empty()) {
      torch::autograd::profiler::RecordProfile guard(trace);
      run(true);
      sync();
    }
    lt2::json j{{"model", model}, {"mixer", mixer}, {"batch", batch}, {"seq", seq},
                {"device", cuda ? "cuda" : "cpu"}, {"forward_ms", fwd}, {"forward_backward_ms", fwd_bwd},
                {"tokens_per_s_fwd_bwd", batch * seq / (fwd_bwd / 1000)}};
    std::printf("RESULT %s\n", j.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixer_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
