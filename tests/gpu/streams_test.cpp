// GPU (CTest label `gpu`): ops::run_beside, the fork of a branch onto a second stream. What the
// current stream enqueues after it sees both branches' writes, eagerly and replayed from a captured
// graph (whose capture must end joined). Skips where no CUDA GPU is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"
#include "lt2/ops/streams.h"

using namespace lt2;
using namespace lt2::gpu_testing;
using torch::Tensor;

namespace {

// Enough dependent work on `t` that a reader not ordered after it sees a partial result: 40 adds
// of 1 over 16M floats (~2.6 GB of traffic).
void slow_count(Tensor& t) {
  for (int i = 0; i < 40; ++i) t.add_(1);
}

}  // namespace

TEST(Streams, RunBesideJoinsBothBranches) {
  REQUIRE_CUDA();
  c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromPool());
  for (bool fork : {true, false}) {
    SCOPED_TRACE(fork ? "forked" : "serial");
    auto side = torch::zeros({1 << 24}, gpu(torch::kFloat32)), main = torch::zeros({1 << 10}, gpu(torch::kFloat32));
    ops::run_beside(torch::kCUDA, [&] { slow_count(side); }, [&] { main.fill_(3); }, fork);
    const auto sums = torch::stack({side.min(), side.max(), main.min(), main.max()}).cpu();  // current stream
    EXPECT_TRUE(torch::equal(sums, torch::tensor({40.f, 40.f, 3.f, 3.f})));
  }
}

TEST(Streams, RunBesideInCapturedGraph) {
  REQUIRE_CUDA();
  c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromPool());  // capture needs a non-default stream
  auto x = torch::randn({1 << 20}, gpu(torch::kFloat32));
  Tensor a, b;
  const auto step = [&] {
    ops::run_beside(torch::kCUDA, [&] { a = x * 2; }, [&] { b = x.exp(); });
    return a + b;  // on the current stream, after the join
  };
  step();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto out = step();
  graph.capture_end();  // throws if the side stream's branch was not joined back
  for (int replay = 0; replay < 3; ++replay) {
    x.copy_(torch::randn_like(x));
    graph.replay();
    const auto want = x * 2 + x.exp();
    torch::cuda::synchronize();
    EXPECT_TRUE(torch::allclose(out, want)) << "replay " << replay;
  }
}

TEST(Streams, RunBesideOnCpuRunsSideThenMain) {
  std::vector<int> order;
  ops::run_beside(torch::kCPU, [&] { order.push_back(1); }, [&] { order.push_back(2); });
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}
