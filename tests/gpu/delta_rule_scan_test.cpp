// GPU (CTest label `gpu`): the CUDA kernels of the chunked delta rule (kernels/prefill.h): the scan
// over the chunks (ops::chunk_state_scan_cuda) and the chunk preparation (delta_rule_prepare and its
// backward, checked against the libtorch preparation and the float64 recurrence). delta_rule_chunked on CUDA (the kernel path) == the float64
// recurrence and the fp32 chunked CPU path, output and final state (relative RMS error < 1e-5), at
// several head dims, chunk sizes, batches, lengths off the chunk, with and without an initial
// state, no gate / per-head / per-channel gates; its gradients (the reverse scan) == the float64
// recurrence's for every input, and the backward's fused products against the float64 loop and the
// products they replace; the binding directly against a float64 loop for every value block,
// forward and reverse with an addend, strided and misaligned inputs; the libtorch loop kept where
// the kernel does not serve; clear errors on bad input. Skips where no CUDA GPU (or no CUDA
// kernels) is present.
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/gate_kind.h"
#include "common/testing.h"
#include "lt2/ops/chunking.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"
#include "lt2/util/error.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

const auto f32 = torch::kFloat32;
const auto f64 = torch::kFloat64;

using lt2::testing::Gate;
using lt2::testing::gate_name;

// Op inputs on the CPU in fp32: q, k [B, T, H, K] (unit keys, as the mixers give), v [B, T, H, V],
// beta [B, T, H] in (0, 1), g <= 0 per the gate, s0 [B, H, K, V] or undefined.
struct Inputs {
  Tensor q, k, v, beta, g, s0;
  double scale = 1.0;
};

Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, Gate gate, bool with_state) {
  Inputs in;
  in.q = torch::randn({B, T, H, K}, f32);
  in.k = torch::randn({B, T, H, K}, f32);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = torch::randn({B, T, H, V}, f32);
  in.beta = torch::sigmoid(torch::randn({B, T, H}, f32));
  if (gate == Gate::Head) in.g = -0.3 * torch::softplus(torch::randn({B, T, H}, f32));
  if (gate == Gate::Channel) in.g = -0.3 * torch::softplus(torch::randn({B, T, H, K}, f32));
  if (with_state) in.s0 = 0.5 * torch::randn({B, H, K, V}, f32);
  in.scale = 1.0 / std::sqrt(static_cast<double>(K));
  return in;
}

Tensor to(const Tensor& t, const torch::TensorOptions& o) { return t.defined() ? t.to(o) : t; }

ops::RecurrenceResult chunked_on(const Inputs& in, const torch::TensorOptions& o, int64_t C) {
  return ops::delta_rule_chunked(to(in.q, o), to(in.k, o), to(in.v, o), to(in.beta, o), to(in.g, o), in.scale,
                                 to(in.s0, o), C);
}

ops::RecurrenceResult recurrent_f64(const Inputs& in) {
  const auto o = torch::TensorOptions().dtype(f64);
  return ops::delta_rule_recurrent(to(in.q, o), to(in.k, o), to(in.v, o), to(in.beta, o), to(in.g, o), in.scale,
                                   to(in.s0, o));
}

// Throws lt2::Error whose message contains `what`.
void expect_error(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one mentioning \"" << what << "\"";
  } catch (const lt2::Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// The loop the kernel replaces, in float64 on the CPU (ops::chunk_state_scan); w or kt undefined:
// no correction, no write.
ops::ChunkScanResult scan_reference(const ops::ChunkScanInputs& in) {
  auto c = [](const Tensor& t) { return t.defined() ? t.to(torch::kCPU, f64) : t; };
  const int64_t B = in.u.size(0), H = in.u.size(1), N = in.u.size(2), V = in.u.size(4);
  const int64_t K = in.w.defined() ? in.w.size(4) : in.kt.size(3);
  Tensor S = in.initial_state.defined() ? c(in.initial_state) : torch::zeros({B, H, K, V}, f64);
  std::vector<Tensor> states(N), vs(N);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t n = in.reverse ? N - 1 - i : i;
    states[n] = S;
    vs[n] = c(in.u).select(2, n);
    if (in.w.defined()) vs[n] = vs[n] - torch::matmul(c(in.w).select(2, n), S);
    S = c(in.carry).select(2, n) * S;
    if (in.kt.defined()) S = S + torch::matmul(c(in.kt).select(2, n), vs[n]);
    if (in.addend.defined()) S = S + c(in.addend).select(2, n);
  }
  return {torch::stack(states, 2), torch::stack(vs, 2), S};
}

// Random inputs of the scan (CUDA, fp32), scaled so that the state stays bounded over the chunks.
struct ScanInputs {
  Tensor w, u, kt, carry, s0, addend;
  ops::ChunkScanInputs op(bool reverse = false) const { return {w, u, kt, carry, s0, addend, reverse, Tensor(), Tensor()}; }
};
ScanInputs make_scan_inputs(int64_t B, int64_t H, int64_t N, int64_t C, int64_t K, int64_t V, bool per_channel,
                            bool with_state) {
  const auto o = gpu(f32);
  ScanInputs s;
  s.w = torch::randn({B, H, N, C, K}, o) * (0.3 / std::sqrt(static_cast<double>(K * C)));
  s.u = torch::randn({B, H, N, C, V}, o);
  s.kt = torch::randn({B, H, N, K, C}, o) * (0.3 / std::sqrt(static_cast<double>(C)));
  s.carry = 0.5 + 0.5 * torch::rand({B, H, N, per_channel ? K : 1, 1}, o);
  if (with_state) {
    s.s0 = 0.5 * torch::randn({B, H, K, V}, o);
    s.addend = 0.5 * torch::randn({B, H, N, K, V}, o);
  }
  return s;
}

struct Shape {
  int64_t B, T, H, K, V, C;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// delta_rule_chunked on CUDA (the kernel path) == float64 recurrence == fp32 chunked CPU path.

TEST(DeltaRuleScan, ChunkedMatchesReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);  // the intra-chunk products in true fp32
  // Head dims 16 / 32 up to 256 / 64, the 1.3B GDN head (96 x 192, with 16 heads: value blocks of
  // 32 at B 2, 16 at B 1), chunks 16 and 64, lengths on and off the chunk; small grids take value
  // blocks of 8.
  const std::vector<Shape> shapes{{1, 45, 2, 16, 32, 16},   {3, 200, 2, 96, 192, 64}, {1, 130, 2, 128, 128, 64},
                                  {3, 70, 1, 256, 64, 16},  {1, 100, 1, 256, 64, 64}, {2, 128, 16, 96, 192, 64},
                                  {1, 77, 16, 96, 192, 64}, {2, 33, 3, 64, 40, 32}};
  for (const auto& s : shapes)
    for (Gate gate : {Gate::None, Gate::Head, Gate::Channel})
      for (bool with_state : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " K" << s.K << " V" << s.V
                                          << " C" << s.C << " " << gate_name(gate)
                                          << (with_state ? " initial state" : ""));
        torch::manual_seed(s.B * 1000 + s.T + s.K + s.V + static_cast<int>(gate) * 7 + with_state);
        ASSERT_TRUE(ops::chunk_state_scan_supported(s.K, s.V, s.C, torch::Device(torch::kCUDA, 0)));
        const auto in = make_inputs(s.B, s.T, s.H, s.K, s.V, gate, with_state);
        ops::RecurrenceResult out;
        {
          torch::NoGradGuard no_grad;
          out = chunked_on(in, gpu(f32), s.C);
        }
        const auto ref = recurrent_f64(in);
        const auto cpu = chunked_on(in, torch::TensorOptions().dtype(f32), s.C);
        EXPECT_EQ(out.o.scalar_type(), f32);
        EXPECT_EQ(out.final_state.scalar_type(), f32);
        EXPECT_TRUE(out.o.is_cuda());
        EXPECT_LT(rel_err(out.o.cpu(), ref.o), 1e-5) << "output vs float64 recurrence";
        EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5) << "state vs float64 recurrence";
        EXPECT_LT(rel_err(out.o.cpu(), cpu.o), 1e-5) << "output vs CPU chunked";
        EXPECT_LT(rel_err(out.final_state.cpu(), cpu.final_state), 1e-5) << "state vs CPU chunked";
      }
}

// The gated linear family on CUDA, both forms of its chunk-start states (DecodeOptions::
// gated_prefix_chunks: the prefix product, or the chunk scan kernel with W = 0), against the
// float64 recurrence.
TEST(DeltaRuleScan, GatedLinearChunkedMatchesReferenceOnBothForms) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  const int64_t C = 16, H = 2, K = 64, V = 96, T = C * 150 + 5;
  for (int64_t prefix_chunks : {int64_t{1000}, int64_t{0}})
    for (Gate gate : {Gate::None, Gate::Head, Gate::Channel}) {
      SCOPED_TRACE(::testing::Message() << "gated_prefix_chunks " << prefix_chunks << ", " << gate_name(gate));
      DecodeOptions options;
      options.gated_prefix_chunks = prefix_chunks;
      DecodeOptionsGuard guard(options);
      torch::manual_seed(T + static_cast<int>(gate));
      const auto in = make_inputs(1, T, H, K, V, gate, true);
      ops::RecurrenceResult out;
      {
        torch::NoGradGuard no_grad;
        out = ops::gated_linear_chunked(in.q.cuda(), in.k.cuda(), in.v.cuda(), to(in.g, gpu(f32)), in.scale,
                                        in.s0.cuda(), C);
      }
      const auto o = torch::TensorOptions().dtype(f64);
      const auto ref = ops::gated_linear_recurrent(to(in.q, o), to(in.k, o), to(in.v, o), to(in.g, o), in.scale,
                                                   to(in.s0, o));
      EXPECT_LT(rel_err(out.o.cpu(), ref.o), 1e-5) << "output";
      EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5) << "final state";
    }
}

// The gated linear family through the preparation kernel's additive mode (gated_linear_prepare:
// no gate, one per head or one per key channel (channel_gate_prepare: GLA, HGRN2), C 64) and the
// scan without W: output, final state and every gradient (q, k, v, g, initial state) == the
// float64 recurrence's, in fp32 (3xTF32, 1e-5) at lengths off the chunk, with and without an
// initial state; and in training's setting (bf16 q/k/v, TF32 products) within the bf16 tolerance.
// The options off and C 32 keep the libtorch form.
TEST(DeltaRuleScan, GatedLinearKernelMatchesReference) {
  REQUIRE_FUSED_DECODE();
  struct G {
    Shape s;
    Gate gate;
    bool bf16;
  };
  for (const G c : {G{{2, 150, 3, 96, 192, 64}, Gate::Head, false}, G{{1, 130, 2, 32, 64, 64}, Gate::None, false},
                    G{{1, 64, 2, 128, 128, 64}, Gate::Head, false}, G{{2, 300, 4, 96, 192, 64}, Gate::Head, true},
                    G{{2, 150, 3, 64, 128, 64}, Gate::Channel, false}, G{{1, 200, 2, 128, 64, 64}, Gate::Channel, true}})
    for (bool with_state : {false, true}) {
      const Shape& s = c.s;
      SCOPED_TRACE(::testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " K" << s.K << " V" << s.V
                                        << " " << gate_name(c.gate) << (c.bf16 ? " bf16 on TF32" : " fp32")
                                        << (with_state ? " initial state" : ""));
      torch::manual_seed(s.T + s.K + with_state + 7 * c.bf16);
      auto in = make_inputs(s.B, s.T, s.H, s.K, s.V, c.gate, with_state);
      in.k = in.k / std::sqrt(static_cast<double>(s.K));  // bounded additive states
      const auto io = c.bf16 ? torch::kBFloat16 : f32;
      for (Tensor* t : {&in.q, &in.k, &in.v}) *t = t->to(io).to(f32);  // the reference sees the same values
      const auto d_o = torch::randn({s.B, s.T, s.H, s.V}, f64), d_s = torch::randn({s.B, s.H, s.K, s.V}, f64);
      at::globalContext().setAllowTF32CuBLAS(c.bf16);
      std::vector<Tensor> leaves;
      for (const Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.s0}) {
        const auto dt = t == &in.q || t == &in.k || t == &in.v ? io : f32;
        leaves.push_back(t->defined() ? t->to(gpu(dt)).detach().requires_grad_(true) : Tensor());
      }
      EXPECT_TRUE(ops::gated_linear_prepare_serves(leaves[0], leaves[2], leaves[3], 64));
      const auto out = ops::gated_linear_chunked(leaves[0], leaves[1], leaves[2], leaves[3], in.scale, leaves[4], 64);
      ((out.o.to(f64) * d_o.cuda()).sum() + (out.final_state.to(f64) * d_s.cuda()).sum()).backward();
      at::globalContext().setAllowTF32CuBLAS(false);
      std::vector<Tensor> ref_leaves;
      for (const Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.s0})
        ref_leaves.push_back(t->defined() ? t->to(f64).detach().requires_grad_(true) : Tensor());
      const auto ref = ops::gated_linear_recurrent(ref_leaves[0], ref_leaves[1], ref_leaves[2], ref_leaves[3], in.scale,
                                                   ref_leaves[4]);
      ((ref.o * d_o).sum() + (ref.final_state * d_s).sum()).backward();
      const double tol = c.bf16 ? tolerance(torch::kBFloat16) : 1e-5;
      EXPECT_EQ(out.o.scalar_type(), io);
      EXPECT_LT(rel_err(out.o.detach().cpu().to(f64), ref.o.detach()), tol) << "output";
      EXPECT_LT(rel_err(out.final_state.detach().cpu().to(f64), ref.final_state.detach()), tol) << "final state";
      const char* names[] = {"dq", "dk", "dv", "dg", "d initial_state"};
      for (size_t i = 0; i < leaves.size(); ++i) {
        if (!ref_leaves[i].defined()) continue;
        ASSERT_TRUE(leaves[i].grad().defined()) << names[i];
        EXPECT_LT(rel_err(leaves[i].grad().cpu().to(f64), ref_leaves[i].grad()), tol) << names[i];
      }
    }
  torch::manual_seed(4);
  const auto o = gpu(f32);
  const auto channel = make_inputs(1, 70, 2, 32, 64, Gate::Channel, false);
  const auto head = make_inputs(1, 70, 2, 32, 64, Gate::Head, false);
  EXPECT_FALSE(ops::gated_linear_prepare_serves(head.q.to(o), head.v.to(o), head.g.to(o), 32)) << "C 32";
  {
    DecodeOptions no_channels;
    no_channels.channel_gate_prepare = false;
    DecodeOptionsGuard guard(no_channels);
    EXPECT_FALSE(ops::gated_linear_prepare_serves(channel.q.to(o), channel.v.to(o), channel.g.to(o), 64))
        << "channel_gate_prepare off";
    EXPECT_TRUE(ops::gated_linear_prepare_serves(head.q.to(o), head.v.to(o), head.g.to(o), 64))
        << "channel_gate_prepare off, per-head gate";
  }
  DecodeOptions off;
  off.gated_linear_prepare = false;
  DecodeOptionsGuard guard(off);
  EXPECT_FALSE(ops::gated_linear_prepare_serves(head.q.to(o), head.v.to(o), head.g.to(o), 64)) << "option off";
  EXPECT_FALSE(ops::gated_linear_prepare_serves(channel.q.to(o), channel.v.to(o), channel.g.to(o), 64))
      << "option off, per-channel gate";
}

// The chunk preparation kernel (delta_rule_prepare) serves GDN, DeltaNet and KDA (no gate, one gate
// per head, one per key channel) at C 64 with K, V multiples of 16 (K <= 128), in fp32 and bf16,
// and gives what the libtorch preparation gives (the same op with DecodeOptions::delta_rule_prepare
// off) and the float64 recurrence; other chunk sizes and dims, and the options off keep the
// libtorch preparation. Its backward: GradientsMatchReference and the TF32 test below.
TEST(DeltaRuleScan, PreparedChunksMatchLibtorchPreparation) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  const std::vector<Shape> shapes{{1, 45, 2, 16, 32, 64}, {3, 200, 2, 96, 192, 64}, {1, 77, 16, 96, 192, 64},
                                  {2, 33, 3, 64, 48, 64}, {2, 64, 2, 128, 128, 64}, {1, 1, 1, 32, 64, 64}};
  DecodeOptions libtorch_prep;
  libtorch_prep.delta_rule_prepare = false;
  for (const auto& s : shapes)
    for (Gate gate : {Gate::None, Gate::Head, Gate::Channel})
      for (auto dtype : {f32, torch::kBFloat16}) {
        SCOPED_TRACE(::testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " K" << s.K << " V" << s.V
                                          << " C" << s.C << " " << gate_name(gate) << " " << name(dtype));
        torch::manual_seed(s.B * 100 + s.T + s.K + static_cast<int>(gate));
        auto in = make_inputs(s.B, s.T, s.H, s.K, s.V, gate, /*with_state=*/true);
        for (Tensor* t : {&in.q, &in.k, &in.v}) *t = t->to(dtype);
        const auto o = torch::TensorOptions().device(torch::kCUDA);
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(ops::delta_rule_prepare_serves(to(in.q, o), to(in.k, o), to(in.v, o), to(in.beta, o), to(in.g, o),
                                                   s.C));
        const auto fused = chunked_on(in, o, s.C);
        ops::RecurrenceResult plain;
        {
          DecodeOptionsGuard guard(libtorch_prep);
          EXPECT_FALSE(ops::delta_rule_prepare_serves(to(in.q, o), to(in.k, o), to(in.v, o), to(in.beta, o),
                                                      to(in.g, o), s.C));
          plain = chunked_on(in, o, s.C);
        }
        const auto ref = recurrent_f64(in);
        EXPECT_EQ(fused.o.scalar_type(), dtype);
        // fp32 compute from the same rows either way: the outputs differ by fp32 rounding (bf16: one rounding of o).
        EXPECT_LT(rel_err(fused.o.cpu(), plain.o.cpu()), tolerance(dtype)) << "output vs libtorch preparation";
        EXPECT_LT(rel_err(fused.final_state.cpu(), plain.final_state.cpu()), 1e-5) << "state vs libtorch preparation";
        EXPECT_LT(rel_err(fused.o.cpu(), ref.o), tolerance(dtype)) << "output vs float64 recurrence";
        EXPECT_LT(rel_err(fused.final_state.cpu(), ref.final_state), 1e-5) << "state vs float64 recurrence";
      }
  torch::manual_seed(3);
  const auto o = gpu(f32);
  torch::NoGradGuard no_grad;
  const auto channel = make_inputs(1, 70, 2, 32, 64, Gate::Channel, false);
  {
    DecodeOptions no_channels;
    no_channels.channel_gate_prepare = false;
    DecodeOptionsGuard guard(no_channels);
    EXPECT_FALSE(ops::delta_rule_prepare_serves(to(channel.q, o), to(channel.k, o), to(channel.v, o),
                                                to(channel.beta, o), to(channel.g, o), 64))
        << "channel_gate_prepare off";
  }
  for (const Shape& s : {Shape{1, 70, 2, 32, 64, 32}, Shape{1, 70, 2, 256, 64, 64}, Shape{1, 70, 2, 32, 40, 64}}) {
    const auto in = make_inputs(s.B, s.T, s.H, s.K, s.V, Gate::Head, false);
    EXPECT_FALSE(ops::delta_rule_prepare_serves(to(in.q, o), to(in.k, o), to(in.v, o), to(in.beta, o), to(in.g, o),
                                                s.C))
        << "K " << s.K << " V " << s.V << " C " << s.C;
  }
}

// bf16 activations compute in fp32 too (the kernel path), the output rounded to bf16.
TEST(DeltaRuleScan, Bf16InputsMatchReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  torch::manual_seed(11);
  auto in = make_inputs(2, 90, 4, 64, 128, Gate::Head, true);
  for (Tensor* t : {&in.q, &in.k, &in.v}) *t = t->to(torch::kBFloat16);
  ops::RecurrenceResult out;
  {
    torch::NoGradGuard no_grad;
    out = chunked_on(in, torch::TensorOptions().device(torch::kCUDA), 64);
  }
  const auto ref = recurrent_f64(in);
  EXPECT_EQ(out.o.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(out.o.cpu(), ref.o), tolerance(torch::kBFloat16));
  EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5);  // fp32 from the same bf16 inputs
}

// ---------------------------------------------------------------------------------------------
// Gradients: delta_rule_chunked on CUDA under autograd (the forward scan, then the reverse scan
// of its backward) == the float64 recurrence's gradients, for every input.

TEST(DeltaRuleScan, GradientsMatchReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  struct G {
    Shape s;
    Gate gate;
  };
  // The 1.3B head at a length off the chunk, DeltaNet and per-channel decay (KDA) at K 64 and 128
  // (the preparation kernel and its backward; its two scores in one pass each way and, switch off, a pass
  // each), a small head with C 16 and KDA with C 32 (the libtorch preparation).
  for (const G c : {G{{2, 150, 3, 96, 192, 64}, Gate::Head}, G{{1, 130, 2, 32, 64, 64}, Gate::None},
                    G{{1, 70, 2, 32, 64, 16}, Gate::None}, G{{2, 100, 2, 64, 128, 64}, Gate::Channel},
                    G{{1, 130, 2, 128, 64, 64}, Gate::Channel}, G{{1, 100, 2, 64, 128, 32}, Gate::Channel}})
    for (bool with_state : {false, true}) {
      const Shape& s = c.s;
      SCOPED_TRACE(::testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " K" << s.K << " V" << s.V
                                        << " C" << s.C << " " << gate_name(c.gate)
                                        << (with_state ? " initial state" : ""));
      torch::manual_seed(s.T + s.K + with_state);
      const auto in = make_inputs(s.B, s.T, s.H, s.K, s.V, c.gate, with_state);
      auto d_o = torch::randn({s.B, s.T, s.H, s.V}, f64);
      auto d_s = torch::randn({s.B, s.H, s.K, s.V}, f64);
      // Gradients of <o, d_o> + <S_final, d_s> w.r.t. q, k, v, beta, g and the initial state.
      auto grads = [&](const torch::TensorOptions& o, bool chunked) {
        std::vector<Tensor> leaves;
        for (const Tensor* t : {&in.q, &in.k, &in.v, &in.beta, &in.g, &in.s0})
          leaves.push_back(t->defined() ? t->to(o).detach().requires_grad_(true) : Tensor());
        auto r = chunked ? ops::delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], in.scale,
                                                   leaves[5], s.C)
                         : ops::delta_rule_recurrent(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                                     in.scale, leaves[5]);
        auto loss = (r.o.to(f64) * d_o.to(o.device())).sum() + (r.final_state.to(f64) * d_s.to(o.device())).sum();
        loss.backward();
        std::vector<Tensor> out;
        for (auto& l : leaves) out.push_back(l.defined() ? l.grad().cpu().to(f64) : Tensor());
        return out;
      };
      const auto ref = grads(torch::TensorOptions().dtype(f64), false);
      const char* names[] = {"dq", "dk", "dv", "dbeta", "dg", "d initial_state"};
      // Per channel also with KDA's two scores a pass each (channel_score_pairs off).
      for (bool pairs : {true, false}) {
        if (!pairs && c.gate != Gate::Channel) continue;
        SCOPED_TRACE(pairs ? "" : "channel_score_pairs off");
        DecodeOptions options;
        options.channel_score_pairs = pairs;
        DecodeOptionsGuard guard(options);
        const auto gpu_grads = grads(gpu(f32), true);
        for (size_t i = 0; i < ref.size(); ++i) {
          if (!ref[i].defined()) continue;
          ASSERT_TRUE(gpu_grads[i].defined()) << names[i];
          EXPECT_LT(rel_err(gpu_grads[i], ref[i]), 1e-5) << names[i];
        }
      }
    }
}

// Training's setting: bf16 activations and the chunk math's fp32 products on TF32 tensor cores
// (lt2::Tf32Scope, as `lt2 train` under bf16): outputs and every gradient within the bf16
// tolerance of the float64 recurrence on the same (bf16-rounded) inputs.
TEST(DeltaRuleScan, Tf32GradientsMatchReferenceAtBf16Tolerance) {
  REQUIRE_FUSED_DECODE();
  for (Gate gate : {Gate::Head, Gate::Channel}) {
    SCOPED_TRACE(gate_name(gate));
    torch::manual_seed(31 + static_cast<int>(gate));
    auto in = make_inputs(2, 300, 4, 96, 192, gate, true);
    for (Tensor* t : {&in.q, &in.k, &in.v}) *t = t->to(torch::kBFloat16).to(f32);
    const auto d_o = torch::randn({2, 300, 4, 192}, f64);
    std::vector<Tensor> leaves, ref_leaves;
    for (const Tensor* t : {&in.q, &in.k, &in.v, &in.beta, &in.g, &in.s0}) {
      const auto dt = t == &in.q || t == &in.k || t == &in.v ? torch::kBFloat16 : f32;
      leaves.push_back(t->to(gpu(dt)).detach().requires_grad_(true));
      ref_leaves.push_back(t->to(f64).detach().requires_grad_(true));
    }
    ops::RecurrenceResult out;
    {
      at::globalContext().setAllowTF32CuBLAS(true);
      out = ops::delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], in.scale, leaves[5], 64);
      (out.o.to(f64) * d_o.cuda()).sum().backward();
      at::globalContext().setAllowTF32CuBLAS(false);
    }
    const auto ref = ops::delta_rule_recurrent(ref_leaves[0], ref_leaves[1], ref_leaves[2], ref_leaves[3],
                                               ref_leaves[4], in.scale, ref_leaves[5]);
    (ref.o * d_o).sum().backward();
    const double tol = tolerance(torch::kBFloat16);
    EXPECT_LT(rel_err(out.o.detach().cpu().to(f64), ref.o.detach()), tol) << "output";
    EXPECT_LT(rel_err(out.final_state.detach().cpu(), ref.final_state.detach()), tol) << "final state";
    const char* names[] = {"dq", "dk", "dv", "dbeta", "dg", "d initial_state"};
    for (size_t i = 0; i < leaves.size(); ++i)
      EXPECT_LT(rel_err(leaves[i].grad().cpu().to(f64), ref_leaves[i].grad()), tol) << names[i];
  }
}

// The UT transform's inverse on CUDA (kernels/prefill.h: unit_lower_inverse) == the float64
// triangular solve, value and gradient, at chunk sizes 1 to 64; L's diagonal and upper part unread.
TEST(DeltaRuleScan, UnitLowerInverseMatchesReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (int64_t C : {1, 16, 37, 64}) {
    SCOPED_TRACE(::testing::Message() << "C " << C);
    torch::manual_seed(C);
    const auto L = torch::randn({3, 5, C, C}, f64) * 0.3;  // full: only the strict lower part counts
    const auto G = torch::randn({3, 5, C, C}, f64);
    auto l_gpu = L.to(gpu(f32)).requires_grad_(true);
    const auto T = ops::unit_lower_inverse(l_gpu);
    (T.to(f64) * G.cuda()).sum().backward();
    auto l_ref = L.tril(-1).requires_grad_(true);
    const auto eye = torch::eye(C, f64).expand({3, 5, C, C});
    const auto T_ref = torch::linalg_solve_triangular(l_ref + eye, eye, /*upper=*/false);
    (T_ref * G).sum().backward();
    EXPECT_LT(rel_err(T.detach().cpu().to(f64), T_ref.detach()), 1e-5) << "inverse";
    EXPECT_LT(rel_err(l_gpu.grad().cpu().to(f64), l_ref.grad().tril(-1)), 1e-5) << "gradient";
    EXPECT_EQ(l_gpu.grad().triu().abs().max().item<float>(), 0.f) << "diagonal and upper part unread";
  }
}

// ---------------------------------------------------------------------------------------------
// Packed documents on CUDA (the kernel's resets, forward and reverse), for both recurrence
// families (the gated linear one runs the scan with W = 0): outputs, final states and gradients
// equal each document run alone through the float64 recurrence.

TEST(DeltaRuleScan, PackedDocumentsMatchEachAlone) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  const std::vector<int64_t> lengths{1, 63, 64, 65, 1000};
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), D = static_cast<int64_t>(lengths.size()), H = 2, K = 96, V = 192;
  for (bool delta : {true, false})
    for (Gate gate : {Gate::Head, Gate::Channel}) {
      SCOPED_TRACE(::testing::Message() << (delta ? "delta rule, " : "gated linear, ") << gate_name(gate));
      torch::manual_seed(21 + static_cast<int>(gate));
      const auto in = make_inputs(1, T, H, K, V, gate, false);
      const auto s0 = 0.5 * torch::randn({D, H, K, V}, f32);
      const auto d_o = torch::randn({1, T, H, V}, f64);
      const auto d_s = torch::randn({D, H, K, V}, f64);
      // l: q, k, v, beta, g, initial states
      auto varlen = [&](const std::vector<Tensor>& l) {
        return delta ? ops::delta_rule_chunked_varlen(l[0], l[1], l[2], l[3], l[4], in.scale, l[5], cu, 64)
                     : ops::gated_linear_chunked_varlen(l[0], l[1], l[2], l[4], in.scale, l[5], cu, 64);
      };
      auto recurrent = [&](const std::vector<Tensor>& l, const Tensor& state) {
        return delta ? ops::delta_rule_recurrent(l[0], l[1], l[2], l[3], l[4], in.scale, state)
                     : ops::gated_linear_recurrent(l[0], l[1], l[2], l[4], in.scale, state);
      };
      std::vector<Tensor> leaves;
      for (const Tensor* t : {&in.q, &in.k, &in.v, &in.beta, &in.g, &s0})
        leaves.push_back(t->to(gpu(f32)).detach().requires_grad_(true));
      const auto out = varlen(leaves);
      ((out.o.to(f64) * d_o.cuda()).sum() + (out.final_state.to(f64) * d_s.cuda()).sum()).backward();
      std::vector<Tensor> ref_leaves;
      for (const Tensor* t : {&in.q, &in.k, &in.v, &in.beta, &in.g, &s0})
        ref_leaves.push_back(t->to(f64).detach().requires_grad_(true));
      Tensor loss = torch::zeros({}, f64);
      for (int64_t d = 0; d < D; ++d) {
        auto part = [&](const Tensor& x) { return x.narrow(1, cu[d], lengths[d]); };
        std::vector<Tensor> parts;
        for (size_t i = 0; i < 5; ++i) parts.push_back(part(ref_leaves[i]));
        const auto ref = recurrent(parts, ref_leaves[5].select(0, d).unsqueeze(0));
        EXPECT_LT(rel_err(part(out.o.detach().cpu()), ref.o.detach()), 1e-5) << "output of document " << d;
        EXPECT_LT(rel_err(out.final_state.detach().select(0, d).cpu(), ref.final_state.detach().squeeze(0)), 1e-5)
            << "final state of document " << d;
        loss = loss + (ref.o * part(d_o)).sum() + (ref.final_state.squeeze(0) * d_s.select(0, d)).sum();
      }
      loss.backward();
      const char* names[] = {"dq", "dk", "dv", "dbeta", "dg", "d initial_states"};
      for (size_t i = 0; i < leaves.size(); ++i) {
        if (i == 3 && !delta) continue;  // the gated linear family reads no beta
        EXPECT_LT(rel_err(leaves[i].grad().cpu().to(f64), ref_leaves[i].grad()), 1e-5) << names[i];
      }
    }
}

// ---------------------------------------------------------------------------------------------
// The binding directly: every value block, per-head and per-channel carries, forward and reverse
// with an addend, strided and misaligned inputs, against the loop in float64.

TEST(DeltaRuleScan, BindingMatchesLoopForEveryValueBlock) {
  REQUIRE_FUSED_DECODE();
  struct S {
    int64_t B, H, N, C, K, V;
  };
  for (const S s : {S{2, 3, 5, 16, 32, 64}, S{1, 2, 4, 64, 96, 192}, S{1, 1, 3, 32, 256, 32}, S{3, 2, 2, 20, 12, 96}})  // K 256 at C 32: every value block fits
    for (int vb : {0, 8, 16, 32})
      for (bool per_channel : {false, true})
        for (bool with_state : {false, true})
          for (bool reverse : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "B" << s.B << " H" << s.H << " N" << s.N << " C" << s.C << " K"
                                              << s.K << " V" << s.V << " value block " << vb
                                              << (per_channel ? " per-channel" : " per-head")
                                              << (with_state ? " initial state and addend" : "")
                                              << (reverse ? " reverse" : ""));
            torch::manual_seed(s.K * 100 + s.V + vb + per_channel * 3 + with_state + reverse * 5);
            const auto in = make_scan_inputs(s.B, s.H, s.N, s.C, s.K, s.V, per_channel, with_state);
            const auto ref = scan_reference(in.op(reverse));
            const auto out = ops::chunk_state_scan_cuda(in.op(reverse), vb);
            EXPECT_LT(rel_err(out.states.cpu(), ref.states), 1e-5) << "states";
            EXPECT_LT(rel_err(out.v.cpu(), ref.v), 1e-5) << "v";
            EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5) << "final state";
          }
}

// The binding without W (the gated linear family's forward: V_n = U_n, v is u itself) and without Kt
// (its adjoint: no write) against the loop in float64, every value block, forward and reverse.
TEST(DeltaRuleScan, BindingWithoutWOrKtMatchesLoop) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (int vb : {0, 8, 16, 32})
    for (bool without_w : {true, false})
      for (bool reverse : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "value block " << vb << (without_w ? " without W" : " without Kt")
                                          << (reverse ? " reverse" : ""));
        torch::manual_seed(vb + 2 * without_w + reverse);
        auto in = make_scan_inputs(2, 3, 6, 64, 96, 192, /*per_channel=*/false, /*with_state=*/true);
        if (without_w) in.w = Tensor();
        else in.kt = Tensor();
        const auto ref = scan_reference(in.op(reverse));
        const auto out = ops::chunk_state_scan_cuda(in.op(reverse), vb);
        EXPECT_LT(rel_err(out.states.cpu(), ref.states), 1e-5) << "states";
        EXPECT_LT(rel_err(out.v.cpu(), ref.v), 1e-5) << "v";
        EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5) << "final state";
        if (without_w) {
          EXPECT_TRUE(out.v.is_same(in.u)) << "without W the result's v is u itself";
        }
      }
}

// The chunk outputs kernel (ops::chunk_outputs_in_tokens on CUDA: kernels/prefill.h delta_rule_output)
// and its backward kernel (delta_rule_output_backward, K <= 128) == chunk_outputs + from_chunks in
// float64, value and every gradient (A_qk's on its causal part; the backward kernel writes zeros
// above the diagonal), on random inputs: head dims 16 to 256, lengths on and off the chunk, fp32
// out in 3xTF32 (1e-5) and on TF32 / bf16 out (the bf16 tolerance); the libtorch backward past
// K 128 or switched off, the libtorch form where the kernel does not serve (K 40) or is switched off.
TEST(DeltaRuleScan, ChunkOutputsKernelMatchesReference) {
  REQUIRE_FUSED_DECODE();
  struct S {
    int64_t B, T, H, K, V;
  };
  // The kernels (forward and backward), the forward kernel with the libtorch backward, both off.
  std::vector<DecodeOptions> modes(3);
  modes[1].delta_rule_output_backward = false;
  modes[2].delta_rule_output = false;
  const char* mode_names[] = {"", " backward switched off", " switched off"};
  for (const S s : {S{2, 200, 3, 96, 192}, S{1, 64, 2, 16, 16}, S{1, 130, 1, 256, 256}, S{3, 1, 2, 32, 80},
                    S{1, 100, 2, 40, 64}, S{2, 70, 2, 128, 48}})
    for (auto dtype : {f32, torch::kBFloat16})
      for (bool tf32 : {false, true})
        for (int mode = 0; mode < 3; ++mode) {
          SCOPED_TRACE(::testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " K" << s.K << " V" << s.V
                                            << " out " << name(dtype) << (tf32 ? " TF32" : "") << mode_names[mode]);
          torch::manual_seed(s.T + s.K + s.V + tf32 * 3 + (dtype == f32) * 5 + mode);
          const int64_t C = 64, N = (s.T + C - 1) / C;
          std::vector<Tensor> leaves, ref_leaves;
          for (auto shape : {std::vector<int64_t>{s.B, s.H, N, C, s.K}, std::vector<int64_t>{s.B, s.H, N, s.K, s.V},
                             std::vector<int64_t>{s.B, s.H, N, C, C}, std::vector<int64_t>{s.B, s.H, N, C, s.V}}) {
            auto x = torch::randn(shape, f64);
            if (shape.back() == C && shape[3] == C) x = x.tril();  // A_qk is causal
            ref_leaves.push_back(x.detach().requires_grad_(true));
            leaves.push_back(x.to(gpu(f32)).detach().requires_grad_(true));
          }
          const auto d_o = torch::randn({s.B, s.T, s.H, s.V}, f64);
          Tensor out;
          {
            DecodeOptionsGuard guard(modes[mode]);
            at::globalContext().setAllowTF32CuBLAS(tf32);
            out = ops::chunk_outputs_in_tokens(leaves[0], leaves[1], leaves[2], leaves[3], s.T, dtype);
            (out.to(f64) * d_o.cuda()).sum().backward();
            at::globalContext().setAllowTF32CuBLAS(false);
          }
          const auto ref =
              ops::from_chunks(ops::chunk_outputs(ref_leaves[0], ref_leaves[1], ref_leaves[2], ref_leaves[3]), s.T, f64);
          (ref * d_o).sum().backward();
          EXPECT_EQ(out.scalar_type(), dtype);
          EXPECT_EQ(out.sizes(), ref.sizes());
          const double tol = dtype == f32 && !tf32 ? 1e-5 : tolerance(torch::kBFloat16);
          EXPECT_LT(rel_err(out.detach().cpu().to(f64), ref.detach()), tol) << "output";
          const char* names[] = {"d q_start", "d states", "d a_qk", "d v_new"};
          for (size_t i = 0; i < leaves.size(); ++i) {
            // A_qk's causal part: the kernel reads only that (its gradient is zero above the diagonal).
            auto causal = [&](const Tensor& x) { return i == 2 ? x.tril() : x; };
            EXPECT_LT(rel_err(causal(leaves[i].grad().cpu().to(f64)), causal(ref_leaves[i].grad())), tol) << names[i];
          }
          if (mode == 0 && s.K % 16 == 0 && s.K <= 128) {
            EXPECT_EQ(leaves[2].grad().triu(1).abs().max().item<float>(), 0.f) << "d a_qk above the diagonal";
          }
        }
}

// The scan backward's row dots (ops::last_dim_dots, kernels/prefill.h row_dots) == float64 on random
// inputs: rows not a multiple of the block's 8, rows shorter and longer than a warp's 128 columns.
TEST(DeltaRuleScan, RowDotsMatchReference) {
  REQUIRE_FUSED_DECODE();
  for (const auto& shape : {std::vector<int64_t>{2, 3, 5, 96, 192}, std::vector<int64_t>{7, 4}, std::vector<int64_t>{3, 1, 300}}) {
    SCOPED_TRACE(::testing::Message() << torch::IntArrayRef(shape));
    torch::manual_seed(shape.back());
    const auto x = torch::randn(shape, f64), y = torch::randn(shape, f64);
    const auto got = ops::last_dim_dots(x.to(gpu(f32)), y.to(gpu(f32)));
    const auto want = (x * y).sum(-1, /*keepdim=*/true);
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_LT(rel_err(got.cpu().to(f64), want), 1e-5);
  }
}

// The scan's backward products (kernels/prefill.h scan_backward_products: dKt, dW and the carry's
// gradient in one kernel) under autograd == the float64 loop's gradients of w, u, kt, carry and the
// initial state, with and without W, per-head and per-channel carry, K 16 to 128, C 16 to 64, V off
// the kernel's 32-column tiles; and == the batched products and row dots it replaces (switch off).
TEST(DeltaRuleScan, ScanBackwardProductsMatchReference) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  struct Dims {
    int64_t B, H, N, C, K, V;
  };
  for (const Dims d : {Dims{2, 3, 5, 64, 96, 200}, Dims{1, 2, 4, 16, 16, 8}, Dims{1, 2, 3, 64, 128, 48},
                       Dims{2, 1, 6, 32, 32, 64}})
    for (bool with_w : {true, false})
      for (bool per_channel : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "B" << d.B << " H" << d.H << " N" << d.N << " C" << d.C << " K" << d.K
                                          << " V" << d.V << (with_w ? " with W" : " no W")
                                          << (per_channel ? " per-channel carry" : " per-head carry"));
        torch::manual_seed(d.K + d.V + with_w + 2 * per_channel);
        const auto o = torch::TensorOptions().dtype(f64);
        const auto w = 0.2 * torch::randn({d.B, d.H, d.N, d.C, d.K}, o), u = torch::randn({d.B, d.H, d.N, d.C, d.V}, o);
        const auto kt = 0.2 * torch::randn({d.B, d.H, d.N, d.K, d.C}, o);
        const auto carry = 0.5 + 0.5 * torch::rand({d.B, d.H, d.N, per_channel ? d.K : 1, 1}, o);
        const auto s0 = torch::randn({d.B, d.H, d.K, d.V}, o);
        const auto d_states = torch::randn({d.B, d.H, d.N, d.K, d.V}, o);
        const auto d_v = torch::randn({d.B, d.H, d.N, d.C, d.V}, o);
        const auto d_final = torch::randn({d.B, d.H, d.K, d.V}, o);
        auto run = [&](const torch::TensorOptions& on) {
          std::vector<Tensor> leaves;
          for (const Tensor* t : {&w, &u, &kt, &carry, &s0}) leaves.push_back(t->to(on).detach().requires_grad_(true));
          const auto r = ops::chunk_state_scan_differentiable(with_w ? leaves[0] : Tensor(), leaves[1], leaves[2],
                                                              leaves[3], leaves[4]);
          ((r.states.to(f64) * d_states.to(on.device())).sum() + (r.v.to(f64) * d_v.to(on.device())).sum() +
           (r.final_state.to(f64) * d_final.to(on.device())).sum())
              .backward();
          std::vector<Tensor> grads;
          for (auto& l : leaves) grads.push_back(l.grad().defined() ? l.grad().cpu().to(f64) : Tensor());
          return grads;
        };
        const auto want = run(o);
        const auto got = run(gpu(f32));
        DecodeOptions off;
        off.scan_backward_products = false;
        std::vector<Tensor> replaced;
        {
          DecodeOptionsGuard guard(off);
          replaced = run(gpu(f32));
        }
        const char* names[] = {"dw", "du", "dkt", "dcarry", "d initial state"};
        for (size_t i = with_w ? 0 : 1; i < want.size(); ++i) {
          ASSERT_TRUE(got[i].defined() && replaced[i].defined()) << names[i];
          EXPECT_LT(rel_err(got[i], want[i]), 1e-5) << names[i];
          EXPECT_LT(rel_err(got[i], replaced[i]), 1e-5) << names[i] << " against the products it replaces";
        }
      }
}

TEST(DeltaRuleScan, BindingTakesStridedAndMisalignedInputs) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(12);
  const int64_t B = 2, H = 2, N = 3, C = 16, K = 32, V = 64;
  const auto in = make_scan_inputs(B, H, N, C, K, V, true, true);
  const auto ref = scan_reference(in.op());
  // u and w as views into one [.., V + K] tensor (as the op's caller has them), kt as a transposed
  // view, the addend starting one float into its storage (not 16-byte aligned), the state permuted.
  auto uw = torch::cat({in.u, in.w}, -1);
  auto kt_view = in.kt.transpose(-1, -2).contiguous().transpose(-1, -2);
  auto addend_off = torch::empty({in.addend.numel() + 1}, gpu(f32)).narrow(0, 1, in.addend.numel()).view(in.addend.sizes());
  addend_off.copy_(in.addend);
  auto s0_perm = in.s0.permute({1, 0, 2, 3}).contiguous().permute({1, 0, 2, 3});
  const auto out = ops::chunk_state_scan_cuda(
      {uw.narrow(-1, V, K), uw.narrow(-1, 0, V), kt_view, in.carry, s0_perm, addend_off, false, Tensor(), Tensor()});
  EXPECT_LT(rel_err(out.states.cpu(), ref.states), 1e-5);
  EXPECT_LT(rel_err(out.v.cpu(), ref.v), 1e-5);
  EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5);
  // The inputs are left as they were (the final state is a new tensor).
  EXPECT_EQ(rel_err(s0_perm.cpu(), in.s0.cpu()), 0.0);
}

TEST(DeltaRuleScan, BindingRejectsBadInput) {
  REQUIRE_FUSED_DECODE();
  const int64_t B = 1, H = 2, N = 2, C = 16, K = 32, V = 64;
  const auto in = make_scan_inputs(B, H, N, C, K, V, false, true);
  auto call = [&](const Tensor& w, const Tensor& u, const Tensor& kt, const Tensor& carry, const Tensor& s0,
                  const Tensor& addend, int vb = 0) {
    return [=] { ops::chunk_state_scan_cuda({w, u, kt, carry, s0, addend, false, Tensor(), Tensor()}, vb); };
  };
  expect_error(call(in.w.narrow(-1, 0, K - 4), in.u, in.kt, in.carry, in.s0, in.addend), "kt must be");
  expect_error(call(in.w, in.u.narrow(1, 0, 1), in.kt, in.carry, in.s0, in.addend), "u must be");
  expect_error(call(in.w, in.u, in.kt.transpose(-1, -2), in.carry, in.s0, in.addend), "kt must be");
  expect_error(call(in.w, in.u, in.kt, in.carry.expand({B, H, N, 3, 1}), in.s0, in.addend), "carry");
  expect_error(call(in.w, in.u, in.kt, in.carry, in.s0.narrow(-1, 0, 8), in.addend), "initial_state must be");
  expect_error(call(in.w, in.u, in.kt, in.carry, in.s0, in.addend.narrow(2, 0, 1)), "addend must be");
  expect_error(call(in.w.unsqueeze(0), in.u, in.kt, in.carry, in.s0, in.addend), "w must be");
  expect_error(call(Tensor(), in.u, Tensor(), in.carry, in.s0, in.addend), "without w, kt must be");
  expect_error(call(in.w, in.u, in.kt, Tensor(), in.s0, in.addend), "carry");
  expect_error(call(in.w, in.u.to(f64), in.kt, in.carry, in.s0, in.addend), "u must be");
  expect_error(call(in.w.to(f64), in.u.to(f64), in.kt.to(f64), in.carry.to(f64), in.s0.to(f64), in.addend.to(f64)),
               "float32 CUDA");
  expect_error(call(in.w, in.u.cpu(), in.kt, in.carry, in.s0, in.addend), "on cuda");
  expect_error(call(in.w.cpu(), in.u.cpu(), in.kt.cpu(), in.carry.cpu(), in.s0.cpu(), in.addend.cpu()), "CUDA");
  expect_error(call(in.w, in.u, in.kt, in.carry, in.s0, in.addend, 24), "value_block");
  expect_error(call(in.w, in.u.narrow(-1, 0, 40), in.kt, in.carry, in.s0.narrow(-1, 0, 40),
                    in.addend.narrow(-1, 0, 40), 32),
               "must divide V");
  // Dims the kernel does not serve: K off a multiple of 4, C above 64, V off a multiple of 8.
  const auto odd = make_scan_inputs(1, 1, 2, 16, 6, 12, false, false);
  expect_error(call(odd.w, odd.u, odd.kt, odd.carry, odd.s0, odd.addend), "no kernel for K 6");
  const auto big = make_scan_inputs(1, 1, 1, 80, 16, 16, false, false);
  expect_error(call(big.w, big.u, big.kt, big.carry, big.s0, big.addend), "no kernel");
  EXPECT_FALSE(ops::chunk_state_scan_supported(6, 12, 16, torch::Device(torch::kCUDA, 0)));
  EXPECT_FALSE(ops::chunk_state_scan_supported(32, 64, 80, torch::Device(torch::kCUDA, 0)));
  EXPECT_FALSE(ops::chunk_state_scan_supported(32, 64, 16, torch::Device(torch::kCPU)));
  EXPECT_TRUE(ops::chunk_state_scan_supported(256, 256, 64, torch::Device(torch::kCUDA, 0)));
}

// ---------------------------------------------------------------------------------------------
// Where the kernel does not serve, delta_rule_chunked on CUDA keeps the libtorch loop (dims off
// the kernel's multiples, chunks it does not take), with and without autograd.

TEST(DeltaRuleScan, LoopKeptWhereKernelDoesNotServe) {
  REQUIRE_FUSED_DECODE();
  at::globalContext().setAllowTF32CuBLAS(false);
  torch::manual_seed(13);
  const auto in = make_inputs(2, 40, 2, 6, 12, Gate::Channel, true);  // K 6, V 12: no kernel
  for (int64_t C : {16, 7}) {
    const auto ref = recurrent_f64(in);
    {
      torch::NoGradGuard no_grad;
      const auto out = chunked_on(in, gpu(f32), C);
      EXPECT_LT(rel_err(out.o.cpu(), ref.o), 1e-5) << "C " << C;
      EXPECT_LT(rel_err(out.final_state.cpu(), ref.final_state), 1e-5) << "C " << C;
    }
    auto q = in.q.to(gpu(f32)).requires_grad_(true);
    const auto o = gpu(f32);
    auto out = ops::delta_rule_chunked(q, to(in.k, o), to(in.v, o), to(in.beta, o), to(in.g, o), in.scale,
                                       to(in.s0, o), C);
    out.o.sum().backward();
    ASSERT_TRUE(q.grad().defined());
    EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
    EXPECT_LT(rel_err(out.o.detach().cpu(), ref.o), 1e-5) << "C " << C << " under autograd";
  }
}
