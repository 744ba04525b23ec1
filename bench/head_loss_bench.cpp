// The LM head + cross-entropy of a training step, fused (ops/loss/lm_head_loss.h: chunked, no
// [tokens x vocab] logits) against the reference (`lt2 train`'s former path: at::linear to the full
// logits, then cross_entropy), on the GPU when there is one (under bf16 autocast with fp32 master
// weights, as `lt2 train` runs), else on the CPU in fp32. For each (d, vocab) and each fused chunk
// size: the mean forward + backward time over --iters steps after --warmup, the TFLOP/s of the
// three products (2 N V d FLOPs each), the bytes the forward keeps for backward and the peak bytes
// of a step (ops/memory_meter.h: blocks allocated during the step, inputs excluded). A table, then
// one `RESULT {json}` line per row; --json also writes them all as one array.
//   head_loss_bench [--tokens 16384] [--d 768,2048] [--vocab 32768,131072] [--chunks 0,2048]
//   head_loss_bench --tokens 2048 --d 256 --vocab 8192 --iters 3      (a CPU-sized run)
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "lt2/kernels/kernels.h"
#include "lt2/ops/loss/lm_head_loss.h"
#include "lt2/ops/memory_meter.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/train/autocast.h"
#include "lt2/train/losses.h"
#include "lt2/util/error.h"
#include "lt2/util/json.h"

namespace {

using torch::Tensor;

struct Measured {
  double ms = 0;                // mean forward + backward
  int64_t kept = 0, peak = 0;  // bytes kept for backward; peak bytes of the step
};

// One training step's loss: forward under autocast (GPU), backward.
Measured measure(const std::function<Tensor()>& loss_fn, const Tensor& hidden, const Tensor& weight, bool cuda,
                 int64_t warmup, int64_t iters) {
  auto sync = [cuda] {
    if (cuda) torch::cuda::synchronize();
  };
  auto step = [&](lt2::ops::MemoryMeter* meter, int64_t* kept) {
    hidden.mutable_grad() = Tensor();
    weight.mutable_grad() = Tensor();
    Tensor loss;
    {
      lt2::AutocastScope ac(cuda);
      loss = loss_fn();
    }
    if (kept) {
      sync();
      *kept = meter->current();
    }
    loss.backward();
  };
  Measured m;
  {
    lt2::ops::MemoryMeter meter(hidden.device());
    step(&meter, &m.kept);
    sync();
    m.peak = meter.peak();
  }
  for (int64_t i = 0; i < warmup; ++i) step(nullptr, nullptr);
  sync();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) step(nullptr, nullptr);
  sync();
  m.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fused vs reference LM head + cross-entropy: time and memory of a training step"};
  int64_t tokens = 16384, warmup = 2, iters = 10;
  std::vector<int64_t> dims{768, 2048}, vocabs{32768, 131072}, chunks{0};
  std::string json_path;
  app.add_option("--tokens", tokens, "Tokens of the step (rows of the hidden state)")->capture_default_str();
  app.add_option("--d", dims, "Model widths")->delimiter(',')->capture_default_str();
  app.add_option("--vocab", vocabs, "Vocabulary sizes")->delimiter(',')->capture_default_str();
  app.add_option("--chunks", chunks, "Fused chunk sizes in tokens (0 = automatic)")->delimiter(',')->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  app.add_option("--iters", iters)->capture_default_str();
  app.add_option("--json", json_path, "Also write every row to this file, as one JSON array");
  CLI11_PARSE(app, argc, argv);
  try {
    LT2_CHECK(tokens > 0 && warmup >= 0 && iters >= 1, "--tokens and --iters must be >= 1, --warmup >= 0");
    const bool cuda = torch::cuda::is_available();
    const auto dev = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    const std::string device = cuda ? lt2::kernels::device_name(0) : "cpu";
    std::printf("%s, %s, %lld tokens\n\n| d | vocab | path | chunk | ms | TFLOP/s | kept GB | peak GB | speed-up | peak ratio |\n"
                "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
                device.c_str(), cuda ? "bf16 autocast" : "fp32", static_cast<long long>(tokens));
    std::vector<lt2::json> rows;
    for (int64_t d : dims)
      for (int64_t V : vocabs) {
        torch::manual_seed(0);
        const auto f32 = torch::TensorOptions().device(dev).dtype(torch::kFloat32);
        auto hidden = torch::randn({tokens, d}, f32).requires_grad_(true);
        auto weight = (torch::randn({V, d}, f32) * 0.02).requires_grad_(true);
        const auto labels = torch::randint(V, {tokens}, f32.dtype(torch::kLong));
        const double flops = 3 * 2.0 * static_cast<double>(tokens) * static_cast<double>(V) * static_cast<double>(d);
        auto report = [&](const std::string& path, int64_t chunk, const Measured& m, const Measured& ref) {
          const double tflops = flops / (m.ms * 1e-3) / 1e12;
          std::printf("| %lld | %lld | %s | %lld | %.2f | %.1f | %.3f | %.3f | %.2fx | %.3f |\n", static_cast<long long>(d),
                      static_cast<long long>(V), path.c_str(), static_cast<long long>(chunk), m.ms, tflops, m.kept / 1e9,
                      m.peak / 1e9, ref.ms / m.ms, static_cast<double>(m.peak) / static_cast<double>(ref.peak));
          std::fflush(stdout);
          lt2::json j{{"bench", "head_loss"}, {"device", device}, {"dtype", cuda ? "bf16_autocast" : "fp32"},
                      {"tokens", tokens}, {"d", d}, {"vocab", V}, {"path", path}, {"chunk_tokens", chunk},
                      {"ms", m.ms}, {"tflops", tflops}, {"kept_bytes", m.kept}, {"peak_bytes", m.peak},
                      {"speedup_vs_reference", ref.ms / m.ms}, {"iters", iters}};
          std::printf("RESULT %s\n", j.dump().c_str());
          rows.push_back(j);
        };
        const auto ref = measure([&] { return lt2::cross_entropy(lt2::ops::linear(hidden, weight), labels); }, hidden,
                                 weight, cuda, warmup, iters);
        report("reference", 0, ref, ref);
        for (int64_t chunk : chunks) {
          lt2::ops::HeadLossOptions o;
          o.chunk_tokens = chunk;
          const auto fused = measure([&] { return lt2::ops::lm_head_cross_entropy(hidden, weight, labels, o); },
                                     hidden, weight, cuda, warmup, iters);
          report("fused", lt2::ops::head_loss_chunk_tokens(V, 4, o), fused, ref);
        }
      }
    if (!json_path.empty()) std::ofstream(json_path) << lt2::json(rows).dump(2) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "head_loss_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
