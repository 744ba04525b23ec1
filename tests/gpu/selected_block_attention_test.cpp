// GPU (CTest label `gpu`): NSA's selection branch through libtorch's fused attention (cuDNN's where SDPA
// takes it, and with cuDNN's attention turned off the memory-efficient kernel) in row blocks whose masks
// are made again in the backward (ops::selected_block_attention). Output, dq,
// dk and dv against the float64 reference (masked attention over the selected blocks' keys on the
// CPU, through autograd) on random inputs and random selections (each row's own block always
// selected, as NSA selects it) in bf16 and fp16: one row block and many (blocks of 1 and of 37 rows),
// GQA, queries at the last T of L keys (a continued prefill), key counts off the 16-element mask rows
// and off the selection blocks. NSA's selection and the branch's masks on their kernels
// (DecodeOptions::nsa_selection_kernels): the selected blocks exactly the CPU reference's (ties, forced
// and invisible blocks, per-sequence positions), the masks exactly the libtorch form's. Skips where no
// CUDA GPU.
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

namespace {

struct SelectionCase {
  int64_t B, H_kv, T, L, block, n_select, n_local;
  bool ties;  // importance on four levels: most of a row tied
  std::string name() const {
    return cat("B", B, " H_kv", H_kv, " T", T, " L", L, " block ", block, " select ", n_select, " local ", n_local,
               ties ? " ties" : "");
  }
};

}  // namespace

TEST(NsaSelectionGpu, BlocksMatchTheReference) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(23);
  const std::vector<SelectionCase> cases{
      {2, 3, 200, 200, 8, 4, 2, false},  {2, 3, 200, 200, 8, 4, 2, true},   {1, 2, 64, 2048, 64, 16, 2, false},
      {2, 2, 70, 16384, 64, 16, 1, true}, {1, 1, 33, 33, 1, 5, 0, false},    {1, 2, 50, 50, 64, 16, 2, false},
      {2, 1, 40, 1000, 4, 300, 3, false}, {1, 2, 100, 300, 10, 7, 40, true},  // n_local past every block
      {1, 1, 20, 3000, 10, 16, 2, false}};  // NS 300: libtorch's top-k on the GPU
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name());
    const int64_t NS = (c.L + c.block - 1) / c.block;
    auto importance = torch::rand({c.B, c.H_kv, c.T, NS});
    if (c.ties) importance = torch::floor(importance * 4);
    const auto q_pos = torch::arange(c.L - c.T, c.L);
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(name(dt));
      const auto want = nsa_select_blocks(importance.to(dt), q_pos, c.block, c.n_select, c.n_local);  // CPU
      const auto got = nsa_select_blocks(importance.to(gpu(dt)), q_pos.cuda(), c.block, c.n_select, c.n_local);
      EXPECT_TRUE(torch::equal(got.cpu(), want));
    }
  }
  // One position per sequence, broadcast over heads and rows (a decode step's [B, 1, 1]).
  const auto importance = torch::rand({3, 2, 1, 40});
  const auto q_pos = torch::tensor({0, 700, 2559}).view({3, 1, 1});
  const auto want = nsa_select_blocks(importance, q_pos, 64, 8, 2);
  EXPECT_TRUE(torch::equal(nsa_select_blocks(importance.cuda(), q_pos.cuda(), 64, 8, 2).cpu(), want));
}

TEST(NsaSelectionGpu, MasksMatchTheLibtorchForm) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(29);
  struct MaskCase {
    int64_t B, H_kv, G, T, L, block, r0, n, keys;
  };
  const std::vector<MaskCase> cases{{2, 3, 1, 300, 300, 64, 0, 300, 300}, {2, 2, 3, 100, 700, 64, 37, 40, 677},
                                    {1, 2, 2, 129, 129, 16, 0, 1, 1},      {1, 1, 1, 90, 90, 12, 10, 50, 60},
                                    {2, 2, 1, 200, 200, 8, 199, 1, 200}};  // block 12: the `where` form both ways
  for (const auto& c : cases) {
    SCOPED_TRACE(cat("B", c.B, " H_kv", c.H_kv, " G", c.G, " T", c.T, " L", c.L, " block ", c.block, " rows ", c.r0,
                     " + ", c.n, " keys ", c.keys));
    const int64_t NS = (c.L + c.block - 1) / c.block;
    const auto selected = (torch::rand({c.B, c.H_kv, c.T, NS}) < 0.5).cuda();
    for (auto dt : {torch::kBFloat16, torch::kHalf, torch::kFloat32}) {
      SCOPED_TRACE(name(dt));
      const auto kernel = nsa_selection_bias(selected, c.block, c.G, c.L, c.T, c.r0, c.n, c.keys, dt, true);
      const auto where = nsa_selection_bias(selected, c.block, c.G, c.L, c.T, c.r0, c.n, c.keys, dt, false);
      ASSERT_EQ(kernel.sizes(), where.sizes());
      EXPECT_TRUE(torch::equal(kernel, where));
    }
  }
}
