// The fused, chunked LM head + loss (ops/loss/lm_head_loss.h) against the unfused reference
// (autograd through the full logits): loss and gradients w.r.t. hidden and the weight, for hard
// labels with ignored tokens and for KL to a teacher, at chunk sizes 1, off the token count, equal
// to it and above it; what it keeps for backward and its peak memory.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/testing.h"
#include "lt2/ops/loss/lm_head_loss.h"
#include "lt2/ops/memory_meter.h"
#include "lt2/util/error.h"

namespace {

using lt2::testing::rel_err;
using torch::Tensor;
namespace ops = lt2::ops;

constexpr int64_t kIgnore = -100;

// Invariant tolerances of docs/architecture.md: float64 1e-10, fp32 1e-5, bf16 5e-3.
double tolerance(torch::ScalarType dt) {
  return dt == torch::kFloat64 ? 1e-10 : dt == torch::kFloat32 ? 1e-5 : 5e-3;
}

struct Problem {
  Tensor hidden, weight, labels;  // [N, d], [V, d], [N] with some kIgnore
};

// Random inputs whose logits spread over a few units, with every fifth label ignored.
Problem make_problem(int64_t N, int64_t d, int64_t V, torch::ScalarType dt, uint64_t seed = 3) {
  torch::manual_seed(seed);
  Problem p;
  p.hidden = torch::randn({N, d}, torch::kFloat64).to(dt).requires_grad_(true);
  p.weight = (torch::randn({V, d}, torch::kFloat64) / std::sqrt(static_cast<double>(d)) * 2).to(dt).requires_grad_(true);
  p.labels = torch::randint(V, {N}, torch::kLong);
  p.labels.index_put_({torch::arange(0, N, 5)}, kIgnore);
  return p;
}

struct LossAndGrads {
  Tensor loss, d_hidden, d_weight;
};

// loss and its gradients, the loss scaled by `scale` before backward (backward must scale the
// saved gradients by the incoming gradient).
LossAndGrads run(const std::function<Tensor()>& loss_fn, const Problem& p, double scale = 0.37) {
  p.hidden.mutable_grad() = Tensor();
  p.weight.mutable_grad() = Tensor();
  auto loss = loss_fn();
  (loss * scale).backward();
  return {loss.detach(), p.hidden.grad().clone(), p.weight.grad().clone()};
}

void expect_match(const LossAndGrads& a, const LossAndGrads& b, double tol, const std::string& what) {
  EXPECT_LT(rel_err(a.loss, b.loss), tol) << what << ": loss";
  EXPECT_LT(rel_err(a.d_hidden, b.d_hidden), tol) << what << ": d hidden";
  EXPECT_LT(rel_err(a.d_weight, b.d_weight), tol) << what << ": d weight";
}

Tensor reference_cross_entropy(const Problem& p) {
  auto logits = p.hidden.mm(p.weight.t()).to(lt2::accum_dtype(p.hidden));
  return torch::nn::functional::cross_entropy(
      logits, p.labels, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnore));
}

Tensor fused_cross_entropy(const Problem& p, int64_t chunk) {
  ops::HeadLossOptions o;
  o.chunk_tokens = chunk;
  return ops::lm_head_cross_entropy(p.hidden, p.weight, p.labels, o, kIgnore);
}

class HeadLossDtype : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(HeadLossDtype, CrossEntropyMatchesReferenceAtEveryChunkSize) {
  const auto dt = GetParam();
  const int64_t N = 50;
  auto p = make_problem(N, 12, 37, dt);
  const auto ref = run([&] { return reference_cross_entropy(p); }, p);
  // 1, off the token count (50 = 7 * 7 + 1), equal to it, above it, automatic.
  for (int64_t chunk : {int64_t{1}, int64_t{7}, N, int64_t{1000}, int64_t{0}})
    expect_match(run([&] { return fused_cross_entropy(p, chunk); }, p), ref, tolerance(dt),
                 "chunk " + std::to_string(chunk));
}

TEST_P(HeadLossDtype, KlToTeacherMatchesReference) {
  const auto dt = GetParam();
  const int64_t N = 23, V = 29;
  auto p = make_problem(N, 10, V, dt);
  // A teacher with zero mass on some tokens (-inf log-probabilities), as a top-k teacher has.
  auto teacher_logits = torch::randn({N, V}, torch::kFloat64) * 2;
  teacher_logits.masked_fill_(torch::rand({N, V}, torch::kFloat64) < 0.3, -INFINITY);
  teacher_logits.select(1, 0).fill_(0.5);  // every row keeps some mass
  const auto teacher = torch::log_softmax(teacher_logits, 1).to(dt);
  auto reference = [&] {
    const auto s = torch::log_softmax(p.hidden.mm(p.weight.t()).to(lt2::accum_dtype(p.hidden)), 1);
    const auto t = teacher.to(s.scalar_type());
    const auto q = t.exp();
    return torch::where(q > 0, q * (t - s), 0).sum() / N;
  };
  const auto ref = run(reference, p);
  EXPECT_GT(ref.loss.item<double>(), 0.1);
  for (int64_t chunk : {int64_t{1}, int64_t{5}, N, int64_t{64}}) {
    ops::HeadLossOptions o;
    o.chunk_tokens = chunk;
    auto fused = [&] { return ops::lm_head_loss(p.hidden, p.weight, ops::TeacherLogProbs(teacher), o).mean(); };
    expect_match(run(fused, p), ref, tolerance(dt), "chunk " + std::to_string(chunk));
  }
}

// The teacher given as its head's inputs (hidden [N, d_t], weight [V, d_t], another width than the
// student's): the chunked KL equals KL(softmax(teacher logits) || softmax(student logits)) formed
// whole, with the same gradients, and none reaches the teacher.
TEST_P(HeadLossDtype, KlToTeacherHeadMatchesReference) {
  const auto dt = GetParam();
  const int64_t N = 23, V = 29, d_teacher = 6;
  auto p = make_problem(N, 10, V, dt);
  const auto teacher_hidden = (torch::randn({N, d_teacher}, torch::kFloat64) * 1.5).to(dt).requires_grad_(true);
  const auto teacher_weight = torch::randn({V, d_teacher}, torch::kFloat64).to(dt).requires_grad_(true);
  auto reference = [&] {
    const auto ct = lt2::accum_dtype(p.hidden);
    const auto s = torch::log_softmax(p.hidden.mm(p.weight.t()).to(ct), 1);
    const auto t = torch::log_softmax(teacher_hidden.detach().mm(teacher_weight.detach().t()).to(ct), 1);
    return (t.exp() * (t - s)).sum() / N;
  };
  const auto ref = run(reference, p);
  EXPECT_GT(ref.loss.item<double>(), 0.1);
  for (int64_t chunk : {int64_t{1}, int64_t{5}, N, int64_t{64}}) {
    ops::HeadLossOptions o;
    o.chunk_tokens = chunk;
    auto fused = [&] {
      return ops::lm_head_loss(p.hidden, p.weight, ops::TeacherHead(teacher_hidden, teacher_weight), o).mean();
    };
    expect_match(run(fused, p), ref, tolerance(dt), "chunk " + std::to_string(chunk));
  }
  EXPECT_FALSE(teacher_hidden.grad().defined());
  EXPECT_FALSE(teacher_weight.grad().defined());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HeadLossDtype, ::testing::Values(torch::kFloat64, torch::kFloat32),
                         [](const auto& info) { return std::string(info.param == torch::kFloat64 ? "float64" : "float32"); });

// Under bf16 autocast the products run in bf16 with logits and softmax in fp32, as the reference's
// at::linear + cross_entropy do; the gradients come back in the inputs' dtype (fp32). Against the
// fp32 result both bf16 paths are within the bf16 tolerance, the fused one no further off than the
// reference.
TEST(HeadLoss, AutocastRunsProductsInBf16) {
  auto p = make_problem(40, 16, 300, torch::kFloat32);
  auto reference = [&] {
    lt2::testing::CpuAutocast ac;
    auto logits = at::linear(p.hidden, p.weight);
    EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
    return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), p.labels,
                                                torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnore));
  };
  const auto fp32 = run([&] { return fused_cross_entropy(p, 7); }, p);
  const auto ref = run(reference, p);
  const auto fused = run([&] { lt2::testing::CpuAutocast ac; return fused_cross_entropy(p, 7); }, p);
  EXPECT_EQ(fused.loss.scalar_type(), torch::kFloat32);
  EXPECT_EQ(fused.d_hidden.scalar_type(), torch::kFloat32);
  EXPECT_EQ(fused.d_weight.scalar_type(), torch::kFloat32);
  EXPECT_LT(rel_err(fused.loss, ref.loss), tolerance(torch::kFloat32));
  for (auto [a, b, r, what] : {std::tuple{fused.d_hidden, fp32.d_hidden, ref.d_hidden, "d hidden"},
                               std::tuple{fused.d_weight, fp32.d_weight, ref.d_weight, "d weight"}}) {
    EXPECT_LT(rel_err(a, b), tolerance(torch::kBFloat16)) << what;
    EXPECT_LT(rel_err(a, b), 1.25 * rel_err(r, b)) << what;
    EXPECT_GT(rel_err(a, b), 1e-4) << what << ": bf16 products, not fp32 ones";
  }
}

// What a forward keeps for backward: the reference holds [N, V] fp32 log-probabilities; the fused
// loss holds only d hidden [N, d] and d weight [V, d]. Its peak over forward + backward is one chunk
// of logits, not all of them.
TEST(HeadLoss, KeepsNoLogitsForBackward) {
  const int64_t N = 512, d = 32, V = 4096, chunk = 64;
  auto p = make_problem(N, d, V, torch::kFloat32);
  struct Memory {
    int64_t kept, peak;
  };
  auto measure = [&](const std::function<Tensor()>& loss_fn) {
    ops::MemoryMeter meter(torch::kCPU);
    auto loss = loss_fn();
    const int64_t kept = meter.current();
    loss.backward();
    return Memory{kept, meter.peak()};
  };
  const auto ref = measure([&] { return reference_cross_entropy(p); });
  p.hidden.mutable_grad() = Tensor();
  p.weight.mutable_grad() = Tensor();
  const auto fused = measure([&] { return fused_cross_entropy(p, chunk); });
  const int64_t logits_bytes = N * V * 4, grads_bytes = (N + V) * d * 4;
  EXPECT_GE(ref.kept, logits_bytes);
  EXPECT_LE(fused.kept, grads_bytes + 4096) << "the fused loss keeps more than its two gradients";
  // Peak: the saved gradients, the parameters' .grad, and a chunk's logits and gradient.
  EXPECT_LE(fused.peak, 2 * grads_bytes + 4 * chunk * V * 4);
  EXPECT_LT(fused.peak, ref.peak / 3);

  // Without gradients nothing is kept and no gradient is formed.
  torch::NoGradGuard ng;
  Tensor loss;
  {
    ops::MemoryMeter meter(torch::kCPU);
    loss = fused_cross_entropy(p, chunk);
    EXPECT_LE(meter.current(), 4096);
    EXPECT_LE(meter.peak(), 3 * chunk * V * 4);
  }
  EXPECT_LT(rel_err(loss, reference_cross_entropy(p)), tolerance(torch::kFloat32));
}

TEST(HeadLoss, ErrorsSayWhatWasExpected) {
  auto p = make_problem(6, 4, 9, torch::kFloat64);
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const lt2::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight.t(), ops::HardLabels(p.labels, 9)); })
                .find("expected hidden [N, d] and weight [V, d]"),
            std::string::npos);
  auto bad = p.labels.clone();
  bad[1] = 9;
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight, ops::HardLabels(bad, 9)); }).find("[0, 9)"),
            std::string::npos);
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight, ops::HardLabels(p.labels.narrow(0, 0, 5), 9)); })
                .find("expected 6 labels"),
            std::string::npos);
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight, ops::HardLabels(p.labels, 10)); })
                .find("made for a vocabulary of 10, the head has 9"),
            std::string::npos);
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight, ops::TeacherLogProbs(torch::zeros({6, 8}))); })
                .find("expected [6, 9]"),
            std::string::npos);
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight, ops::TeacherHead(torch::zeros({6, 3}), torch::zeros({8, 3}))); })
                .find("a vocabulary of 9 (the student's), found 6 rows and 8 tokens"),
            std::string::npos);
  ops::HeadLossOptions o;
  o.chunk_tokens = -1;
  EXPECT_NE(message([&] { ops::lm_head_loss(p.hidden, p.weight, ops::HardLabels(p.labels, 9), o); }).find("chunk_tokens"),
            std::string::npos);
}

TEST(HeadLoss, AutomaticChunkKeepsLogitsWithinBudget) {
  EXPECT_EQ(ops::head_loss_chunk_tokens(131072, 4, {}), 1024);
  EXPECT_EQ(ops::head_loss_chunk_tokens(32768, 4, {}), 4096);
  EXPECT_EQ(ops::head_loss_chunk_tokens(int64_t{1} << 40, 4, {}), 1);
  ops::HeadLossOptions o;
  o.chunk_tokens = 100;
  EXPECT_EQ(ops::head_loss_chunk_tokens(131072, 4, o), 100);
}

}  // namespace
