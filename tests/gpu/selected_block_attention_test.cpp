// GPU (CTest label `gpu`): NSA's selection branch through libtorch's fused attention (cuDNN's where SDPA
// takes it, and with cuDNN's attention turned off the memory-efficient kernel) in row blocks whose masks
// are made again in the backward (ops::selected_block_attention). Output, dq,
// dk and dv against the float64 reference (masked attention over the selected blocks' keys on the
// CPU, through autograd) on random inputs and random selections (each row's own block always
// selected, as NSA selects it) in bf16 and fp16: one row block and many (blocks of 1 and of 37 rows),
// GQA, queries at the last T of L keys (a continued prefill), key counts off the 16-element mask rows
// and off the selection blocks. Skips where no CUDA GPU.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <string>
#include <vector>

#include "common/testing.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct Case {
  int64_t B, H, H_kv, T, L, D, block, rows;  // rows: query rows a block (0: one block for all)
  std::string name() const {
    return cat("B", B, " H", H, "/", H_kv, " T", T, " L", L, " D", D, " block ", block, " rows ", rows);
  }
};

// cuDNN's SDPA kernels on or off for a scope (selected_block_attention follows libtorch's choice).
struct CudnnAttention {
  explicit CudnnAttention(bool on) : was(at::globalContext().userEnabledCuDNNSDP()) {
    at::globalContext().setSDPUseCuDNN(on);
  }
  ~CudnnAttention() { at::globalContext().setSDPUseCuDNN(was); }
  bool was;
};

}  // namespace

TEST(SelectedBlockAttentionGpu, MatchesTheFloat64Reference) {
  REQUIRE_CUDA();
  torch::manual_seed(17);
  const std::vector<Case> cases{{2, 4, 4, 300, 300, 64, 64, 0},  {2, 4, 2, 300, 300, 64, 64, 37},
                                {1, 4, 1, 100, 700, 128, 64, 1}, {2, 6, 3, 129, 129, 64, 32, 37},
                                {1, 2, 2, 1, 517, 64, 64, 0}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name());
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
    const auto q = torch::randn({c.B, c.H, c.T, c.D}, f64), k = torch::randn({c.B, c.H_kv, c.L, c.D}, f64);
    const auto v = torch::randn({c.B, c.H_kv, c.L, c.D}, f64), dout = torch::randn({c.B, c.T, c.H, c.D}, f64);
    const int64_t NS = (c.L + c.block - 1) / c.block;
    const auto own = torch::div(torch::arange(c.L - c.T, c.L), c.block, "floor");  // each row's own block
    const auto selected = (torch::rand({c.B, c.H_kv, c.T, NS}) < 0.4) |
                          (torch::arange(NS).view({1, 1, 1, NS}) == own.view({1, 1, c.T, 1}));
    for (auto dt : {torch::kBFloat16, torch::kHalf})
      for (bool cudnn : {true, false}) {
        SCOPED_TRACE(::testing::Message() << name(dt) << (cudnn ? "" : " cuDNN attention off"));
        CudnnAttention choice(cudnn);
        auto round = [dt](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
        // Output and gradients on `on`, rows in blocks of `bytes` bytes of mask.
        auto run = [&](const torch::TensorOptions& on, int64_t bytes) {
          auto qd = round(q).to(on).detach().requires_grad_(true);
          auto kd = round(k).to(on).detach().requires_grad_(true), vd = round(v).to(on).detach().requires_grad_(true);
          auto o = selected_block_attention(qd, kd, vd, selected.to(on.device()), c.block, 0, bytes);
          o.backward(round(dout).to(on));
          auto cpu64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
          return std::vector<Tensor>{cpu64(o), cpu64(qd.grad()), cpu64(kd.grad()), cpu64(vd.grad())};
        };
        const auto on = gpu(dt);
        ASSERT_TRUE(selected_block_kernels_serve(q.to(on), k.to(on), v.to(on)));
        const int64_t row_bytes = c.B * c.H * ((c.L + 15) / 16 * 16) * torch::elementSize(dt);
        const auto want = run(f64, int64_t{1} << 40);
        const auto got = run(on, c.rows > 0 ? c.rows * row_bytes : int64_t{1} << 40);
        const char* names[] = {"o", "dq", "dk", "dv"};
        for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tolerance(dt)) << names[i];
      }
  }
}
