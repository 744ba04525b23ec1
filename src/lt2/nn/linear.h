// Linear layers and the numeric conventions every layer above shares: the accumulation dtype,
// truncated-normal initialisation, bias-free linear layers, and inference packing of layers that
// read the same input.
#pragma once
#include <torch/torch.h>

#include <vector>

namespace lt2 {

using torch::Tensor;

// The dtype for numerically sensitive math (norms, gates, cumulative sums, RoPE angles): fp32 for
// low-precision inputs, float64 kept as is (so float64 tests check the exact math).
inline torch::ScalarType accum_dtype(const Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// Truncated normal N(0, std) cut at +-3 std, in place (LT2/Lingua initialisation).
void trunc_normal_(Tensor w, double std);

// A linear layer initialised with trunc_normal_(std); std 0 means zero-initialised (SDPA output
// gate, rho).
torch::nn::Linear make_linear(int64_t in, int64_t out, double std, bool bias = false);

// The weights of Linear layers that read the same input, concatenated along the output dim:
// [sum(out), in], differentiable (x through all of them is one GEMM, ops::linear_group); with zero
// rows after them up to a multiple of `rows_multiple`.
Tensor cat_weights(const std::vector<torch::nn::Linear>& layers, int64_t rows_multiple = 1);
// Their biases the same way (zeros for a bias-free layer and the padding); undefined where none has one.
Tensor cat_biases(const std::vector<torch::nn::Linear>& layers, int64_t rows_multiple = 1);
// Inference packing of bias-free Linear layers that read the same input: their weights are
// concatenated along the output dim into one [sum(out), in] matrix, and each layer's weight
// becomes a view of its row block (same values, no second copy), so one GEMM (a single GEMV at
// decode) computes every output. Returns the packed weight.
Tensor pack_linears(const std::vector<torch::nn::Linear>& layers);
// The output blocks of at::linear(x, packed) in the order of `layers` (views along the last dim);
// columns of y beyond the layers' outputs (cat_weights' padding rows) are dropped.
std::vector<Tensor> unpack_outputs(const Tensor& y, const std::vector<torch::nn::Linear>& layers);
// y's last dim split into blocks of `widths` (views), the columns beyond their sum dropped: one split, so
// under autograd the blocks' gradients make one gradient of y (columns_gradient), where a narrow each
// would build a zero-filled gradient of y's whole size per block.
std::vector<Tensor> split_columns(const Tensor& y, std::vector<int64_t> widths);
// The gradient of y [..., width] from its blocks' (`widths` from column 0; an undefined gradient and the
// columns past the blocks are zeros). Where a block's gradient is its columns of a packed buffer shaped
// like y (a kernel that wrote several blocks' gradients into one buffer as wide as y), that buffer is the
// gradient, the other blocks copied into it; else one concatenation.
Tensor columns_gradient(const std::vector<Tensor>& grads, const std::vector<int64_t>& sizes,
                        const std::vector<int64_t>& widths);
// Whether a packed weight may be used now: defined, and no gradient being recorded (the packed
// tensor is not a parameter).
inline bool use_packed(const Tensor& packed) { return packed.defined() && !torch::GradMode::is_enabled(); }

}  // namespace lt2
