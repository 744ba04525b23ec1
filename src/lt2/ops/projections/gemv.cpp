#include "lt2/ops/projections/gemv.h"

#include <string>

#include "lt2/kernels/decode.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace lt2::ops {

using namespace detail;

namespace {

// Why gemv_fused cannot take an x of these sizes, with x_like's dtype and device, and these
// tensors (empty when it can).
std::string gemv_problem(torch::IntArrayRef x_sizes, const Tensor& x_like, const Tensor& w, const GemvFusion& f) {
  for (const auto& p : {activation_problem(x_like, "x"), activation_problem(w, "w")})
    if (!p.empty()) return p;
  if (w.dim() != 2 || !contiguous_aligned(w))
    return cat("w must be a contiguous, 16-byte aligned [N, K], found ", w.sizes());
  const int64_t K = w.size(1), N = w.size(0), x_dim = f.silu_mul ? 2 * K : K;
  if (x_sizes.empty() || x_sizes.back() != x_dim)
    return cat("x must be [..., ", x_dim, "] for w ", w.sizes(), f.silu_mul ? " with silu_mul" : "", ", found ", x_sizes);
  if ((f.silu_mul ? 1 : 0) + (f.norm_weight.defined() ? 1 : 0) + (f.x_gate.defined() ? 1 : 0) > 1)
    return "silu_mul, the RMSNorm prologue and x_gate do not combine";
  if (f.k_splits < 0 || f.k_splits > kernels::kGemvMaxKSplits)
    return cat("k_splits must be 0 (pick) or 1..", kernels::kGemvMaxKSplits, ", found ", f.k_splits);
  std::vector<const Tensor*> all{&w};
  if (f.norm_weight.defined()) {
    if (f.norm_weight.dim() != 1 || f.norm_weight.size(0) != K || !f.norm_weight.is_contiguous())
      return cat("norm_weight must be a contiguous [", K, "], found ", f.norm_weight.sizes());
    all.push_back(&f.norm_weight);
  }
  if (f.x_gate.defined()) {
    if (f.x_gate.sizes() != x_sizes || f.x_gate.stride(-1) != 1)
      return cat("x_gate must be ", x_sizes, " like x with a contiguous last dim, found ", f.x_gate.sizes());
    all.push_back(&f.x_gate);
  }
  if (f.residual.defined()) {
    auto sizes = x_sizes.vec();
    sizes.back() = N;
    if (f.residual.sizes() != torch::IntArrayRef(sizes) || f.residual.stride(-1) != 1)
      return cat("residual must be ", torch::IntArrayRef(sizes), " with a contiguous last dim, found ",
                 f.residual.sizes());
    all.push_back(&f.residual);
  }
  for (const Tensor* t : all)
    if (t->scalar_type() != x_like.scalar_type() || t->device() != x_like.device())
      return cat("every tensor must be ", x_like.scalar_type(), " on ", x_like.device(), " like x");
#ifdef LT2_WITH_CUDA
  const int64_t rows = c10::multiply_integers(x_sizes) / x_dim;
  if (!kernels::gemv_supported(rows, K, kernel_dtype(x_like.scalar_type())))
    return cat(rows, " rows of K = ", K, ": the GEMV takes 1..", kernels::kGemvMaxRows,
               " rows and K a whole number of 16-byte vectors");
#endif
  return "";
}
std::string gemv_problem(const Tensor& x, const Tensor& w, const GemvFusion& f) {
  return x.defined() ? gemv_problem(x.sizes(), x, w, f) : "x is undefined";
}

#ifdef LT2_WITH_CUDA
// f.x_gate as the kernels read it: [M, K] with 16-byte aligned rows (a copy where they are not),
// or undefined.
Tensor aligned_x_gate(const GemvFusion& f, int64_t K) {
  return f.x_gate.defined() ? with_aligned_rows(f.x_gate.reshape({-1, K})) : Tensor();
}

// The kernel parameters of y = f(x) W^T for x2 [M, K or 2K] with aligned rows, the gate g2 of
// aligned_x_gate (kept alive by the caller until the launch) and y [M, N] (or [M, N / 2]: the
// chain's SiLU·mul epilogue).
kernels::GemvParams gemv_params(const Tensor& x2, const Tensor& w, const GemvFusion& f, const Tensor& g2,
                                const Tensor& y) {
  const int64_t K = w.size(1), N = w.size(0);
  const auto r2 = f.residual.defined() ? f.residual.reshape({-1, N}) : Tensor();
  kernels::GemvParams p{};
  p.x = x2.data_ptr(), p.x_row_stride = x2.stride(0);
  p.w = w.data_ptr();
  p.y = y.data_ptr(), p.y_row_stride = y.size(-1);  // N, or N / 2 with the chain's SiLU·mul epilogue
  p.residual = r2.defined() ? r2.data_ptr() : nullptr;
  p.residual_row_stride = r2.defined() ? r2.stride(0) : 0;
  p.norm_weight = f.norm_weight.defined() ? f.norm_weight.data_ptr() : nullptr;
  p.norm_eps = static_cast<float>(f.norm_eps);
  p.x_gate = g2.defined() ? g2.data_ptr() : nullptr;
  p.x_gate_row_stride = g2.defined() ? g2.stride(0) : 0;
  p.prologue = f.norm_weight.defined() ? kernels::GemvPrologue::RmsNorm
               : f.silu_mul            ? kernels::GemvPrologue::SiluMul
               : f.x_gate.defined()    ? kernels::GemvPrologue::SigmoidGate
                                       : kernels::GemvPrologue::None;
  p.rows = x2.size(0), p.n = N, p.k = static_cast<int>(K);
  p.dtype = kernel_dtype(x2.scalar_type());
  p.k_splits = f.k_splits;
  return p;
}
#endif

}  // namespace

bool gemv_fused_applies(const Tensor& x, const Tensor& w, const GemvFusion& fusion) {
  return decode_options().fused_gemv && fused_elementwise_applies({x, w}) && gemv_problem(x, w, fusion).empty();
}

namespace {

// Whether gemv_fused runs y = f(x) W^T as a one-product gemv_chain: persistent blocks streaming W
// by TMA have no ragged last wave of row blocks. Measured on an H200 at the 1.3B shapes (1 / 8
// rows, chain kernel vs the GEMV kernel; bench/results/gemv_chain_h200.txt): 9248 x 2048
// 13.9 / 13.5 vs 14.5 / 15.1 us, 2048 x 3072 6.1 / 8.1 vs 7.8 / 8.4; but the LM head (525 MB)
// 125 vs 124 and w2 with its SiLU·mul prologue at 8 rows 12.6 vs 11.3 (every block stages all
// of x), so not those. (11264 x 2048 alone is 16.3 vs 15.2 at 1 row but 15.8 vs 16.6 at 8; the
// blocks of the 1.3B presets chain it with its neighbours anyway.)
constexpr double kChainedProductMaxBytes = 128e6;
bool runs_as_chain(const Tensor& w, const GemvFusion& f) {
  return !f.silu_mul && f.k_splits == 0 &&
         static_cast<double>(w.numel()) * w.element_size() <= kChainedProductMaxBytes;
}

}  // namespace

Tensor gemv_fused(const Tensor& x, const Tensor& w, const GemvFusion& f) {
  const char* op = "gemv_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = gemv_problem(x, w, f);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  if (runs_as_chain(w, f)) {
    ChainProduct product{w};
    product.fusion = f;
    if (auto out = gemv_chain_fused(x, {product}); !out.empty()) return out[0];
  }
#ifdef LT2_WITH_CUDA
  const int64_t K = w.size(1), N = w.size(0), x_dim = f.silu_mul ? 2 * K : K;
  c10::cuda::CUDAGuard guard(x.device());
  // Rows 16-byte aligned: the kernels read x (and b = x[:, K:]) with 16-byte loads.
  const auto x2 = with_aligned_rows(x.reshape({-1, x_dim}));  // [M, x_dim]
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options().memory_format(torch::MemoryFormat::Contiguous));
  const auto g2 = aligned_x_gate(f, K);
  auto p = gemv_params(x2, w, f, g2, y);
  p.pdl = decode_options().pdl_for("gemv");
  kernels::gemv(p, current_stream(x));
  return y;
#else
  no_cuda(op);
#endif
}

namespace {

// Why gemv_chain_fused cannot take the chain (empty when it can); out_sizes gets each product's
// output sizes.
std::string gemv_chain_problem(const Tensor& x, const std::vector<ChainProduct>& products,
                               std::vector<std::vector<int64_t>>& out_sizes) {
  if (!x.defined()) return "x is undefined";
  if (products.empty() || products.size() > static_cast<size_t>(kernels::kGemvChainMaxProducts))
    return cat("1..", kernels::kGemvChainMaxProducts, " products, found ", products.size());
  std::vector<int64_t> x_sizes = x.sizes().vec();
  for (size_t i = 0; i < products.size(); ++i) {
    const auto& pr = products[i];
    GemvFusion f = pr.fusion;
    const bool earlier = pr.residual_of >= 0;
    if (earlier) {
      if (static_cast<size_t>(pr.residual_of) >= i || f.residual.defined())
        return cat("product ", i, ": residual_of ", pr.residual_of, " must name an earlier product (and no residual tensor)");
      f.residual = Tensor();
    }
    if (auto p = gemv_problem(x_sizes, x, pr.w, f); !p.empty()) return cat("product ", i, ": ", p);
    if (f.k_splits != 0) return cat("product ", i, ": a chain does not split K");
    if (pr.silu_mul_out && (pr.w.size(0) % 2 != 0 || f.residual.defined() || earlier))
      return cat("product ", i, ": the SiLU·mul epilogue needs W's two halves (N even, found ", pr.w.size(0),
                 ") and no residual");
    x_sizes.back() = pr.silu_mul_out ? pr.w.size(0) / 2 : pr.w.size(0);  // this product's output, the next one's x
    if (earlier && out_sizes[pr.residual_of] != x_sizes)
      return cat("product ", i, ": its output ", torch::IntArrayRef(x_sizes), " and product ", pr.residual_of,
                 "'s (its residual) ", torch::IntArrayRef(out_sizes[pr.residual_of]), " differ");
    out_sizes.push_back(x_sizes);
  }
  return "";
}

}  // namespace

std::vector<Tensor> gemv_chain_fused(const Tensor& x, const std::vector<ChainProduct>& products) {
  std::vector<std::vector<int64_t>> out_sizes;
  if (!decode_options().gemv_chain || !fused_elementwise_applies({x}) || !gemv_chain_problem(x, products, out_sizes).empty())
    return {};
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  kernels::GemvChainParams params;
  params.products = static_cast<int>(products.size());
  std::vector<Tensor> outputs, gates;  // gates: aligned x_gates, alive until the launch
  Tensor input = with_aligned_rows(x.reshape({-1, x.size(-1)}));
  for (size_t i = 0; i < products.size(); ++i) {
    const auto& pr = products[i];
    GemvFusion f = pr.fusion;
    if (pr.residual_of >= 0) f.residual = outputs[pr.residual_of];
    outputs.push_back(torch::empty(out_sizes[i], x.options().memory_format(torch::MemoryFormat::Contiguous)));
    gates.push_back(aligned_x_gate(f, pr.w.size(1)));
    params.product[i] = gemv_params(input, pr.w, f, gates.back(), outputs.back());
    params.product[i].silu_mul_out = pr.silu_mul_out;
    input = outputs.back().view({-1, out_sizes[i].back()});
  }
  params.max_slots = decode_options().gemv_chain_slots;
  params.pdl = decode_options().pdl_for("gemv_chain");
  if (!kernels::gemv_chain_problem(params, x.get_device()).empty()) return {};
  kernels::gemv_chain(params, current_stream(x));
  return outputs;
#else
  return {};
#endif
}

namespace {

// Why gemv_batched cannot take x, W and gate (empty when it can); x's layout does not matter.
std::string gemv_batched_problem(const Tensor& x, const Tensor& w, const Tensor& gate) {
  for (const auto& p : {activation_problem(x, "x"), activation_problem(w, "w")})
    if (!p.empty()) return p;
  if (w.dim() != 3 || !contiguous_aligned(w))
    return cat("w must be a contiguous, 16-byte aligned [J, N, K], found ", w.sizes());
  const int64_t J = w.size(0), N = w.size(1), K = w.size(2);
  if (x.dim() != 3 || x.size(1) != J || x.size(2) != K)
    return cat("x must be [M, ", J, ", ", K, "] for w ", w.sizes(), ", found ", x.sizes());
  if (gate.defined() && (gate.sizes() != torch::IntArrayRef({x.size(0), J, N}) || gate.stride(-1) != 1))
    return cat("gate must be [", x.size(0), ", ", J, ", ", N, "] with a contiguous last dim, found ", gate.sizes());
  for (const Tensor* t : {&w, &gate})
    if (t->defined() && (t->scalar_type() != x.scalar_type() || t->device() != x.device()))
      return cat("w and gate must be ", x.scalar_type(), " on ", x.device(), " like x");
  if (J > 65535) return cat(J, " products (at most 65535)");
#ifdef LT2_WITH_CUDA
  if (!kernels::gemv_supported(x.size(0), K, kernel_dtype(x.scalar_type())))
    return cat(x.size(0), " rows of K = ", K, ": the GEMV takes 1..", kernels::kGemvMaxRows,
               " rows and K a whole number of 16-byte vectors");
#endif
  return "";
}

}  // namespace

bool gemv_batched_applies(const Tensor& x, const Tensor& w, const Tensor& gate) {
  return fused_elementwise_applies({x, w}) && gemv_batched_problem(x, w, gate).empty();
}

void gemv_batched(const Tensor& x, const Tensor& w, const Tensor& out, const Tensor& gate) {
  const char* op = "gemv_batched";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = gemv_batched_problem(x, w, gate);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  [[maybe_unused]] const int64_t M = x.size(0), J = w.size(0), N = w.size(1), K = w.size(2);
  LT2_CHECK(out.defined() && out.sizes() == torch::IntArrayRef({M, J, N}) && out.stride(-1) == 1 &&
                out.scalar_type() == x.scalar_type() && out.device() == x.device(),
            op, ": out must be [", M, ", ", J, ", ", N, "] ", x.scalar_type(), " on ", x.device(),
            " with a contiguous last dim, found ", sizes_of(out));
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  const auto xc = with_aligned_rows(x);  // the kernels read x with 16-byte loads
  kernels::GemvParams p{};
  p.x = xc.data_ptr(), p.x_row_stride = xc.stride(0), p.x_batch_stride = xc.stride(1);
  p.w = w.data_ptr(), p.w_batch_stride = N * K;
  p.y = out.data_ptr(), p.y_row_stride = out.stride(0), p.y_batch_stride = out.stride(1);
  if (gate.defined())
    p.y_gate = gate.data_ptr(), p.y_gate_row_stride = gate.stride(0), p.y_gate_batch_stride = gate.stride(1);
  p.prologue = kernels::GemvPrologue::None;
  p.rows = M, p.n = N, p.k = static_cast<int>(K), p.batch = J;
  p.dtype = kernel_dtype(x.scalar_type());
  p.pdl = decode_options().pdl_for("gemv");
  kernels::gemv(p, current_stream(x));
#endif
}

}  // namespace lt2::ops
