// bf16 autocast on CUDA for a scope: matmuls in bf16, fp32 master weights and reductions.
#pragma once
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

namespace lt2 {

class AutocastScope {
 public:
  explicit AutocastScope(bool on) : on_(on) {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  }
  ~AutocastScope() {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool on_;
};

// TF32 tensor cores for the fp32 matmuls while it lives (cuBLAS; restores the previous setting).
// Under bf16 autocast the chunked forms of the linear recurrences keep their math in fp32 (states
// and decays need the range); TF32 runs those products ~8x faster than fp32 FMAs, at a 10-bit
// mantissa that stays well inside the bf16 tolerance of the activations around them.
class Tf32Scope {
 public:
  explicit Tf32Scope(bool on) : previous_(at::globalContext().allowTF32CuBLAS()) {
    at::globalContext().setAllowTF32CuBLAS(on);
  }
  ~Tf32Scope() { at::globalContext().setAllowTF32CuBLAS(previous_); }
  Tf32Scope(const Tf32Scope&) = delete;
  Tf32Scope& operator=(const Tf32Scope&) = delete;

 private:
  bool previous_;
};

}  // namespace lt2
