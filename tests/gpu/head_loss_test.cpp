// GPU (CTest label `gpu`): the fused, chunked LM head + loss (ops/loss/lm_head_loss.h) on CUDA
// against float64 references on the CPU, fresh random inputs: in fp32 (relative error < 1e-5) and
// under bf16 autocast with fp32 master weights, as `lt2 train` runs it (< 5e-3 against the float64
// loss of the bf16-rounded inputs, and no further off than the unfused reference path), with
// chunks that do not divide the tokens and ignored tokens; the KL-to-teacher target; the bytes
// kept for backward. Skips where no CUDA GPU is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <optional>
#include <vector>

#include "common/testing.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/loss/lm_head_loss.h"
#include "lt2/ops/memory_meter.h"
#include "lt2/train/autocast.h"
#include "lt2/train/losses.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct Shape {
  int64_t N, d, V, chunk;
};
const std::vector<Shape> kShapes{{1000, 256, 5000, 128}, {77, 96, 1003, 0}, {300, 2048, 32768, 64}};

struct Result {
  Tensor loss, d_hidden, d_weight;  // on the CPU
};

Result run(const std::function<Tensor(const Tensor&, const Tensor&)>& loss_fn, const Tensor& hidden,
           const Tensor& weight, bool autocast) {
  auto h = hidden.detach().clone().requires_grad_(true), w = weight.detach().clone().requires_grad_(true);
  Tensor loss;
  {
    AutocastScope ac(autocast);
    loss = loss_fn(h, w);
  }
  loss.backward();
  return {loss.detach().cpu(), h.grad().cpu(), w.grad().cpu()};
}

// Mean cross-entropy through the full logits, in float64 on the CPU.
Result reference64(const Tensor& hidden, const Tensor& weight, const Tensor& labels) {
  return run([&](const Tensor& h, const Tensor& w) { return torch::nn::functional::cross_entropy(h.mm(w.t()), labels.cpu()); },
             hidden.cpu().to(torch::kFloat64), weight.cpu().to(torch::kFloat64), false);
}

}  // namespace

TEST(HeadLossGpu, CrossEntropyMatchesFloat64Reference) {
  REQUIRE_CUDA();
  for (const auto& s : kShapes)
    for (bool autocast : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (autocast ? "bf16 autocast" : "fp32") << " N " << s.N << " d " << s.d
                                        << " V " << s.V << " chunk " << s.chunk);
      torch::manual_seed(s.N + s.V);
      const auto hidden = torch::randn({s.N, s.d}, gpu(torch::kFloat32));
      const auto weight = torch::randn({s.V, s.d}, gpu(torch::kFloat32)) * (2 / std::sqrt(static_cast<double>(s.d)));
      auto labels = torch::randint(s.V, {s.N}, gpu(torch::kLong));
      labels.index_put_({torch::arange(0, s.N, 7, gpu(torch::kLong))}, -100);  // ignored tokens
      ops::HeadLossOptions o;
      o.chunk_tokens = s.chunk;
      const auto fused = run([&](const Tensor& h, const Tensor& w) { return ops::lm_head_cross_entropy(h, w, labels, o); },
                             hidden, weight, autocast);
      EXPECT_EQ(fused.d_hidden.scalar_type(), torch::kFloat32);
      EXPECT_EQ(fused.d_weight.scalar_type(), torch::kFloat32);
      // The products see bf16-rounded inputs under autocast: the reference takes the same.
      const auto dt = autocast ? torch::kBFloat16 : torch::kFloat32;
      const auto exact = reference64(hidden.to(dt), weight.to(dt), labels);
      EXPECT_LT(rel_err(fused.loss, exact.loss), tolerance(dt));
      EXPECT_LT(rel_err(fused.d_hidden, exact.d_hidden), tolerance(dt));
      EXPECT_LT(rel_err(fused.d_weight, exact.d_weight), tolerance(dt));
      if (autocast) {
        const auto unfused = run([&](const Tensor& h, const Tensor& w) { return cross_entropy(at::linear(h, w), labels); },
                                 hidden, weight, true);
        EXPECT_LE(rel_err(fused.d_hidden, exact.d_hidden), 1.25 * rel_err(unfused.d_hidden, exact.d_hidden));
        EXPECT_LE(rel_err(fused.d_weight, exact.d_weight), 1.25 * rel_err(unfused.d_weight, exact.d_weight));
      }
    }
}

TEST(HeadLossGpu, KlToTeacherMatchesFloat64Reference) {
  REQUIRE_CUDA();
  const int64_t N = 333, d = 128, V = 2000;
  torch::manual_seed(7);
  const auto hidden = torch::randn({N, d}, gpu(torch::kFloat32));
  const auto weight = torch::randn({V, d}, gpu(torch::kFloat32)) * 0.2;
  const auto teacher = torch::log_softmax(torch::randn({N, V}, gpu(torch::kFloat32)) * 3, 1);
  ops::HeadLossOptions o;
  o.chunk_tokens = 100;
  const auto fused = run(
      [&](const Tensor& h, const Tensor& w) { return ops::lm_head_loss(h, w, ops::TeacherLogProbs(teacher), o).mean(); },
      hidden, weight, false);
  const auto t = teacher.cpu().to(torch::kFloat64);
  const auto exact = run(
      [&](const Tensor& h, const Tensor& w) { return (t.exp() * (t - torch::log_softmax(h.mm(w.t()), 1))).sum() / N; },
      hidden.cpu().to(torch::kFloat64), weight.cpu().to(torch::kFloat64), false);
  EXPECT_LT(rel_err(fused.loss, exact.loss), 1e-5);
  EXPECT_LT(rel_err(fused.d_hidden, exact.d_hidden), 1e-5);
  EXPECT_LT(rel_err(fused.d_weight, exact.d_weight), 1e-5);
}

// What the forward keeps for backward on the GPU: the two gradients, no logits.
TEST(HeadLossGpu, KeepsOnlyTheGradients) {
  REQUIRE_CUDA();
  const int64_t N = 4096, d = 256, V = 32768;
  auto hidden = torch::randn({N, d}, gpu(torch::kFloat32)).requires_grad_(true);
  auto weight = (torch::randn({V, d}, gpu(torch::kFloat32)) * 0.05).requires_grad_(true);
  const auto labels = torch::randint(V, {N}, gpu(torch::kLong));
  ops::MemoryMeter meter(torch::kCUDA);
  Tensor loss;
  {
    AutocastScope ac(true);
    loss = ops::lm_head_cross_entropy(hidden, weight, labels);
  }
  EXPECT_LE(meter.current(), (N + V) * d * 4 + (4 << 20));  // the caching allocator rounds blocks up
  EXPECT_GT(meter.peak(), 0);
  loss.backward();
}

// The cross-entropy kernel (cross_entropy_kernel) against the libtorch form of the same chunk score, on
// random fp32 logits: vocabularies a multiple of 4 (16-byte loads) and not, logits not 16-byte aligned,
// ignored rows, a gradient in fp32 and in bf16, and none. The float64 check of the whole loss through
// the kernel is CrossEntropyMatchesFloat64Reference.
TEST(HeadLossGpu, CrossEntropyKernelMatchesTheLibtorchForm) {
  REQUIRE_CUDA();
  for (const int64_t V : {int64_t{32768}, int64_t{1003}, int64_t{4}})
    for (const bool aligned : {true, false})
      for (const auto grad_dtype : {std::optional<torch::ScalarType>(torch::kFloat32),
                                    std::optional<torch::ScalarType>(torch::kBFloat16), std::optional<torch::ScalarType>()}) {
        SCOPED_TRACE(::testing::Message() << "V " << V << (aligned ? " aligned" : " misaligned") << " grad "
                                          << (grad_dtype ? c10::toString(*grad_dtype) : "none"));
        const int64_t n = 37;
        torch::manual_seed(V + aligned);
        const auto storage = torch::randn({n * V + 1}, gpu(torch::kFloat32)) * 4;
        const auto logits = storage.narrow(0, aligned ? 0 : 1, n * V).view({n, V});
        auto labels = torch::randint(V, {n}, gpu(torch::kLong));
        labels.index_put_({torch::arange(0, n, 5, gpu(torch::kLong))}, -100);
        const ops::HardLabels target(labels, V);
        auto score = [&](bool kernel) {
          DecodeOptions options;
          options.cross_entropy_kernel = kernel;
          const DecodeOptionsGuard guard(options);
          return target.score(logits, 0, grad_dtype);  // as given: the misaligned view too
        };
        const auto by_kernel = score(true), by_libtorch = score(false);
        EXPECT_LT(rel_err(by_kernel.loss, by_libtorch.loss), 1e-6);
        ASSERT_EQ(by_kernel.grad.defined(), grad_dtype.has_value());
        if (!grad_dtype) continue;
        EXPECT_EQ(by_kernel.grad.scalar_type(), *grad_dtype);
        EXPECT_LT(rel_err(by_kernel.grad.to(torch::kFloat32), by_libtorch.grad.to(torch::kFloat32)),
                  *grad_dtype == torch::kFloat32 ? 1e-6 : tolerance(torch::kBFloat16));
        const auto ignored = torch::arange(0, n, 5, gpu(torch::kLong));
        EXPECT_EQ(by_kernel.grad.index_select(0, ignored).abs().max().item<float>(), 0.f);
      }
}
