// GPU (CTest label `gpu`): the model on CUDA against the CPU float64 reference (logits and every
// parameter's gradient), decode == forward on CUDA, and a bf16-autocast training step with the block
// norms' outputs in bf16 and in fp32.
// Skips where no CUDA GPU is present.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <map>

#include "gpu/gpu_testing.h"

#include "common/testing.h"
#include "lt2/mixers/registry.h"
#include "lt2/model/looped_lm.h"
#include "lt2/ops/decode_options.h"

using namespace lt2;
using lt2::testing::rel_err;
using lt2::gpu_testing::tolerance;
using lt2::testing::tiny_config;


namespace {

std::vector<std::string> gpu_patterns() {
  std::vector<std::string> p{"full"};
  for (const char* name : {"gdn", "kda", "mamba2", "retnet", "deltanet", "gla", "hgrn2", "linear", "window", "dsa", "nsa"})
    if (find_mixer(name)) p.push_back(name);
  if (find_mixer("gdn")) p.push_back("interleaved:1:1:gdn:full");
  return p;
}

// fp32 on the CPU as cuBLAS and cuDNN compute on the GPU: TF32 off.
void without_tf32() {
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
}

// A model of cfg in fp32 with ref's parameters.
LoopedLM copy_of(LoopedLM& ref, const ModelConfig& cfg) {
  LoopedLM m(cfg);
  torch::NoGradGuard ng;
  auto src = ref->named_parameters();
  for (auto& p : m->named_parameters()) p.value().copy_(src[p.key()]);
  return m;
}

}  // namespace

// fp32 on the GPU must be as accurate as fp32 on the CPU: both are compared with the float64
// reference, and the GPU error may not exceed 4x the CPU's (nor 1e-6, for exact-ish cases).
TEST(CudaModel, Fp32AsAccurateAsCpuFp32) {
  REQUIRE_CUDA();
  without_tf32();
  for (const auto& pattern : gpu_patterns()) {
    for (auto form : {ModelForm::LT2, ModelForm::Ouro}) {
      auto cfg = tiny_config(pattern, form);
      torch::manual_seed(11);
      LoopedLM ref(cfg);
      ref->to(torch::kFloat64);
      LoopedLM cpu = copy_of(ref, cfg);
      torch::NoGradGuard ng;
      auto tok = torch::randint(cfg.vocab_size, {2, 24}, torch::kLong);
      auto want = ref->forward(tok).logits;
      const double cpu_err = rel_err(cpu->forward(tok).logits, want);
      cpu->to(torch::kCUDA);
      const double gpu_err = rel_err(cpu->forward(tok.cuda()).logits.cpu(), want);
      EXPECT_LT(gpu_err, std::max(4 * cpu_err, 1e-6))
          << pattern << " form " << to_string(form) << ": CPU fp32 error " << cpu_err;
    }
  }
}

// The gradients of every parameter on the GPU in fp32 against the CPU float64 reference, with the CPU's
// fp32 error as the yardstick: each GPU gradient's error may not exceed 8x the CPU's nor invariant 5's
// fp32 tolerance, whichever is larger. 8x, not the forward's 4x: the per-channel scores' products run in
// 3xTF32 (channel_scores.cu), whose rounding per product (~2^-22: the dropped low x low term and the low
// parts' own TF32 rounding) is 4-8x fp32's 2^-24, and a gradient sums many of them (GLA's output-norm
// weight measured 4.06x the CPU's on an H100). A layout, stride or view mistake, which this test is for,
// gives errors of order 1. 70 tokens: a whole chunk of the chunked forms (64) and part of the next. The
// kernels' own tests check each backward alone at invariant 5's tolerance.
TEST(CudaModel, Fp32GradientsAsAccurateAsCpuFp32) {
  REQUIRE_CUDA();
  without_tf32();
  for (const auto& pattern : gpu_patterns()) {
    for (auto form : {ModelForm::LT2, ModelForm::Ouro}) {
      auto cfg = tiny_config(pattern, form);
      cfg.max_seq_len = 128;
      torch::manual_seed(13);
      LoopedLM ref(cfg);
      ref->to(torch::kFloat64);
      LoopedLM cpu = copy_of(ref, cfg), gpu_model = copy_of(ref, cfg);
      gpu_model->to(torch::kCUDA);
      const auto tok = torch::randint(cfg.vocab_size, {2, 70}, torch::kLong);
      const auto w = torch::randn({2, 70, cfg.vocab_size}, torch::kFloat64);
      auto grads = [&](LoopedLM& m, const torch::Device& device, torch::ScalarType dt) {
        m->zero_grad();
        (m->forward(tok.to(device)).logits * w.to(device, dt)).sum().backward();
        std::map<std::string, torch::Tensor> g;
        for (const auto& p : m->named_parameters())
          if (p.value().grad().defined()) g[p.key()] = p.value().grad().cpu().to(torch::kFloat64);
        return g;
      };
      const auto want = grads(ref, torch::kCPU, torch::kFloat64);
      const auto on_cpu = grads(cpu, torch::kCPU, torch::kFloat32);
      const auto on_gpu = grads(gpu_model, torch::kCUDA, torch::kFloat32);
      ASSERT_EQ(on_gpu.size(), want.size()) << pattern << " form " << to_string(form);
      for (const auto& [name, g] : on_gpu) {
        const double cpu_err = rel_err(on_cpu.at(name), want.at(name));
        EXPECT_LT(rel_err(g, want.at(name)), std::max(8 * cpu_err, tolerance(torch::kFloat32)))
            << pattern << " form " << to_string(form) << " " << name << ": CPU fp32 error " << cpu_err;
      }
    }
  }
}

TEST(CudaModel, DecodeEqualsForward) {
  REQUIRE_CUDA();
  for (const auto& pattern : gpu_patterns()) {
    auto cfg = tiny_config(pattern);
    torch::manual_seed(5);
    LoopedLM m(cfg);
    m->to(torch::kCUDA);
    torch::NoGradGuard ng;
    auto tok = torch::randint(cfg.vocab_size, {2, 19}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
    auto full = m->forward(tok).logits;
    auto state = m->make_state(2, 32, torch::TensorOptions().device(torch::kCUDA));
    auto pre = m->forward(tok.narrow(1, 0, 7), state.get()).logits;
    std::vector<torch::Tensor> outs{pre};
    for (int64_t t = 7; t < 19; ++t) outs.push_back(m->forward(tok.narrow(1, t, 1), state.get()).logits);
    EXPECT_LT(rel_err(torch::cat(outs, 1), full), 1e-5) << pattern;
  }
}

// A bf16-autocast training step of every mixer's model is finite, and its gradients are the same
// whether the block norms hand the mixers and the FFN their input in bf16 (norm_products_dtype, on
// by default: every mixer reads it through one packed projection) or in fp32, each product casting it.
TEST(CudaModel, Bf16AutocastTrainingStepMatchesWithBf16NormOutputs) {
  REQUIRE_CUDA();
  for (const auto& pattern : gpu_patterns()) {
    auto cfg = tiny_config(pattern);
    torch::manual_seed(12);
    LoopedLM m(cfg);
    m->to(torch::kCUDA);
    auto tok =
        torch::randint(cfg.vocab_size, {4, 32}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
    auto step = [&](bool bf16_norm_outputs) {
      DecodeOptions options;
      options.norm_products_dtype = bf16_norm_outputs;
      const DecodeOptionsGuard guard(options);
      m->zero_grad();
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      auto logits = m->forward(tok).logits;
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
      EXPECT_EQ(logits.scalar_type(), torch::kBFloat16) << pattern;
      auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).reshape({-1, cfg.vocab_size}),
                                                       tok.reshape({-1}));
      loss.backward();
      EXPECT_TRUE(std::isfinite(loss.item<double>())) << pattern;
      std::map<std::string, torch::Tensor> grads;
      for (const auto& p : m->named_parameters())
        if (p.value().grad().defined()) grads[p.key()] = p.value().grad().clone();
      return grads;
    };
    const auto fp32_inputs = step(false), bf16_inputs = step(true);
    ASSERT_EQ(fp32_inputs.size(), bf16_inputs.size()) << pattern;
    for (const auto& [name, g] : bf16_inputs) {
      EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << pattern << " " << name;
      EXPECT_LT(rel_err(g, fp32_inputs.at(name)), tolerance(torch::kBFloat16)) << pattern << " " << name;
    }
  }
}
