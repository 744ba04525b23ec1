#include "lt2/ops/sparse_attention/dsa_decode.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "lt2/kernels/dsa_decode.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"
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

// Why the tensors of dsa_latent_prep do not fit together (empty when they do); any device.
std::string prep_shape_problem(const DsaLatentPrepArgs& a) {
  for (const Tensor* t : {&a.q_raw, &a.kv_raw, &a.index_q_raw, &a.index_k_raw, &a.index_w_raw, &a.seq_pos,
                          &a.kv_norm_weight, &a.index_norm_weight, &a.index_norm_bias, &a.q, &a.index_q,
                          &a.index_w, &a.k_cache, &a.index_keys, &a.seq_lens, &a.counts})
    if (!t->defined()) return "every input and output must be defined";
  if (a.q_raw.dim() != 3 || a.kv_norm_weight.dim() != 1 || a.index_q_raw.dim() != 3)
    return cat("q_raw must be [B, H, D + d_r], index_q_raw [B, H_I, d_I] and kv_norm_weight [d_c], found ",
               a.q_raw.sizes(), ", ", a.index_q_raw.sizes(), ", ", a.kv_norm_weight.sizes());
  const int64_t B = a.q_raw.size(0), H = a.q_raw.size(1), dc = a.kv_norm_weight.size(0);
  const int64_t HI = a.index_q_raw.size(1), dI = a.index_q_raw.size(2);
  const int64_t dr = a.kv_raw.dim() == 2 ? a.kv_raw.size(1) - dc : -1, L = a.index_keys.dim() == 3 ? a.index_keys.size(1) : 0;
  using Sizes = std::vector<int64_t>;
  const std::vector<std::pair<const Tensor*, Sizes>> want{
      {&a.kv_raw, {B, dc + dr}},       {&a.index_q_raw, {B, HI, dI}},   {&a.index_k_raw, {B, dI}},
      {&a.index_w_raw, {B, HI}},       {&a.seq_pos, {B}},               {&a.index_norm_weight, {dI}},
      {&a.index_norm_bias, {dI}},      {&a.q, {B, H, dc + dr}},         {&a.index_q, {B, HI, dI}},
      {&a.index_w, {B, HI}},           {&a.k_cache, {B, 1, L, dc + dr}}, {&a.index_keys, {B, L, dI}},
      {&a.seq_lens, {B}},              {&a.counts, {B}}};
  if (dr < 0 || dr % 2 != 0 || a.q_raw.size(2) <= dr || L < 1)
    return cat("kv_raw must be [B, d_c + d_r] with d_r even and below q_raw's last dim, and index_keys [B, L >= 1, d_I]; found kv_raw ",
               a.kv_raw.sizes(), ", q_raw ", a.q_raw.sizes(), ", kv_norm_weight ", a.kv_norm_weight.sizes(), ", index_keys ",
               a.index_keys.sizes());
  for (const auto& [t, sizes] : want)
    if (t->sizes() != torch::IntArrayRef(sizes))
      return cat("with q_raw ", a.q_raw.sizes(), ", kv_norm_weight [", dc, "] and index_q_raw ", a.index_q_raw.sizes(),
                 " a tensor must be ", torch::IntArrayRef(sizes), ", found ", t->sizes());
  for (const Tensor* t : {&a.seq_pos, &a.seq_lens, &a.counts})
    if (t->scalar_type() != torch::kInt64) return cat("seq_pos, seq_lens and counts must be int64, found ", t->scalar_type());
  if (a.topk < 1) return cat("topk must be >= 1, found ", a.topk);
  if (a.index_rope_dim < 0 || a.index_rope_dim > dI || a.index_rope_dim % 2 != 0)
    return cat("index_rope_dim must be even and in [0, ", dI, "], found ", a.index_rope_dim);
  if (a.absorb.defined() && a.absorb.sizes() != torch::IntArrayRef({H, dc, a.q_raw.size(2) - dr}))
    return cat("absorb must be [H, d_c, D] = [", H, ", ", dc, ", ", a.q_raw.size(2) - dr, "], found ", a.absorb.sizes());
  return "";
}

// Why the prep kernel cannot fold the q absorption `absorb` in (empty when it can).
std::string absorb_problem(const Tensor& q_raw, const Tensor& q, const Tensor& absorb) {
  if (!q_raw.defined() || !q.defined() || !absorb.defined()) return "q_raw, q and absorb must be defined";
  if (q_raw.dim() != 3 || q.dim() != 3 || absorb.dim() != 3 || absorb.size(0) != q_raw.size(1) ||
      q_raw.size(2) - absorb.size(2) != q.size(2) - absorb.size(1))
    return cat("q_raw must be [B, H, D + d_r], q [B, H, d_c + d_r] and absorb [H, d_c, D], found ", q_raw.sizes(),
               ", ", q.sizes(), ", ", absorb.sizes());
  if (!q_raw.is_cuda() || absorb.device() != q_raw.device() || absorb.scalar_type() != q_raw.scalar_type() ||
      !kernel_dtype_ok(q_raw.scalar_type()))
    return cat("absorb must be ", q_raw.scalar_type(), " on ", q_raw.device(), " like q_raw (a CUDA tensor of float32, "
               "bfloat16 or float16), found ", absorb.scalar_type(), " on ", absorb.device());
  if (!contiguous_aligned(absorb))
    return "absorb must be contiguous and 16-byte aligned";
  const int64_t B = q_raw.size(0), D = absorb.size(2);
  if (!kernels::dsa_latent_prep_absorb_supported(static_cast<int>(std::min<int64_t>(B, INT32_MAX)),
                                                 static_cast<int>(std::min<int64_t>(D, INT32_MAX)),
                                                 static_cast<int>(q_raw.element_size())))
    return cat("batch ", B, " and head dim ", D, ": the folded absorption takes 1..", kernels::kDsaAbsorbMaxRows,
               " sequences and head dims of at most ", kernels::kDsaAbsorbMaxDim, " filling whole 16-byte vectors");
  return "";
}

#ifdef LT2_WITH_CUDA

#endif

}  // namespace

bool dsa_latent_prep_absorb_supported(const Tensor& q_raw, const Tensor& q, const Tensor& absorb) {
  return fused_decode_available() && absorb_problem(q_raw, q, absorb).empty();
}

bool dsa_index_topk_supported(const Tensor& q, const Tensor& index_keys, int64_t k) {
  return fused_decode_available() && index_problem(q, index_keys).empty() && k >= 1 && k <= index_keys.size(1);
}

namespace {

// dsa_index_scores' launch over R = q.size(0) rows in groups of rows_per_group that share a group's
// index_keys row (kernels::DsaIndexScoresParams): q [R / rows_per_group, rows_per_group, H, d] or,
// with rows_per_group 1, [R, H, d]; w [R, H]; seq_lens [R]; into scores [R, L] fp32 contiguous.
// The inputs are checked by the callers.
void launch_index_scores(const Tensor& q, int rows_per_group, const Tensor& w, const Tensor& index_keys,
                         const Tensor& seq_lens, const Tensor& scores) {
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  const auto qc = with_aligned_rows(q);
  const auto wc = w.to(torch::kFloat32).contiguous();
  const auto lens = seq_lens.contiguous();
  // Groups of one row are rows of their own: q's rows are then stride(0) apart.
  const bool grouped = q.dim() == 4 && rows_per_group > 1;
  kernels::DsaIndexScoresParams p{};
  p.q = qc.data_ptr();
  p.q_batch_stride = qc.stride(grouped ? 1 : 0), p.q_head_stride = qc.stride(-2);
  p.rows_per_group = rows_per_group, p.q_group_stride = grouped ? qc.stride(0) : 0;
  p.w = wc.data_ptr<float>();
  p.keys = index_keys.data_ptr();
  p.k_batch_stride = index_keys.stride(0), p.k_row_stride = index_keys.stride(1);
  p.seq_lens = lens.data_ptr<int64_t>();
  p.scores = scores.data_ptr<float>();
  p.batch = static_cast<int>(scores.size(0)), p.heads = static_cast<int>(q.size(-2));
  p.head_dim = static_cast<int>(q.size(-1)), p.max_len = static_cast<int>(index_keys.size(1));
  p.dtype = kernel_dtype(q.scalar_type());
  p.pdl = decode_options().pdl_for("dsa_index_scores");
  kernels::dsa_index_scores(p, current_stream(q));
#else
  (void)q, (void)rows_per_group, (void)w, (void)index_keys, (void)seq_lens, (void)scores;
  no_cuda("dsa_index_scores");
#endif
}

}  // namespace

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
  auto scores = out.defined() ? out : torch::empty({B, L}, q.options().dtype(torch::kFloat32));
  launch_index_scores(q, 1, w, index_keys, seq_lens, scores);
  return scores;
}

Tensor dsa_index_scores_grouped(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& seq_lens) {
  const char* op = "dsa_index_scores_grouped";
  if (!fused_decode_available()) no_cuda(op);
  LT2_CHECK(q.defined() && q.dim() == 4, op, ": q must be [G, n, H_I, d_I], found ", sizes_of(q));
  const auto problem = index_problem(q.select(1, 0), index_keys);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const int64_t G = q.size(0), n = q.size(1), H = q.size(2), L = index_keys.size(1);
  LT2_CHECK(G * n <= 65535, op, ": ", G, " groups of ", n, " rows (at most 65535 rows in all)");
  LT2_CHECK(w.defined() && w.sizes() == torch::IntArrayRef({G, n, H}) && w.is_floating_point() &&
                w.device() == q.device(),
            op, ": w must be [G, n, H_I] = [", G, ", ", n, ", ", H, "] floating point on ", q.device(), ", found ",
            sizes_of(w));
  check_lens(op, seq_lens, G * n, q.device());
  auto scores = torch::empty({G, n, L}, q.options().dtype(torch::kFloat32));
  if (n > 0) launch_index_scores(q, static_cast<int>(n), w.reshape({G * n, H}), index_keys, seq_lens, scores.view({G * n, L}));
  return scores;
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
  p.max_blocks = decode_options().topk_max_blocks;
  p.pdl = decode_options().pdl_for("topk_select");
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

bool dsa_index_backward_supported(const Tensor& q, const Tensor& index_keys) {
  return fused_decode_available() && q.defined() && index_keys.defined() && q.is_cuda() && q.dim() == 4 &&
         index_keys.dim() == 3 && q.scalar_type() == torch::kBFloat16 && index_keys.scalar_type() == torch::kBFloat16 &&
         index_keys.device() == q.device() && index_keys.size(0) == q.size(0) && index_keys.size(2) == q.size(3) &&
         index_keys.size(1) >= 1 && index_keys.size(1) <= kernels::kDsaMaxLength && q.size(0) <= 65535 &&
         q.size(1) <= INT32_MAX &&
         kernels::dsa_index_backward_supported(static_cast<int>(std::min<int64_t>(q.size(2), INT32_MAX)),
                                               static_cast<int>(std::min<int64_t>(q.size(3), INT32_MAX)));
}

IndexBackward dsa_index_backward(const Tensor& q, const Tensor& w, const Tensor& index_keys, const Tensor& d_scores,
                                 int64_t query_start, const Tensor& dq_out) {
  const char* op = "dsa_index_backward";
  if (!fused_decode_available()) no_cuda(op);
  LT2_CHECK(dsa_index_backward_supported(q, index_keys), op, ": q must be [B, n, H_I, d_I] and index_keys [B, L, d_I] ",
            "bf16 on one CUDA device (16, 32, 64 or 128 heads of dim 64 or 128), found ", sizes_of(q), " and ",
            sizes_of(index_keys));
  const int64_t B = q.size(0), n = q.size(1), H = q.size(2), D = q.size(3), L = index_keys.size(1);
  LT2_CHECK(w.defined() && w.sizes() == torch::IntArrayRef({B, n, H}) && w.is_floating_point() && w.device() == q.device(),
            op, ": w must be [B, n, H_I] = [", B, ", ", n, ", ", H, "] floating point on ", q.device(), ", found ",
            sizes_of(w));
  LT2_CHECK(d_scores.defined() && d_scores.sizes() == torch::IntArrayRef({B, n, L}) && d_scores.is_floating_point() &&
                d_scores.device() == q.device(),
            op, ": d_scores must be [B, n, L] = [", B, ", ", n, ", ", L, "] floating point on ", q.device(), ", found ",
            sizes_of(d_scores));
  LT2_CHECK(query_start >= 0, op, ": query_start must be >= 0, found ", query_start);
  LT2_CHECK(!dq_out.defined() || (dq_out.sizes() == q.sizes() && dq_out.scalar_type() == q.scalar_type() &&
                                  dq_out.device() == q.device() && dq_out.stride(3) == 1 && dq_out.stride(2) == D &&
                                  reinterpret_cast<uintptr_t>(dq_out.data_ptr()) % 4 == 0 &&
                                  dq_out.stride(1) % 2 == 0 && dq_out.stride(0) % 2 == 0),
            op, ": dq_out must be [B, n, H_I, d_I] = ", sizes_of(q), " bf16 on ", q.device(),
            " with packed heads (strides [., ., d_I, 1]) and even row strides, found ", sizes_of(dq_out));
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(q.device());
  // q's heads packed (the kernel reads a row's H x D at once), every row 16-byte aligned.
  const auto qc = q.stride(3) == 1 && q.stride(2) == D && rows_aligned(q) ? q : q.contiguous();
  const auto kc = with_aligned_rows(index_keys);
  const auto wc = w.to(torch::kFloat32).contiguous(), dc = d_scores.to(torch::kFloat32).contiguous();
  // d_keys as one partial sum per part of the rows (the kernel's row splits), summed here.
  const int splits = kernels::dsa_index_backward_row_splits(static_cast<int>(B), static_cast<int>(n),
                                                            static_cast<int>(L));
  IndexBackward out{dq_out.defined() ? dq_out : torch::empty({B, n, H, D}, q.options()),
                    torch::empty({B, n, H}, wc.options()),
                    torch::empty({splits, B, L, D}, wc.options())};
  kernels::DsaIndexBackwardParams p{};
  p.q = qc.data_ptr(), p.q_batch_stride = qc.stride(0), p.q_row_stride = qc.stride(1);
  p.w = wc.data_ptr<float>();
  p.keys = kc.data_ptr(), p.k_batch_stride = kc.stride(0), p.k_row_stride = kc.stride(1);
  p.d_scores = dc.data_ptr<float>();
  p.dq = out.dq.data_ptr(), p.dw = out.dw.data_ptr<float>(), p.dkeys = out.d_keys.data_ptr<float>();
  p.dq_batch_stride = out.dq.stride(0), p.dq_row_stride = out.dq.stride(1);
  p.batch = static_cast<int>(B), p.rows = static_cast<int>(n), p.heads = static_cast<int>(H);
  p.head_dim = static_cast<int>(D), p.length = static_cast<int>(L), p.query_start = query_start;
  p.row_splits = splits;
  kernels::dsa_index_backward(p, current_stream(q));
  out.d_keys = splits == 1 ? out.d_keys.squeeze(0) : out.d_keys.sum(0);
  return out;
#else
  (void)w, (void)d_scores, (void)query_start, (void)dq_out;
  no_cuda(op);
#endif
}

bool dsa_head_probs_supported(const Tensor& scores, const Tensor& support) {
  return fused_decode_available() && scores.defined() && support.defined() && scores.is_cuda() &&
         support.device() == scores.device() && kernel_dtype_ok(scores.scalar_type()) &&
         support.scalar_type() == torch::kBool && scores.dim() == 4 && support.dim() == 3 &&
         support.size(0) == scores.size(0) && support.size(1) == scores.size(2) && support.size(2) == scores.size(3) &&
         scores.size(1) >= 1 && scores.size(1) <= kernels::kDsaHeadProbsMaxHeads && scores.size(0) <= 65535 &&
         scores.size(2) <= INT32_MAX && scores.size(3) <= INT32_MAX && (scores.size(3) <= 1 || scores.stride(3) == 1) &&
         (support.size(2) <= 1 || support.stride(2) == 1);
}

Tensor dsa_head_probs(const Tensor& scores, const Tensor& support) {
  const char* op = "dsa_head_probs";
  if (!fused_decode_available()) no_cuda(op);
  LT2_CHECK(dsa_head_probs_supported(scores, support), op, ": scores must be [B, H, n, keys] (float32, bfloat16 or ",
            "float16, 1..", kernels::kDsaHeadProbsMaxHeads, " heads) and support [B, n, keys] bool on one CUDA ",
            "device, each with a contiguous last dim, found ", sizes_of(scores), " and ", sizes_of(support));
  const int64_t B = scores.size(0), n = scores.size(2), keys = scores.size(3);
  auto probs = torch::empty({B, n, keys}, scores.options().dtype(torch::kFloat32));
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(scores.device());
  kernels::DsaHeadProbsParams p{};
  p.scores = scores.data_ptr();
  p.s_batch_stride = scores.stride(0), p.s_head_stride = scores.stride(1), p.s_row_stride = scores.stride(2);
  p.support = support.data_ptr<bool>(), p.m_batch_stride = support.stride(0), p.m_row_stride = support.stride(1);
  p.probs = probs.data_ptr<float>();
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(scores.size(1));
  p.rows = static_cast<int>(n), p.keys = static_cast<int>(keys);
  p.dtype = kernel_dtype(scores.scalar_type());
  kernels::dsa_head_probs(p, current_stream(scores));
#endif
  return probs;
}

Tensor dsa_topk_attention_fused(const Tensor& q_index, const Tensor& w_index, const Tensor& index_keys,
                                const Tensor& seq_lens, int64_t k, const Tensor& q, const Tensor& k_cache,
                                const Tensor& v_cache, double scale) {
  if (!fused_decode_enabled() || torch::GradMode::is_enabled() || !dsa_index_topk_supported(q_index, index_keys, k) ||
      !sparse_attention_decode_supported(q, k_cache, v_cache))
    return {};
  const auto idx = dsa_index_topk(q_index, w_index, index_keys, seq_lens, k);  // [B, k], a sequence's valid slots first
  return sparse_attention_decode_fused(q, k_cache, v_cache, idx, seq_lens.clamp_max(k), scale);
}

void dsa_latent_prep(const DsaLatentPrepArgs& a) {
  const char* op = "dsa_latent_prep";
  if (!fused_decode_available()) no_cuda(op);
  const auto problem = prep_shape_problem(a);
  LT2_CHECK(problem.empty(), op, ": ", problem);
  const auto dt = a.q_raw.scalar_type();
  const auto device = a.q_raw.device();
  LT2_CHECK(a.q_raw.is_cuda() && kernel_dtype_ok(dt), op, ": q_raw must be a CUDA tensor of float32, bfloat16 or float16, found ",
            dt, " on ", device);
  for (const Tensor* t : {&a.kv_raw, &a.index_q_raw, &a.index_k_raw, &a.index_w_raw, &a.q, &a.index_q, &a.k_cache,
                          &a.index_keys})
    LT2_CHECK(t->scalar_type() == dt && t->device() == device && t->stride(-1) == 1, op,
              ": every activation and cache must be ", dt, " on ", device, " with a contiguous last dim like q_raw, found ",
              t->sizes(), " ", t->scalar_type(), " on ", t->device());
  const int64_t Dq = a.q_raw.size(2), dc = a.kv_norm_weight.size(0), dI = a.index_q_raw.size(2);
  LT2_CHECK(a.q_raw.stride(1) == Dq && a.index_q_raw.stride(1) == dI, op,
            ": the heads of q_raw and index_q_raw must be packed (head strides ", Dq, " and ", dI, "), found ",
            a.q_raw.stride(1), " and ", a.index_q_raw.stride(1));
  LT2_CHECK(a.q.is_contiguous() && a.index_q.is_contiguous() && a.index_w.is_contiguous() &&
                a.seq_lens.is_contiguous() && a.counts.is_contiguous() && a.index_w.scalar_type() == torch::kFloat32,
            op, ": q, index_q, index_w (float32), seq_lens and counts must be contiguous");
  for (const Tensor* t : {&a.seq_pos, &a.index_w, &a.seq_lens, &a.counts})
    LT2_CHECK(t->device() == device, op, ": seq_pos, index_w, seq_lens and counts must be on ", device, ", found ",
              t->device());
  const int64_t B = a.q_raw.size(0), dr = a.kv_raw.size(1) - dc, L = a.k_cache.size(2);
  LT2_CHECK(kernels::dsa_latent_prep_supported(static_cast<int>(std::min<int64_t>(B, INT32_MAX)), static_cast<int>(dr),
                                               static_cast<int>(std::min<int64_t>(dI, INT32_MAX)),
                                               static_cast<int>(a.index_rope_dim)) &&
                L <= INT32_MAX,
            op, ": batch ", B, " (at most 65535), index head dim ", dI, " (at most ", kernels::kDsaIndexMaxHeadDim,
            "), cache length ", L);
  if (a.absorb.defined()) {
    const auto absorb = absorb_problem(a.q_raw, a.q, a.absorb);
    LT2_CHECK(absorb.empty(), op, ": ", absorb);
  }
#ifdef LT2_WITH_CUDA
  c10::cuda::CUDAGuard guard(device);
  // The norm weights in the activation dtype (no copy when they already are).
  const auto g_kv = a.kv_norm_weight.to(dt).contiguous(), g_ik = a.index_norm_weight.to(dt).contiguous(),
             b_ik = a.index_norm_bias.to(dt).contiguous();
  const auto pos = a.seq_pos.contiguous();
  kernels::DsaLatentPrepParams p{};
  p.q_raw = a.q_raw.data_ptr(), p.kv_raw = a.kv_raw.data_ptr(), p.index_q_raw = a.index_q_raw.data_ptr();
  p.index_k_raw = a.index_k_raw.data_ptr(), p.index_w_raw = a.index_w_raw.data_ptr();
  p.q_raw_stride = a.q_raw.stride(0), p.kv_raw_stride = a.kv_raw.stride(0);
  p.index_q_raw_stride = a.index_q_raw.stride(0), p.index_k_raw_stride = a.index_k_raw.stride(0);
  p.index_w_raw_stride = a.index_w_raw.stride(0);
  p.seq_pos = pos.data_ptr<int64_t>();
  p.kv_norm_weight = g_kv.data_ptr(), p.index_norm_weight = g_ik.data_ptr(), p.index_norm_bias = b_ik.data_ptr();
  p.absorb_w = a.absorb.defined() ? a.absorb.data_ptr() : nullptr;
  p.q = a.q.data_ptr();
  p.k_cache = a.k_cache.data_ptr(), p.k_batch_stride = a.k_cache.stride(0), p.k_row_stride = a.k_cache.stride(2);
  p.index_q = a.index_q.data_ptr(), p.index_w = a.index_w.data_ptr<float>();
  p.index_keys = a.index_keys.data_ptr();
  p.index_keys_batch_stride = a.index_keys.stride(0), p.index_keys_row_stride = a.index_keys.stride(1);
  p.seq_lens = a.seq_lens.data_ptr<int64_t>(), p.counts = a.counts.data_ptr<int64_t>(), p.topk = a.topk;
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(a.q_raw.size(1)), p.head_dim = static_cast<int>(Dq - dr);
  p.latent_dim = static_cast<int>(dc), p.rope_dim = static_cast<int>(dr);
  p.index_heads = static_cast<int>(a.index_q_raw.size(1)), p.index_head_dim = static_cast<int>(dI);
  p.index_rope_dim = static_cast<int>(a.index_rope_dim), p.max_len = static_cast<int>(L);
  p.rope_theta = a.rope_theta, p.interleaved = a.rope_style == RopeStyle::Interleaved;
  p.kv_norm_eps = static_cast<float>(a.kv_norm_eps), p.index_norm_eps = static_cast<float>(a.index_norm_eps);
  p.index_weight_scale = static_cast<float>(a.index_weight_scale);
  p.dtype = kernel_dtype(dt);
  p.pdl = decode_options().pdl_for("dsa_latent_prep");
  kernels::dsa_latent_prep(p, current_stream(a.q_raw));
#endif
}

void dsa_latent_prep_reference(const DsaLatentPrepArgs& a) {
  const auto problem = prep_shape_problem(a);
  LT2_CHECK(problem.empty(), "dsa_latent_prep_reference: ", problem);
  const auto f64 = [](const Tensor& t) { return t.detach().to(torch::kCPU, torch::kFloat64).contiguous(); };
  const auto q_raw = f64(a.q_raw), kv = f64(a.kv_raw), iq_raw = f64(a.index_q_raw), ik = f64(a.index_k_raw),
             iw_raw = f64(a.index_w_raw), g_kv = f64(a.kv_norm_weight), g_ik = f64(a.index_norm_weight),
             b_ik = f64(a.index_norm_bias);
  const auto pos = a.seq_pos.to(torch::kCPU).contiguous();
  const int64_t B = q_raw.size(0), H = q_raw.size(1), dc = g_kv.size(0), dr = kv.size(1) - dc, D = q_raw.size(2) - dr;
  const int64_t HI = iq_raw.size(1), dI = iq_raw.size(2), r = a.index_rope_dim, L = a.k_cache.size(2);
  // RoPE of n values at `in` into `out` at position t: pair i rotates by t theta^(-2i/n).
  const auto rope = [&](const double* in, double* out, int64_t n, bool interleaved, int64_t t) {
    for (int64_t i = 0; i < n / 2; ++i) {
      const int64_t u = interleaved ? 2 * i : i, v = interleaved ? 2 * i + 1 : i + n / 2;
      const double angle = static_cast<double>(t) * std::pow(a.rope_theta, -static_cast<double>(2 * i) / n);
      out[u] = in[u] * std::cos(angle) - in[v] * std::sin(angle);
      out[v] = in[v] * std::cos(angle) + in[u] * std::sin(angle);
    }
  };
  const bool interleaved = a.rope_style == RopeStyle::Interleaved;
  auto q_rope = torch::zeros({B, H, dr}, torch::kFloat64), index_q = torch::zeros({B, HI, dI}, torch::kFloat64);
  auto index_w = torch::zeros({B, HI}, torch::kFloat64);
  auto k_row = torch::zeros({dc + dr}, torch::kFloat64), key = torch::zeros({dI}, torch::kFloat64);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = pos[b].item<int64_t>();
    for (int64_t h = 0; h < H; ++h)
      rope(q_raw[b][h].data_ptr<double>() + D, q_rope[b][h].data_ptr<double>(), dr, interleaved, t);
    for (int64_t j = 0; j < HI; ++j) {
      const double* in = iq_raw[b][j].data_ptr<double>();
      double* out = index_q[b][j].data_ptr<double>();
      rope(in, out, r, false, t);
      for (int64_t i = r; i < dI; ++i) out[i] = in[i];
      index_w[b][j] = iw_raw[b][j].item<double>() * a.index_weight_scale;
    }
    if (t < 0 || t >= L) continue;
    const double* c = kv[b].data_ptr<double>();
    double sum_sq = 0;
    for (int64_t i = 0; i < dc; ++i) sum_sq += c[i] * c[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / dc + a.kv_norm_eps);
    double* row = k_row.data_ptr<double>();
    for (int64_t i = 0; i < dc; ++i) row[i] = c[i] * inv_rms * g_kv[i].item<double>();
    rope(c + dc, row + dc, dr, interleaved, t);
    a.k_cache[b][0][t].copy_(k_row);
    const double* x = ik[b].data_ptr<double>();
    double mean = 0, var = 0;
    for (int64_t i = 0; i < dI; ++i) mean += x[i] / dI;
    for (int64_t i = 0; i < dI; ++i) var += (x[i] - mean) * (x[i] - mean) / dI;
    std::vector<double> normed(dI);
    for (int64_t i = 0; i < dI; ++i)
      normed[i] = (x[i] - mean) / std::sqrt(var + a.index_norm_eps) * g_ik[i].item<double>() + b_ik[i].item<double>();
    double* k = key.data_ptr<double>();
    rope(normed.data(), k, r, false, t);
    for (int64_t i = r; i < dI; ++i) k[i] = normed[i];
    a.index_keys[b][t].copy_(key);
  }
  a.q.narrow(-1, dc, dr).copy_(q_rope);
  if (a.absorb.defined())
    a.q.narrow(-1, 0, dc).copy_(torch::einsum("bhd,hcd->bhc", {q_raw.narrow(-1, 0, D), f64(a.absorb)}));
  a.index_q.copy_(index_q);
  a.index_w.copy_(index_w);
  a.seq_lens.copy_(pos + 1);
  a.counts.copy_((pos + 1).clamp_max(a.topk));
}

}  // namespace lt2::ops
