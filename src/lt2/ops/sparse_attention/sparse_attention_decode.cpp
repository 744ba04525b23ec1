#include "lt2/ops/sparse_attention/sparse_attention_decode.h"

#include <limits>
#include <string>

#include "lt2/kernels/sparse_attention_decode.h"
#include "lt2/nn/linear.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2::ops {

using namespace detail;

namespace {

// Why q and the caches do not fit together (empty when they do); any device.
std::string cache_problem(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!q.defined() || !k.defined() || !v.defined()) return "q, k_cache and v_cache must be defined";
  if (q.dim() != 3 || k.dim() != 4 || v.dim() != 4 || k.size(0) != q.size(0) || v.size(0) != q.size(0) ||
      v.size(1) != k.size(1) || v.size(2) != k.size(2) || k.size(3) != q.size(2))
    return cat("q must be [B, Hq, Dk], k_cache [B, Hkv, L, Dk] and v_cache [B, Hkv, L, Dv], found q ",
               q.sizes(), ", k_cache ", k.sizes(), ", v_cache ", v.sizes());
  if (k.size(1) < 1 || q.size(1) % k.size(1) != 0)
    return cat(q.size(1), " query heads are not a multiple of ", k.size(1), " kv heads");
  if (k.size(2) < 1) return "the caches hold no rows";
  if (!q.is_floating_point() || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    return cat("q and the caches must have one floating dtype, found ", q.scalar_type(), ", ",
               k.scalar_type(), ", ", v.scalar_type());
  if (k.device() != q.device() || v.device() != q.device())
    return cat("the caches must be on q's device ", q.device(), ", found ", k.device(), " and ", v.device());
  return "";
}

// Why indices and counts do not fit q (empty when they do).
std::string selection_problem(const Tensor& q, const Tensor& indices, const Tensor& counts) {
  const int64_t B = q.size(0);
  if (!indices.defined() || indices.scalar_type() != torch::kInt64 || indices.dim() != 2 ||
      indices.size(0) != B || indices.size(1) < 1)
    return cat("indices must be [B, n] = [", B, ", n >= 1] int64, found ", sizes_of(indices), " ",
               indices.defined() ? indices.scalar_type() : torch::kInt64);
  if (!counts.defined() || counts.scalar_type() != torch::kInt64 || counts.sizes() != torch::IntArrayRef({B}))
    return cat("counts must be [B] = [", B, "] int64, found ", sizes_of(counts), " ",
               counts.defined() ? counts.scalar_type() : torch::kInt64);
  if (indices.device() != q.device() || counts.device() != q.device())
    return cat("indices and counts must be on q's device ", q.device(), ", found ", indices.device(), " and ",
               counts.device());
  return "";
}

// Why the kernel cannot take q and the caches (empty when it can).
std::string kernel_problem(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (auto problem = cache_problem(q, k, v); !problem.empty()) return problem;
  if (!q.is_cuda()) return cat("the tensors are on ", q.device(), ", not CUDA");
  const auto dt = q.scalar_type();
  if (dt != torch::kFloat32 && dt != torch::kBFloat16 && dt != torch::kFloat16)
    return cat("the tensors are ", dt, " (the kernel takes float32, bfloat16, float16)");
  const int64_t Hq = q.size(1), Hkv = k.size(1), Dk = q.size(2), Dv = v.size(3);
  if (!kernels::sparse_attention_decode_supported(static_cast<int>(Dk), static_cast<int>(Dv),
                                                  static_cast<int>(Hq / Hkv)))
    return cat("head dims (", Dk, ", ", Dv, ") with ", Hq, " query heads over ", Hkv,
               " kv heads have no kernel (head dims (64, 64), (128, 128), (256, 256) or (576, 512); at most ",
               kernels::kSparseAttentionMaxGroups, " query heads per kv head)");
  if (k.size(2) > std::numeric_limits<int>::max()) return cat("cache length ", k.size(2), " out of range");
  if (!rows_aligned(k) || !rows_aligned(v)) return "cache rows must be contiguous and 16-byte aligned";
  return "";
}

// Why absorb and gate do not fit q and v (empty when they do); any device.
std::string absorb_shape_problem(const Tensor& q, const Tensor& v, const Tensor& absorb, const Tensor& gate) {
  const int64_t B = q.size(0), Hq = q.size(1), Dv = v.size(3);
  if (absorb.dim() != 3 || absorb.size(0) != Hq || absorb.size(2) != Dv)
    return cat("absorb must be [Hq, Dy, Dv] = [", Hq, ", Dy, ", Dv, "], found ", absorb.sizes());
  if (gate.defined() && (gate.sizes() != torch::IntArrayRef({B, Hq, absorb.size(1)}) || gate.stride(-1) != 1))
    return cat("gate must be [B, Hq, Dy] = [", B, ", ", Hq, ", ", absorb.size(1), "] with a contiguous last dim, found ",
               gate.sizes());
  for (const Tensor* t : {&absorb, &gate})
    if (t->defined() && (t->scalar_type() != q.scalar_type() || t->device() != q.device()))
      return cat("absorb and gate must be ", q.scalar_type(), " on ", q.device(), " like q, found ", t->scalar_type(),
                 " on ", t->device());
  return "";
}

// Why the combine cannot fold absorb and gate in (empty when it can).
std::string absorb_problem(const Tensor& q, const Tensor& v, const Tensor& absorb, const Tensor& gate) {
  if (auto problem = absorb_shape_problem(q, v, absorb, gate); !problem.empty()) return problem;
  if (!contiguous_aligned(absorb))
    return "absorb must be contiguous and 16-byte aligned";
  const int64_t B = q.size(0), Dv = v.size(3), Dy = absorb.size(1);
  if (!kernels::sparse_attention_absorb_supported(static_cast<int>(std::min<int64_t>(B, INT32_MAX)),
                                                  static_cast<int>(Dv), static_cast<int>(std::min<int64_t>(Dy, INT32_MAX))))
    return cat("batch ", B, ", Dv ", Dv, ", Dy ", Dy, ": the folded absorption takes 1..", kernels::kSparseAbsorbMaxRows,
               " sequences, Dv a multiple of 64 up to 512 and 1..", kernels::kSparseAbsorbMaxDim, " output dims");
  return "";
}

}  // namespace

bool sparse_attention_absorb_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                       const Tensor& absorb, const Tensor& gate) {
  return sparse_attention_decode_supported(q, k_cache, v_cache) && absorb.defined() &&
         absorb_problem(q, v_cache, absorb, gate).empty();
}

bool sparse_attention_decode_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  return fused_decode_available() && kernel_problem(q, k_cache, v_cache).empty();
}

Tensor sparse_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& indices, const Tensor& counts, double scale, const Tensor& absorb,
                               const Tensor& gate) {
  if (fused_decode_enabled() && !torch::GradMode::is_enabled() &&
      (absorb.defined() ? sparse_attention_absorb_supported(q, k_cache, v_cache, absorb, gate)
                        : sparse_attention_decode_supported(q, k_cache, v_cache)))
    return sparse_attention_decode_fused(q, k_cache, v_cache, indices, counts, scale, absorb, gate);
  return sparse_attention_decode_reference(q, k_cache.to(q.scalar_type()), v_cache.to(q.scalar_type()), indices,
                                           counts, scale, absorb, gate);
}

Tensor sparse_attention_decode_fused(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                     const Tensor& indices, const Tensor& counts, double scale, const Tensor& absorb,
                                     const Tensor& gate) {
  const char* op = "sparse_attention_decode_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = kernel_problem(q, k_cache, v_cache);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const auto selection = selection_problem(q, indices, counts);
  LT2_CHECK(selection.empty(), op, ": ", selection);
  LT2_CHECK(absorb.defined() || !gate.defined(), op, ": a gate needs absorb");
  const bool absorbing = absorb.defined();
  if (absorbing) {
    const auto folding = absorb_problem(q, v_cache, absorb, gate);
    LT2_CHECK(folding.empty(), op, ": ", folding);
  }
  LT2_CHECK(indices.size(1) <= std::numeric_limits<int>::max(), op, ": ", indices.size(1),
            " indices per sequence out of range");
#ifdef LT2_WITH_CUDA
  const int64_t B = q.size(0), Hq = q.size(1), Dk = q.size(2), Hkv = k_cache.size(1), L = k_cache.size(2);
  const int64_t Dv = v_cache.size(3), n = indices.size(1);
  c10::cuda::CUDAGuard guard(q.device());
  const auto qc = with_aligned_rows(q);
  const auto idx = indices.contiguous(), cnt = counts.contiguous();
  const int splits = kernels::sparse_attention_decode_num_splits(
      static_cast<int>(B), static_cast<int>(Hkv), static_cast<int>(Hq / Hkv), static_cast<int>(n),
      q.device().index());
  auto out = torch::empty({B, Hq, absorbing ? absorb.size(1) : Dv},  // y or o
                          q.options().memory_format(torch::MemoryFormat::Contiguous));
  // The folded absorption reads the partials even of one split.
  const SplitWorkspace partial(B, Hq, splits, Dv, q.options(), splits > 1 || absorbing);
  kernels::SparseAttentionDecodeParams p{};
  p.q = qc.data_ptr();
  p.q_batch_stride = qc.stride(0), p.q_head_stride = qc.stride(1);
  p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_head_stride = k_cache.stride(1), p.k_row_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_head_stride = v_cache.stride(1), p.v_row_stride = v_cache.stride(2);
  p.indices = idx.data_ptr<int64_t>();
  p.counts = cnt.data_ptr<int64_t>();
  if (absorbing) {
    p.absorb_w = absorb.data_ptr(), p.y = out.data_ptr(), p.absorb_dim = static_cast<int>(absorb.size(1));
    if (gate.defined()) p.gate = gate.data_ptr(), p.gate_batch_stride = gate.stride(0), p.gate_head_stride = gate.stride(1);
  } else {
    p.out = out.data_ptr();
  }
  p.partial_out = partial.out_ptr(), p.partial_lse = partial.lse_ptr();
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.head_dim_k = Dk, p.head_dim_v = Dv;
  p.max_len = L, p.n = n, p.num_splits = splits;
  p.scale = static_cast<float>(scale);
  p.dtype = kernel_dtype(q.scalar_type());
  p.pdl = decode_options().pdl_for("sparse_attention_decode");
  kernels::sparse_attention_decode(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return out;
#else
  no_cuda(op);
#endif
}

Tensor sparse_attention_decode_reference(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                         const Tensor& indices, const Tensor& counts, double scale,
                                         const Tensor& absorb, const Tensor& gate) {
  for (const auto& problem : {cache_problem(q, k_cache, v_cache), selection_problem(q, indices, counts)})
    LT2_CHECK(problem.empty(), "sparse_attention_decode_reference: ", problem);
  LT2_CHECK(absorb.defined() || !gate.defined(), "sparse_attention_decode_reference: a gate needs absorb");
  if (absorb.defined()) {
    const auto problem = absorb_shape_problem(q, v_cache, absorb, gate);
    LT2_CHECK(problem.empty(), "sparse_attention_decode_reference: ", problem);
  }
  const int64_t B = q.size(0), Hq = q.size(1), Dk = q.size(2), Hkv = k_cache.size(1), L = k_cache.size(2);
  const int64_t Dv = v_cache.size(3), n = indices.size(1);
  auto used = torch::arange(n, indices.options()).unsqueeze(0) < counts.unsqueeze(1);  // [B, n]
  // Unused entries gather entry 0 (always used) instead of whatever they hold; masked below.
  auto idx = torch::where(used, indices, indices.narrow(1, 0, 1)).clamp(0, L - 1);  // [B, n]
  auto gather = [&](const Tensor& cache) {  // [B, Hkv, L, D] -> [B, Hkv, n, D] in fp32 / float64
    return cache.gather(2, idx.view({B, 1, n, 1}).expand({B, Hkv, n, cache.size(3)})).to(accum_dtype(q));
  };
  auto qg = q.reshape({B, Hkv, Hq / Hkv, Dk}).to(accum_dtype(q));  // the G query heads of each kv head
  auto scores = torch::matmul(qg, gather(k_cache).transpose(2, 3)) * scale;  // [B, Hkv, G, n]
  scores = scores.masked_fill(~used.view({B, 1, 1, n}), -std::numeric_limits<double>::infinity());
  auto out = torch::matmul(torch::softmax(scores, -1), gather(v_cache)).reshape({B, Hq, Dv});
  if (absorb.defined()) {
    out = torch::einsum("bhc,hjc->bhj", {out, absorb.to(accum_dtype(q))});  // [B, Hq, Dy]
    if (gate.defined()) out = out * torch::sigmoid(gate.to(accum_dtype(q)));
  }
  return out.to(q.scalar_type());
}

}  // namespace lt2::ops
