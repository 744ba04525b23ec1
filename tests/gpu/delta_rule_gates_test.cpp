// GPU (CTest label `gpu`): the recurrent mixers' gate kernels (kernels/cuda/delta_rule_gates.cu). The
// gated delta rule's gates kernel (behind ops::delta_rule_gates) against the float64 reference on random
// inputs, read in place from a packed projection or packed, with fp32 or model-dtype parameters, values
// past softplus's threshold; its backward kernel (training) against float64 autograd of the libtorch
// form, every gradient (a, b, A_log, dt_bias) at GDN's and KDA's shapes; the inference form of the GDN
// and KDA layers (one packed projection, the convolutions and norms reading slices and model-dtype
// weights in place, the gates kernel) as accurate as the training form; GLA's and HGRN2's log-sigmoid
// gates and Mamba2's scaled values against float64 autograd. Skips where no CUDA GPU (or no CUDA
// kernels).
#include <gtest/gtest.h>

#include "gpu/gpu_testing.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "lt2/mixers/recurrent_mixer.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/gated_linear/gated_linear.h"

using namespace lt2;
using lt2::testing::rel_err;
using torch::Tensor;
using namespace lt2::gpu_testing;

namespace {

struct GatesCase {
  int64_t B, T, cols, heads, beta_cols;
};

// Random float64 gate inputs for case c: a projection [B, T, cols + beta_cols + 5] whose first
// columns are a then b, with values past softplus's threshold, A_log [heads] and dt_bias [cols].
struct GatesInputs {
  Tensor packed, A_log, dt_bias;
};
GatesInputs random_gate_inputs(const GatesCase& c) {
  GatesInputs in;
  in.packed = torch::randn({c.B, c.T, c.cols + c.beta_cols + 5}, torch::kFloat64) * 4;
  in.packed.index_put_({0, 0, 0}, 25.0);  // past softplus's threshold
  in.packed.index_put_({0, 1, 1}, -30.0);
  in.A_log = torch::randn({c.heads}, torch::kFloat64) * 0.5;
  in.dt_bias = torch::randn({c.cols}, torch::kFloat64);
  return in;
}

}  // namespace

TEST(DeltaRuleGatesGpu, KernelMatchesTheFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  torch::NoGradGuard no_grad;
  torch::manual_seed(31);
  // GDN's shape (one decay per head), KDA's (one per key channel of 4 heads), and odd sizes.
  for (const GatesCase c : std::vector<GatesCase>{{2, 37, 16, 16, 16}, {1, 50, 128, 4, 4}, {3, 5, 6, 2, 3}}) {
    SCOPED_TRACE(cat("B", c.B, " T", c.T, " cols", c.cols, " heads", c.heads, " beta_cols", c.beta_cols));
    const auto in = random_gate_inputs(c);
    const Tensor &packed = in.packed, &A_log = in.A_log, &dt_bias = in.dt_bias;
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      for (auto param_dt : {torch::kFloat32, dt}) {
        for (bool in_place : {true, false}) {
          for (double scale : {1.0, 2.0}) {
            SCOPED_TRACE(cat(name(dt), " params ", name(param_dt), in_place ? " slices" : " packed", " scale ", scale));
            const auto r = [](const Tensor& t, torch::ScalarType s) { return t.to(s).to(torch::kFloat64); };
            const auto want = ops::delta_rule_gates(r(packed, dt).narrow(2, 0, c.cols),
                                                    r(packed, dt).narrow(2, c.cols, c.beta_cols), r(A_log, param_dt),
                                                    r(dt_bias, param_dt), scale);
            const auto p = packed.to(torch::kCUDA, dt);
            auto a = p.narrow(2, 0, c.cols), b = p.narrow(2, c.cols, c.beta_cols);
            if (!in_place) a = a.contiguous(), b = b.contiguous();
            const auto got = ops::delta_rule_gates(a, b, A_log.to(torch::kCUDA, param_dt),
                                                   dt_bias.to(torch::kCUDA, param_dt), scale);
            ASSERT_EQ(got.g.scalar_type(), torch::kFloat32);
            EXPECT_LT(rel_err(got.g.cpu(), want.g), tolerance(torch::kFloat32));
            EXPECT_LT(rel_err(got.beta.cpu(), want.beta), tolerance(torch::kFloat32));
            // The switch off takes the libtorch form on the GPU, which agrees.
            DecodeOptions off;
            off.delta_rule_gates = false;
            DecodeOptionsGuard guard(off);
            const auto ref = ops::delta_rule_gates(a, b, A_log.to(torch::kCUDA, param_dt),
                                                   dt_bias.to(torch::kCUDA, param_dt), scale);
            EXPECT_LT(rel_err(ref.g, got.g), tolerance(torch::kFloat32));
            EXPECT_LT(rel_err(ref.beta, got.beta), tolerance(torch::kFloat32));
          }
        }
      }
    }
  }
}

// Under autograd the kernels run forward and backward: g, beta and the gradients of a, b, A_log and
// dt_bias against float64 autograd of the libtorch form on the same (rounded) values, with a and b
// column slices of one projection (GDN and KDA: the layers' layout) or packed, fp32 and bf16, with
// values past softplus's threshold; the gradient of a bf16 input is rounded once, so bf16 takes its
// tolerance.
TEST(DeltaRuleGatesGpu, GradientsMatchTheFloat64Reference) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(33);
  for (const GatesCase c : std::vector<GatesCase>{{2, 37, 16, 16, 16}, {2, 300, 512, 4, 4}, {3, 5, 6, 2, 3}}) {
    SCOPED_TRACE(cat("B", c.B, " T", c.T, " cols", c.cols, " heads", c.heads, " beta_cols", c.beta_cols));
    const auto in = random_gate_inputs(c);
    const Tensor &packed = in.packed, &A_log = in.A_log, &dt_bias = in.dt_bias;
    const auto dG = torch::randn({c.B, c.T, c.cols}, torch::kFloat64);
    const auto dB = torch::randn({c.B, c.T, c.beta_cols}, torch::kFloat64);
    for (auto dt : {torch::kFloat32, torch::kBFloat16})
      for (bool in_place : {true, false}) {
        SCOPED_TRACE(cat(name(dt), in_place ? " slices" : " packed"));
        // Gradients of <g, dG> + <beta, dB> w.r.t. a, b, A_log and dt_bias: on the GPU with the
        // projection in dt and fp32 parameters, or on the CPU in float64 from the same rounded values.
        auto run = [&](bool gpu_run) {
          const auto act = gpu_run ? dt : torch::kFloat64, param = gpu_run ? torch::kFloat32 : torch::kFloat64;
          const auto device = gpu_run ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
          auto p = packed.to(dt).to(device, act).detach().requires_grad_(true);
          auto A = A_log.to(device, param).detach().requires_grad_(true);
          auto bias = dt_bias.to(device, param).detach().requires_grad_(true);
          Tensor a = p.narrow(2, 0, c.cols), b = p.narrow(2, c.cols, c.beta_cols);
          if (!in_place) a = a.contiguous(), b = b.contiguous();
          const auto out = ops::delta_rule_gates(a, b, A, bias, 2.0);
          ((out.g.to(torch::kFloat64) * dG.to(device)).sum() + (out.beta.to(torch::kFloat64) * dB.to(device)).sum())
              .backward();
          auto f64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
          return std::vector<Tensor>{f64(out.g), f64(out.beta), f64(p.grad()), f64(A.grad()), f64(bias.grad())};
        };
        const auto got = run(true), want = run(false);
        const double tol = tolerance(dt);
        const char* names[] = {"g", "beta", "d projection (a, b)", "dA_log", "ddt_bias"};
        for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_err(got[i], want[i]), tol) << names[i];
      }
  }
}

// The gated linear family's log-sigmoid gates (ops::log_sigmoid_gates: GLA's g = log_sigmoid(x) / 16,
// HGRN2's g and k = 1 - exp(g)) under autograd: g, k and x's gradient against float64 autograd of the
// libtorch form on the same rounded values and upstream gradients, x a column slice of a projection or
// packed, fp32 and bf16, with values at both tails (+-30); k absent, fp32 or bf16, and its gradient or
// g's absent in turn; the switch off (the libtorch form on the GPU) agrees.
TEST(LogSigmoidGatesGpu, MatchTheFloat64ReferenceWithGradient) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(35);
  const int64_t B = 2, T = 37, C = 48;
  auto packed = torch::randn({B, T, C + 5}, torch::kFloat64) * 4;
  packed.index_put_({0, 0, 1}, 30.0);
  packed.index_put_({1, 2, 3}, -30.0);
  const auto dg = torch::randn({B, T, C}, torch::kFloat64), dk = torch::randn({B, T, C}, torch::kFloat64);
  using OptDtype = std::optional<torch::ScalarType>;
  for (auto dt : {torch::kFloat32, torch::kBFloat16})
    for (bool in_place : {true, false})
      for (double normalizer : {1.0, 16.0})
        for (const OptDtype k_dtype : {OptDtype(), OptDtype(torch::kFloat32), OptDtype(torch::kBFloat16)})
          for (const char* upstream : {"both", "g only", "k only"}) {
            const bool use_g = std::string(upstream) != "k only", use_k = k_dtype && std::string(upstream) != "g only";
            if (!k_dtype && !use_g) continue;
            SCOPED_TRACE(cat(name(dt), in_place ? " slice" : " packed", " normalizer ", normalizer, " k ",
                             k_dtype ? name(*k_dtype) : "none", " upstream ", upstream));
            // On the GPU (kernel on or off) in dt, or on the CPU in float64 from the same rounded values.
            auto run = [&](bool gpu_run, bool kernel) {
              DecodeOptions options;
              options.log_sigmoid_gate = kernel;
              DecodeOptionsGuard guard(options);
              const auto device = gpu_run ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
              const auto act = gpu_run ? dt : torch::kFloat64;
              auto p = packed.to(dt).to(device, act).detach().requires_grad_(true);
              Tensor x = p.narrow(2, 1, C);
              if (!in_place) x = x.contiguous();
              const OptDtype kd = k_dtype && !gpu_run ? OptDtype(torch::kFloat64) : k_dtype;
              const auto out =
                  ops::log_sigmoid_gates(x, normalizer, gpu_run ? torch::kFloat32 : torch::kFloat64, kd);
              EXPECT_EQ(out.complement.defined(), k_dtype.has_value());
              // k's upstream gradient as the GPU's autograd hands it: in k's dtype.
              auto round_k = [&](const Tensor& t) { return k_dtype ? t.to(*k_dtype).to(torch::kFloat64) : t; };
              auto loss = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
              if (use_g) loss = loss + (out.g.to(torch::kFloat64) * dg.to(device)).sum();
              if (use_k) loss = loss + (out.complement.to(torch::kFloat64) * round_k(dk).to(device)).sum();
              loss.backward();
              auto f64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
              return std::vector<Tensor>{f64(out.g), k_dtype ? f64(out.complement) : Tensor(), f64(p.grad())};
            };
            const auto want = run(false, true), got = run(true, true), off = run(true, false);
            EXPECT_LT(rel_err(got[0], want[0]), tolerance(torch::kFloat32)) << "g";
            if (k_dtype) {
              EXPECT_LT(rel_err(got[1], want[1]), tolerance(*k_dtype)) << "k";
            }
            EXPECT_LT(rel_err(got[2], want[2]), tolerance(dt)) << "dx";
            EXPECT_EQ(got[2].narrow(2, 0, 1).abs().max().item<double>(), 0.0) << "columns outside x";
            EXPECT_LT(rel_err(off[2], got[2]), tolerance(dt)) << "dx, switch off";
          }
}

// Mamba2's scaled values (ops::scale_heads: v = dt x) under autograd: v and the gradients of x and dt
// against float64 autograd of the libtorch form on the same rounded values and upstream gradient, x a
// column slice of a projection (Mamba2's layout) or packed, fp32 and bf16, head dims over and under a
// warp; the switch off (the libtorch form on the GPU) agrees.
TEST(ScaleHeadsGpu, MatchTheFloat64ReferenceWithGradient) {
  REQUIRE_FUSED_DECODE();
  torch::manual_seed(37);
  for (const auto& [H, P] : std::vector<std::pair<int64_t, int64_t>>{{12, 128}, {3, 20}}) {
    const int64_t B = 2, T = 37;
    const auto packed = torch::randn({B, T, H * P + 9}, torch::kFloat64);
    const auto s = torch::rand({B, T, H}, torch::kFloat64) * 2;
    const auto dy = torch::randn({B, T, H, P}, torch::kFloat64);
    for (auto dt : {torch::kFloat32, torch::kBFloat16})
      for (bool in_place : {true, false}) {
        SCOPED_TRACE(cat("H ", H, " P ", P, " ", name(dt), in_place ? " slice" : " packed"));
        // On the GPU (kernel on or off) in dt with fp32 s, or on the CPU in float64 from the same rounded values.
        auto run = [&](bool gpu_run, bool kernel) {
          DecodeOptions options;
          options.scale_heads = kernel;
          DecodeOptionsGuard guard(options);
          const auto device = gpu_run ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
          auto p = packed.to(dt).to(device, gpu_run ? dt : torch::kFloat64).detach().requires_grad_(true);
          auto scale = s.to(device, gpu_run ? torch::kFloat32 : torch::kFloat64).detach().requires_grad_(true);
          Tensor x = p.narrow(2, 4, H * P).view({B, T, H, P});
          if (!in_place) x = x.contiguous();
          const auto v = ops::scale_heads(x, scale);
          EXPECT_EQ(v.scalar_type(), x.scalar_type());
          (v.to(torch::kFloat64) * dy.to(dt).to(device, torch::kFloat64)).sum().backward();
          auto f64 = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
          return std::vector<Tensor>{f64(v), f64(p.grad()), f64(scale.grad())};
        };
        const auto want = run(false, true), got = run(true, true), off = run(true, false);
        EXPECT_LT(rel_err(got[0], want[0]), tolerance(dt)) << "v";
        EXPECT_LT(rel_err(got[1], want[1]), tolerance(dt)) << "dx";
        EXPECT_LT(rel_err(got[2], want[2]), tolerance(torch::kFloat32)) << "ds";
        EXPECT_EQ(got[1].narrow(2, 0, 4).abs().max().item<double>(), 0.0) << "columns outside x";
        EXPECT_LT(rel_err(off[1], got[1]), tolerance(dt)) << "dx, switch off";
        EXPECT_LT(rel_err(off[2], got[2]), tolerance(torch::kFloat32)) << "ds, switch off";
      }
  }
}

// In fp32 the two forms agree to invariant 5's tolerance. In bf16 they round at different points
// (one packed GEMM against separate ones, the prefill scan against the training chunks), and the
// layer rounds at ~8 points: the training form itself is ~0.6% from the float64 layer at this shape
// (on the CPU, where both forms run the same libtorch ops), so two bf16 forms differ by about that
// much. There each is compared with the float64 layer on the same rounded weights and inputs, and the
// inference form must be as accurate as the training form to within invariant 5's bf16 tolerance: a
// wrong slice, weight or gate is off by O(1).
TEST(DeltaRuleGatesGpu, InferenceLayerAsAccurateAsTheTrainingForm) {
  REQUIRE_FUSED_DECODE();
  for (const char* kind : {"gdn", "kda"}) {
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(cat(kind, " ", name(dt)));
      auto cfg = lt2::testing::tiny_config(kind);
      cfg.d_model = 128;
      cfg.n_heads = 2;
      torch::manual_seed(32);
      auto m = make_mixer(kind, cfg, 0);
      m->to(torch::kCUDA, dt);
      torch::manual_seed(32);
      auto reference = make_mixer(kind, cfg, 0);
      reference->to(dt);
      reference->to(torch::kFloat64);
      const int64_t B = 2, T = 77;
      auto x = torch::randn({B, T, cfg.d_model}, gpu(dt));
      // The float64 layer on the CPU (the reference path), on the inputs as rounded to dt.
      const auto x64 = x.cpu().to(torch::kFloat64);
      auto ref_state = reference->make_state(B, T, x64.options());
      const auto y_ref = reference->forward(x64, Positions{0}, ref_state.get()).detach();
      // The training form: separate projections, the libtorch gates, convolution and norm weights
      // converted to fp32 (gradients on), continuing a state as prefill does.
      auto train_state = m->make_state(B, T, x.options());
      const auto y_train = m->forward(x, Positions{0}, train_state.get()).detach();
      m->pack_for_inference();
      torch::NoGradGuard no_grad;
      auto state = m->make_state(B, T, x.options());
      const auto y = m->forward(x, Positions{0}, state.get());
      const auto expect_as_accurate = [&](const Tensor& got, const Tensor& train, const Tensor& ref, const char* what) {
        SCOPED_TRACE(what);
        if (dt == torch::kFloat32) {
          EXPECT_LT(rel_err(got, train), tolerance(dt));
        } else {
          EXPECT_LT(rel_err(got.cpu(), ref), rel_err(train.cpu(), ref) + tolerance(dt));
        }
      };
      expect_as_accurate(y, y_train, y_ref, "output");
      const auto& a = dynamic_cast<RecurrentState&>(*state);
      const auto& b = dynamic_cast<RecurrentState&>(*train_state);
      const auto& r = dynamic_cast<RecurrentState&>(*ref_state);
      expect_as_accurate(a.S, b.S, r.S, "state");
      for (size_t i = 0; i < a.conv.size(); ++i) expect_as_accurate(a.conv[i], b.conv[i], r.conv[i], "conv tail");
    }
  }
}
