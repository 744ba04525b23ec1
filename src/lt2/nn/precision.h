// Numeric precision settings for a scope.
#pragma once
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>

namespace lt2 {

// TF32 tensor cores for the fp32 matmuls while it lives (cuBLAS; restores the previous setting).
// With bf16 activations (autocast in training, bf16 weights in the engine) the chunked forms of
// the linear recurrences keep their math in fp32 (states and decays need the range); TF32 runs
// those products ~8x faster than fp32 FMAs, at a 10-bit mantissa that stays well inside the bf16
// tolerance of the activations around them. The flag is process-wide (cuBLAS reads it at each
// call), so a scope also covers autograd's backward threads.
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

// y as a linear layer after it should read it: as is where autocast is on for y's device (the layer
// casts to the autocast dtype itself: a cast to like's dtype first, bf16 -> fp32 -> bf16, would be
// two passes over y forward and two more in the backward), else in like's dtype.
inline at::Tensor for_linear(const at::Tensor& y, const at::Tensor& like) {
  return at::autocast::is_autocast_enabled(y.device().type()) ? y : y.to(like.scalar_type());
}

// The dtype a product of a and b runs in when its dtypes are chosen by hand (autocast turned off
// for it): the autocast dtype where autocast would cast the product's inputs (no float64 among
// them, autocast on for a's device), else their common dtype.
inline at::ScalarType product_dtype(const at::Tensor& a, const at::Tensor& b) {
  const auto dev = a.device().type();
  const bool eligible = a.scalar_type() != at::kDouble && b.scalar_type() != at::kDouble;
  if (eligible && at::autocast::is_autocast_enabled(dev)) return at::autocast::get_autocast_dtype(dev);
  return c10::promoteTypes(a.scalar_type(), b.scalar_type());
}

// The calling thread's CUDA autocast state. Autocast is thread-local and a backward runs on
// autograd's own thread: a function that runs a forward again there captures the state with
// current() and sets it for the recompute with an AutocastStateScope.
struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCUDA), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
};

// Sets a captured autocast state for its scope, then restores the thread's own.
class AutocastStateScope {
 public:
  explicit AutocastStateScope(AutocastState state) : previous_(AutocastState::current()) { set(state); }
  ~AutocastStateScope() { set(previous_); }
  AutocastStateScope(const AutocastStateScope&) = delete;
  AutocastStateScope& operator=(const AutocastStateScope&) = delete;

 private:
  static void set(AutocastState s) {
    at::autocast::set_autocast_enabled(at::kCUDA, s.enabled);
    at::autocast::set_autocast_dtype(at::kCUDA, s.dtype);
  }
  AutocastState previous_;
};

}  // namespace lt2
