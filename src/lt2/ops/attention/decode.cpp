#include "lt2/ops/attention/decode.h"

#include <ATen/ATen.h>

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

std::string attention_problem(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  for (const auto& p : {activation_problem(q, "q"), activation_problem(k_cache, "k_cache"),
                        activation_problem(v_cache, "v_cache")})
    if (!p.empty()) return p;
  if (k_cache.scalar_type() != q.scalar_type() || v_cache.scalar_type() != q.scalar_type())
    return cat("the caches must have q's dtype ", q.scalar_type(), ", found ", k_cache.scalar_type(),
               " and ", v_cache.scalar_type());
  if (q.dim() != 3 || k_cache.dim() != 4 || v_cache.sizes() != k_cache.sizes() ||
      k_cache.size(0) != q.size(0) || k_cache.size(3) != q.size(2))
    return cat("q must be [B, Hq, D] and the caches [B, Hkv, L, D], found q ", q.sizes(), ", k ",
               k_cache.sizes(), ", v ", v_cache.sizes());
  const int64_t Hq = q.size(1), Hkv = k_cache.size(1), D = q.size(2);
  if (!kernels::attention_decode_head_dim_supported(static_cast<int>(D)))
    return cat("head dim ", D, " has no kernel (64, 128, 256)");
  if (Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > kernels::kAttentionMaxGroups)
    return cat(Hq, " query heads over ", Hkv, " kv heads (a multiple, at most ",
               kernels::kAttentionMaxGroups, " per kv head)");
  if (q.device() != k_cache.device() || q.device() != v_cache.device())
    return "q and the caches must be on one device";
  if (!rows_aligned(k_cache) || !rows_aligned(v_cache)) return "cache rows must be contiguous and 16-byte aligned";
  return "";
}

std::string rope_cache_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                               const Tensor& v_cache, const Tensor& seq_pos) {
  for (const auto& p : {activation_problem(q, "q"), activation_problem(k, "k"), activation_problem(v, "v"),
                        activation_problem(k_cache, "k_cache"), activation_problem(v_cache, "v_cache")})
    if (!p.empty()) return p;
  if (q.dim() != 3 || k.dim() != 3 || k_cache.dim() != 4 || v.sizes() != k.sizes() ||
      v_cache.sizes() != k_cache.sizes() || k.size(0) != q.size(0) || k.size(2) != q.size(2) ||
      k_cache.size(0) != q.size(0) || k_cache.size(1) != k.size(1) || k_cache.size(3) != q.size(2))
    return cat("q must be [B, H, D], k and v [B, H_kv, D], the caches [B, H_kv, L, D], found q ", q.sizes(), ", k ",
               k.sizes(), ", v ", v.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  for (const Tensor* t : {&k, &v, &k_cache, &v_cache})
    if (t->scalar_type() != q.scalar_type() || t->device() != q.device())
      return cat("every tensor must be ", q.scalar_type(), " on ", q.device(), " like q");
  for (const Tensor* t : {&q, &k, &v})  // heads of one row D apart: views of a projection's rows
    if (t->stride(2) != 1 || t->stride(1) != t->size(2))
      return "q, k and v must have contiguous [H, D] rows (views of [B, H * D] rows)";
  if (k_cache.stride(3) != 1 || v_cache.stride(3) != 1) return "the caches' last dim must be contiguous";
  if (!seq_pos.defined() || seq_pos.scalar_type() != torch::kInt64 || seq_pos.dim() != 1 ||
      seq_pos.size(0) != q.size(0) || seq_pos.device() != q.device())
    return cat("seq_pos must be [B] = [", q.size(0), "] int64 on ", q.device());
#ifdef LT2_WITH_CUDA
  if (!kernels::rope_cache_write_supported(static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
                                           static_cast<int>(k.size(1)), static_cast<int>(q.size(2))))
    return cat("head dim ", q.size(2), " (even, at most ", kernels::kRopeCacheMaxHeadDim, ") or batch / heads ",
               q.sizes(), " out of range");
#endif
  return "";
}

}  // namespace

Tensor attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& seq_lens,
                        double scale) {
  if (fused_decode_enabled() && attention_decode_supported(q, k_cache, v_cache))
    return attention_decode_fused(q.contiguous(), k_cache, v_cache, seq_lens, scale);
  return attention_decode_reference(q, k_cache, v_cache, seq_lens, scale);
}

Tensor attention_decode_reference(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                  const Tensor& seq_lens, double scale) {
  // The G = Hq / Hkv query heads of a kv head go in as G queries of that head, so no key is repeated.
  const int64_t B = q.size(0), H = q.size(1), Hkv = k_cache.size(1), L = k_cache.size(2);
  auto j = torch::arange(L, seq_lens.options());
  auto mask = (j.unsqueeze(0) < seq_lens.unsqueeze(1)).view({B, 1, 1, L});  // [B, 1, 1, L]
  auto o = at::scaled_dot_product_attention(q.reshape({B, Hkv, H / Hkv, q.size(2)}), k_cache.to(q.scalar_type()),
                                            v_cache.to(q.scalar_type()), mask, 0.0, false, scale);  // [B, Hkv, G, Dv]
  return o.reshape({B, H, v_cache.size(3)});
}

bool attention_decode_supported(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  return fused_decode_available() && attention_problem(q, k_cache, v_cache).empty();
}

Tensor attention_decode_fused(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& seq_lens, double scale) {
  const char* op = "attention_decode_fused";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = attention_problem(q, k_cache, v_cache);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  [[maybe_unused]] const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), L = k_cache.size(2);
  LT2_CHECK(seq_lens.defined() && seq_lens.scalar_type() == torch::kInt64 &&
                seq_lens.sizes() == torch::IntArrayRef({B}) && seq_lens.device() == q.device(),
            op, ": seq_lens must be [B] = [", B, "] int64 on ", q.device(), ", found ",
            seq_lens.defined() ? seq_lens.sizes() : torch::IntArrayRef{}, " ",
            seq_lens.defined() ? seq_lens.scalar_type() : torch::kInt64);
  LT2_CHECK(L >= 1 && L <= INT32_MAX, op, ": cache length ", L, " out of range");
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  const auto qc = q.stride(2) == 1 ? q : q.contiguous();
  const auto lens = seq_lens.contiguous();
  const int splits = kernels::attention_decode_num_splits(static_cast<int>(B), static_cast<int>(Hkv),
                                                          static_cast<int>(L), q.device().index());
  auto out = torch::empty({B, Hq, D}, q.options());
  const SplitWorkspace partial(B, Hq, splits, D, q.options(), splits > 1);
  kernels::AttentionDecodeParams p{};
  p.q = qc.data_ptr();
  p.q_batch_stride = qc.stride(0), p.q_head_stride = qc.stride(1);
  p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_head_stride = k_cache.stride(1), p.k_row_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_head_stride = v_cache.stride(1), p.v_row_stride = v_cache.stride(2);
  p.seq_lens = lens.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.partial_out = partial.out_ptr(), p.partial_lse = partial.lse_ptr();
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.head_dim = D, p.max_len = L, p.num_splits = splits;
  p.scale = static_cast<float>(scale);
  p.dtype = kernel_dtype(q.scalar_type());
  p.pdl = decode_options().pdl_for("attention_decode");
  kernels::attention_decode(p, current_stream(q));
  return out;
#else
  no_cuda(op);
#endif
}

bool rope_cache_write_supported(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& seq_pos) {
  return fused_decode_available() && rope_cache_problem(q, k, v, k_cache, v_cache, seq_pos).empty();
}

Tensor rope_cache_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& seq_pos, double theta, bool interleaved) {
  const char* op = "rope_cache_write";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = rope_cache_problem(q, k, v, k_cache, v_cache, seq_pos);
  LT2_CHECK(problem.empty(), op, ": ", problem);
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  auto q_out = torch::empty(q.sizes(), q.options().memory_format(torch::MemoryFormat::Contiguous));
  const auto pos = seq_pos.contiguous();
  kernels::RopeCacheParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.q_in_stride = q.stride(0), p.k_in_stride = k.stride(0), p.v_in_stride = v.stride(0);
  p.q_out = q_out.data_ptr();
  p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_head_stride = k_cache.stride(1), p.k_row_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_head_stride = v_cache.stride(1), p.v_row_stride = v_cache.stride(2);
  p.positions = pos.data_ptr<int64_t>();
  p.batch = static_cast<int>(q.size(0)), p.heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1)), p.head_dim = static_cast<int>(q.size(2));
  p.max_len = k_cache.size(2);
  p.theta = theta, p.interleaved = interleaved;
  p.dtype = kernel_dtype(q.scalar_type());
  p.pdl = decode_options().pdl_for("rope_cache_write");
  kernels::rope_cache_write(p, current_stream(q));
  return q_out;
#else
  no_cuda(op);
#endif
}

Tensor rope_cache_attention_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& seq_pos, const Tensor& seq_lens,
                                  double theta, bool interleaved, double scale) {
  if (!rope_cache_attention_applies(q, k, v, k_cache, v_cache, seq_pos)) return {};
  const auto q_rot = rope_cache_write(q, k, v, k_cache, v_cache, seq_pos, theta, interleaved);  // [B, H, D]
  return attention_decode_fused(q_rot, k_cache, v_cache, seq_lens, scale);
}

bool rope_cache_attention_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& seq_pos) {
  return fused_decode_enabled() && !torch::GradMode::is_enabled() &&
         rope_cache_write_supported(q, k, v, k_cache, v_cache, seq_pos) &&
         attention_decode_supported(q, k_cache, v_cache);
}

}  // namespace lt2::ops
