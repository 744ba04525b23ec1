#include "lt2/ops/fused_dsa.h"

#include <string>

#include "lt2/kernels/dsa_decode.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/fused_decode.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2::ops {

using namespace detail;

namespace {

// Why dsa_index_scores cannot take q and index_keys (empty when it can).
std::string index_problem(const Tensor& q, const Tensor& keys) {
  if (!q.defined() || !keys.defined()) return "q and index_keys must be defined";
  if (!q.is_cuda() || keys.device() != q.device())
    return cat("q and index_keys must be on one CUDA device, found ", q.device(), " and ", keys.device());
  if (!kernel_dtype_ok(q.scalar_type()) || keys.scalar_type() != q.scalar_type())
    return cat("q and index_keys must share a dtype of float32, bfloat16 or float16, found ", q.scalar_type(),
               " and ", keys.scalar_type());
  if (q.dim() != 3 || keys.dim() != 3 || keys.size(0) != q.size(0) || keys.size(2) != q.size(2))
    return cat("q must be [B, H_I, d_I] and index_keys [B, L, d_I], found ", q.sizes(), " and ", keys.sizes());
  if (!kernels::dsa_index_scores_supported(static_cast<int>(std::min<int64_t>(q.size(1), INT32_MAX)),
                                           static_cast<int>(std::min<int64_t>(q.size(2), INT32_MAX))))
    return cat(q.size(1), " heads of dim ", q.size(2), " (the kernels take 1..", kernels::kDsaIndexMaxHeads,
               " heads of dim 1..", kernels::kDsaIndexMaxHeadDim, ")");
  if (keys.size(1) < 1 || keys.size(1) > kernels::kDsaMaxLength || q.size(0) > 65535)
    return cat("cache length ", keys.size(1), " (1..", kernels::kDsaMaxLength, ") and batch ", q.size(0),
               " (at most 65535)");
  if (keys.stride(2) != 1) return "index_keys must be contiguous in its last dim";
  return "";
}

// seq_lens [B] int64 on `device`: throws naming `op` otherwise.
void check_lens(const char* op, const Tensor& seq_lens, int64_t B, torch::Device device) {
  LT2_CHECK(seq_lens.defined() && seq_lens.scalar_type() == torch::kInt64 &&
                seq_lens.sizes() == torch::IntArrayRef({B}) && seq_lens.device() == device,
            op, ": seq_lens must be [B] = [", B, "] int64 on ", device, ", found ", sizes_of(seq_lens), " ",
            seq_lens.defined() ? seq_lens.scalar_type() : torch::kInt64, " on ",
            seq_lens.defined() ? seq_lens.device() : device);
}

// `out` undefined, or [rows, cols] of dtype `dt`, contiguous, on `device`: throws naming `op` otherwise.
void check_out(const char* op, const Tensor& out, int64_t rows, int64_t cols, torch::ScalarType dt,
               torch::Device device) {
  LT2_CHECK(!out.defined() || (out.sizes() == torch::IntArrayRef({rows, cols}) && out.scalar_type() == dt &&
                               out.is_contiguous() && out.device() == device),
            op, ": out must be [", rows, ", ", cols, "] ", dt, " contiguous on ", device, ", found ",
            sizes_of(out), out.defined() ? cat(" ", out.scalar_type(), " on ", out.device()) : "");
}

#ifdef LT2_WITH_CUDA

// q with a contiguous last dim and 16-byte aligned rows (what the tensor-core form needs): no copy
// when it already has them, else a contiguous copy (q is one token: a few KiB).
Tensor with_aligned_rows(const Tensor& q) {
  const int64_t vec = 16 / q.element_size();
  const bool ok = q.stride(2) == 1 && q.stride(0) % vec == 0 && q.stride(1) % vec == 0 &&
                  reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0;
  return ok ? q : q.contiguous();
}
#endif

}  // namespace

bool dsa_index_topk_supported(const Tensor& q, const Tensor& index_keys, int64_t k) {
  return fused_decode_available() && index_problem(q, index_keys).empty() && k >= 1 && k <= index_keys.size(1);
}

Tensor dsa_index_scores(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& seq_lens,
                        const Tensor& out) {
  const char* op = "dsa_index_scores";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = index_problem(q, index_keys);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const int64_t B = q.size(0), H = q.size(1), L = index_keys.size(1);
  LT2_CHECK(w.defined() && w.sizes() == torch::IntArrayRef({B, H}) && w.is_floating_point() &&
                w.device() == q.device(),
            op, ": w must be [B, H_I] = [", B, ", ", H, "] floating point on ", q.device(), ", found ", sizes_of(w),
            w.defined() ? cat(" ", w.scalar_type(), " on ", w.device()) : "");
  check_lens(op, seq_lens, B, q.device());
  check_out(op, out, B, L, torch::kFloat32, q.device());
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  const auto qc = with_aligned_rows(q);
  const auto wc = w.to(torch::kFloat32).contiguous();
  const auto lens = seq_lens.contiguous();
  auto scores = out.defined() ? out : torch::empty({B, L}, q.options().dtype(torch::kFloat32));
  kernels::DsaIndexScoresParams p{};
  p.q = qc.data_ptr();
  p.q_batch_stride = qc.stride(0), p.q_head_stride = qc.stride(1);
  p.w = wc.data_ptr<float>();
  p.keys = index_keys.data_ptr();
  p.k_batch_stride = index_keys.stride(0), p.k_row_stride = index_keys.stride(1);
  p.seq_lens = lens.data_ptr<int64_t>();
  p.scores = scores.data_ptr<float>();
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(H), p.head_dim = static_cast<int>(q.size(2));
  p.max_len = static_cast<int>(L);
  p.dtype = kernel_dtype(q.scalar_type());
  kernels::dsa_index_scores(p, current_stream(q));
  return scores;
#else
  no_cuda(op);
#endif
}

Tensor topk_select(const Tensor& scores, int64_t k, const Tensor& seq_lens, const Tensor& out) {
  const char* op = "topk_select";
  if (!fused_decode_available()) no_cuda(op);
  LT2_CHECK(scores.defined() && scores.is_cuda() && scores.scalar_type() == torch::kFloat32 && scores.dim() == 2,
            op, ": scores must be a [B, L] float32 CUDA tensor, found ", sizes_of(scores),
            scores.defined() ? cat(" ", scores.scalar_type(), " on ", scores.device()) : "");
  const int64_t B = scores.size(0), L = scores.size(1);
  LT2_CHECK(L >= 1 && L <= kernels::kDsaMaxLength && B <= 65535 && k >= 1 && k <= L, op, ": k = ", k, " of ", L,
            " scores a row (1 <= k <= L <= ", kernels::kDsaMaxLength, "), batch ", B, " (at most 65535)");
  if (seq_lens.defined()) check_lens(op, seq_lens, B, scores.device());
  check_out(op, out, B, k, torch::kInt64, scores.device());
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(scores.device());
  const auto sc = scores.contiguous();
  const auto lens = seq_lens.defined() ? seq_lens.contiguous() : Tensor();
  auto indices = out.defined() ? out : torch::empty({B, k}, scores.options().dtype(torch::kInt64));
  kernels::TopkSelectParams p{};
  p.scores = sc.data_ptr<float>();
  p.seq_lens = lens.defined() ? lens.data_ptr<int64_t>() : nullptr;
  p.indices = indices.data_ptr<int64_t>();
  p.batch = static_cast<int>(B), p.length = static_cast<int>(L), p.k = static_cast<int>(k);
  kernels::topk_select(p, current_stream(scores));
  return indices;
#else
  no_cuda(op);
#endif
}

Tensor dsa_index_topk(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& seq_lens,
                      int64_t k) {
  const char* op = "dsa_index_topk";
  LT2_CHECK(index_keys.defined() && index_keys.dim() == 3 && k >= 1 && k <= index_keys.size(1), op, ": k = ", k,
            " must be in [1, L] for index_keys ", sizes_of(index_keys));
  return topk_select(dsa_index_scores(q, w, index_keys, seq_lens), k, seq_lens);
}

}  // namespace lt2::ops
