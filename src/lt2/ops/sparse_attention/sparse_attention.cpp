#include "lt2/ops/sparse_attention/sparse_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "lt2/kernels/prefill.h"
#include "lt2/nn/linear.h"
#include "lt2/nn/precision.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/sparse_attention/dsa_decode.h"
#include "lt2/ops/sparse_attention/sparse_attention_decode.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <ATen/SDPBackend.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace lt2 {

Tensor window_mask(const Tensor& q_pos, const Tensor& k_pos, int64_t window) {
  auto dist = q_pos.unsqueeze(1) - k_pos.unsqueeze(0);  // [T, L] query minus key position
  auto mask = dist >= 0;
  if (window > 0) mask = mask & (dist < window);
  return mask;
}

Tensor masked_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                        double scale) {
  const bool gqa = q.size(1) != k.size(1);
  std::optional<double> sdpa_scale;
  if (scale > 0) sdpa_scale = scale;
  auto o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/false, sdpa_scale, gqa);
  return o.transpose(1, 2);  // [B, T, H, D]
}

namespace {

#ifdef LT2_WITH_CUDA
// libtorch's FlashAttention-2 with its causal window: q [B, T, H, D], k and v [B, L, H_kv, D], each
// with a unit last stride; keys left of a query's position by more than `window_left` are skipped
// (-1: none). The forward keeps the log-sum-exp of each query's scores for the backward, which
// recomputes the probabilities block by block instead of storing them.
struct WindowFlashFunction : public torch::autograd::Function<WindowFlashFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, int64_t window_left,
                                                double scale) {
    const int64_t T = q.size(1), L = k.size(1);
    auto [out, lse, rng_state, unused, debug_mask] =
        at::_flash_attention_forward(q, k, v, std::nullopt, std::nullopt, T, L, /*dropout_p=*/0.0,
                                     /*is_causal=*/true, /*return_debug_mask=*/false, scale, window_left,
                                     /*window_size_right=*/0);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["rng_state"] = rng_state;
    ctx->saved_data["unused"] = unused;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["scale"] = scale;
    return {out};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    auto [dq, dk, dv] = at::_flash_attention_backward(
        grads[0].contiguous(), q, k, v, out, lse, Tensor(), Tensor(), q.size(1), k.size(1), /*dropout_p=*/0.0,
        /*is_causal=*/true, ctx->saved_data["rng_state"].toTensor(), ctx->saved_data["unused"].toTensor(),
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["window_left"].toInt(), /*window_size_right=*/0);
    return {dq, dk, dv, Tensor(), Tensor()};
  }
};
#endif

}  // namespace

bool window_flash_serves(const Tensor& q, const Tensor& k, const Tensor& v) {
#ifdef LT2_WITH_CUDA
  if (!decode_options().window_flash || !q.is_cuda() || !k.is_cuda() || !v.is_cuda()) return false;
  const auto dt = q.scalar_type();
  if ((dt != torch::kBFloat16 && dt != torch::kHalf) || k.scalar_type() != dt || v.scalar_type() != dt) return false;
  const int64_t D = q.size(3);
  if (D % 8 != 0 || D > 256 || k.size(3) != D || v.size(3) != D) return false;
  if (q.size(1) % k.size(1) != 0 || q.size(2) > k.size(2) || k.size(2) == 0) return false;
  return at::cuda::getDeviceProperties(ops::detail::cuda_index(q.device()))->major >= 8;
#else
  (void)q, (void)k, (void)v;
  return false;
#endif
}

Tensor window_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t window, double scale) {
  LT2_CHECK(window >= 0, "window_attention: window must be >= 0 (0 = causal), found ", window);
  const int64_t T = q.size(2), L = k.size(2);
  LT2_CHECK(T <= L, "window_attention: ", T, " queries at the last positions of ", L, " keys");
  if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
#ifdef LT2_WITH_CUDA
  if (window_flash_serves(q, k, v)) {
    c10::cuda::CUDAGuard guard(q.device());
    const int64_t window_left = window > 0 && window < L ? window - 1 : -1;
    return WindowFlashFunction::apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_left,
                                      scale)[0];
  }
#endif
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(q.device());
  auto k_pos = torch::arange(L, opts);
  return masked_attention(q, k, v, window_mask(k_pos.narrow(0, L - T, T), k_pos, window), scale);
}

namespace {

// The products of scaled queries q [B, H, T, D] with keys given transposed, k_t [B, H_kv, D, L]:
// [B, H, T, L] in q's dtype. The G = H / H_kv query heads of a key head are one matmul's rows: no
// copy of the keys per head; none of q or k_t either where their batch dims collapse (q heads-major
// with G = 1, k_t contiguous, or a narrow of it along L).
Tensor scaled_scores(const Tensor& q, const Tensor& k_t) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), H_kv = k_t.size(1), L = k_t.size(3);
  LT2_CHECK(H % H_kv == 0, "attention: ", H, " query heads are not a multiple of ", H_kv, " kv heads");
  return torch::matmul(q.reshape({B, H_kv, H / H_kv * T, D}), k_t).view({B, H, T, L});
}

double attention_scale(double scale, int64_t head_dim) {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// The scaled products of q [B, H, T, D] with k [B, H_kv, L, D], [B, H, T, L] in q's dtype (scale 0:
// D^-1/2). The scale on the queries (1/L of the scores' size).
Tensor attention_scores(const Tensor& q, const Tensor& k, double scale) {
  return scaled_scores(q * attention_scale(scale, q.size(3)), k.transpose(-1, -2));
}

// Softmax of scores [B, H, T, L] over the keys `mask` shows, in `dtype` (as attention_probs).
Tensor masked_softmax(const Tensor& scores, const Tensor& mask, torch::ScalarType dtype, bool zero_rows_without_keys) {
  // ATen converts bf16 scores in a pass of its own first; only fp16 has a fused half-to-float
  // softmax. A query seeing no key gets all-zero probabilities: its softmax is NaN, replaced here,
  // and masked_fill's backward zeroes the gradient of every hidden score, so no NaN reaches q or k.
  auto probs = torch::softmax(scores.masked_fill(~mask, -std::numeric_limits<double>::infinity()), -1, dtype);
  if (!zero_rows_without_keys) return probs;
  return torch::where(mask.any(-1, /*keepdim=*/true), probs, torch::zeros({}, probs.options()));
}

}  // namespace

Tensor attention_probs(const Tensor& q, const Tensor& k, const Tensor& mask, double scale, bool zero_rows_without_keys) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), L = k.size(2);
  if (L == 0) return torch::zeros({B, H, T, 0}, q.options().dtype(accum_dtype(q)));
  return masked_softmax(attention_scores(q, k, scale), mask, accum_dtype(q), zero_rows_without_keys);  // [B, H, T, L]
}

std::pair<Tensor, Tensor> masked_attention_probs(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& mask, double scale) {
  const int64_t H = q.size(1), H_kv = k.size(1);
  auto probs = attention_probs(q, k, mask, scale);
  if (k.size(2) == 0) return {torch::zeros({q.size(0), q.size(2), H, v.size(3)}, q.options()), probs};
  auto ve = H == H_kv ? v : v.repeat_interleave(H / H_kv, 1);  // [B, H, L, D_v]
  auto out = torch::matmul(probs.to(v.scalar_type()), ve);      // [B, H, T, D_v]
  return {out.transpose(1, 2), probs};
}

Tensor topk_indices(const Tensor& scores, const Tensor& visible, int64_t k) {
  const int64_t L = scores.size(-1), n = std::min(k, L);
  auto s = scores.masked_fill(~visible, -std::numeric_limits<double>::infinity());
  if (s.scalar_type() == torch::kFloat64) {
    // Stable descending sort keeps equal scores in index order: ties go to the lower index.
    auto order = std::get<1>(torch::sort(s, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
    return order.narrow(-1, 0, n);
  }
  // fp32 (lower precisions widen exactly): one top-k (a radix select, not a sort of all L
  // scores) over int64 keys ordered by score, then by lower index. The fp32 bits map to an
  // unsigned integer monotone in the value (negative floats: bits inverted; others: sign bit set),
  // and key = that * 2^31 + (2^31 - 1 - index).
  auto bits = (s.to(torch::kFloat32) + 0.0).contiguous().view(torch::kInt32).to(torch::kLong);  // + 0.0: -0 -> +0
  auto ordered = torch::where(bits < 0, bits.bitwise_not(), bits + (int64_t(1) << 31));      // [0, 2^32)
  const int64_t half = int64_t(1) << 31;
  auto key = ordered * half + (half - 1 - torch::arange(L, bits.options()));
  return std::get<1>(torch::topk(key, n, -1, /*largest=*/true, /*sorted=*/true));
}

Tensor topk_mask(const Tensor& scores, const Tensor& visible, int64_t k) {
  auto idx = topk_indices(scores, visible, k);
  return torch::zeros_like(visible).scatter(-1, idx, true) & visible;
}

Tensor lightning_indexer_scores(const Tensor& q, const Tensor& w, const Tensor& k) {
  auto logits = torch::relu(torch::einsum("bthd,bsd->bths", {q, k}));  // [B, T, H_I, L]
  return torch::einsum("bths,bth->bts", {logits, w});
}

namespace {

// The KL's target: the head-summed attention probabilities on the support, L1-normalised (a row
// without mass stays 0); no gradient to the main model. A NaN row of attn_probs (a query that sees
// no key: attention_probs without zero_rows_without_keys) has an empty support and becomes 0.
Tensor kl_target(const Tensor& attn_probs, const Tensor& support, torch::ScalarType dtype) {
  auto p = attn_probs.detach().to(dtype).sum(1).masked_fill(~support, 0.0);  // [B, T, L]
  auto mass = p.sum(-1, /*keepdim=*/true);
  return p / torch::where(mass > 0, mass, torch::ones_like(mass));
}

// kl_target of the attention of the scaled queries q [B, H, T, D] over the keys k_t [B, H_kv, D, L]
// (given transposed, L > 0; as scaled_scores takes them) restricted to the support [B, T, L]: on the
// kernel (ops::dsa_head_probs, DecodeOptions::dsa_head_probs) where it serves, from the scores
// without their fp32 probabilities [B, H, T, L].
Tensor support_target(const Tensor& q, const Tensor& k_t, const Tensor& support, torch::ScalarType dtype) {
  const auto scores = scaled_scores(q, k_t);
  if (decode_options().dsa_head_probs && dtype == torch::kFloat32 && ops::dsa_head_probs_supported(scores, support))
    return ops::dsa_head_probs(scores, support);
  return kl_target(masked_softmax(scores, support.unsqueeze(1), accum_dtype(q), /*zero_rows_without_keys=*/false),
                   support, dtype);
}

// The indexer's log-distribution over the support, 0 off it (no -inf * 0 in the KL's terms).
Tensor support_log_softmax(const Tensor& scores, const Tensor& support) {
  const auto off = ~support;
  return torch::log_softmax(scores.masked_fill(off, -std::numeric_limits<double>::infinity()), -1).masked_fill(off, 0.0);
}

// Each row's KL(p || q) summed over the keys: [B, T]; 0 off the support (p = 0 there).
Tensor kl_rows(const Tensor& p, const Tensor& log_q) { return (torch::xlogy(p, p) - p * log_q).sum(-1); }

}  // namespace

Tensor indexer_kl_loss(const Tensor& attn_probs, const Tensor& index_scores, const Tensor& support) {
  const auto dt = accum_dtype(index_scores);
  return kl_rows(kl_target(attn_probs, support, dt), support_log_softmax(index_scores.to(dt), support)).mean();
}

bool indexer_kernels_serve(const Tensor& iq, const Tensor& index_k, int64_t topk) {
#ifdef LT2_WITH_CUDA
  if (!decode_options().dsa_index_kernels || !iq.is_cuda() || iq.size(1) > 65535) return false;
  if (torch::GradMode::is_enabled() && (iq.requires_grad() || index_k.requires_grad())) return false;
  const int64_t n = iq.size(1), L = index_k.size(1);
  const auto rows_keys = index_k.narrow(0, 0, 1).to(iq.scalar_type()).expand({n, L, index_k.size(2)});
  if (!ops::dsa_index_topk_supported(iq[0], rows_keys, std::clamp<int64_t>(topk, 1, L))) return false;
  return at::cuda::getDeviceProperties(ops::detail::cuda_index(iq.device()))->major >= 9;
#else
  (void)iq, (void)index_k, (void)topk;
  return false;
#endif
}

namespace {

// Rows of B sequences on the decode kernels: the index scores [B, n, L] fp32 of queries iq [B, n, H_I,
// d_I] with weights iw [B, n, H_I] against their sequence's keys [B, L, d_I] in iq's dtype (keys at
// or past a row's length in lens [n] are not read and score -inf), and where 0 < topk < L the top-k
// slots [B, n, topk], each row's visible ones first. A launch of each takes the rows of as many
// sequences as the kernels' 65535 rows allow.
std::pair<Tensor, Tensor> kernel_selection(const Tensor& iq, const Tensor& iw, const Tensor& keys, const Tensor& lens,
                                           int64_t topk) {
  const int64_t B = iq.size(0), n = iq.size(1), L = keys.size(1);
  const int64_t per_launch = std::max<int64_t>(1, 65535 / std::max<int64_t>(n, 1));
  std::vector<Tensor> scores, slots;
  for (int64_t b0 = 0; b0 < B; b0 += per_launch) {
    const int64_t g = std::min(per_launch, B - b0);
    const auto lens_g = lens.repeat({g});
    scores.push_back(ops::dsa_index_scores_grouped(iq.narrow(0, b0, g), iw.narrow(0, b0, g), keys.narrow(0, b0, g), lens_g));
    if (topk > 0 && topk < L) slots.push_back(ops::topk_select(scores.back().view({g * n, L}), topk, lens_g).view({g, n, topk}));
  }
  auto joined = [](const std::vector<Tensor>& parts) { return parts.size() == 1 ? parts[0] : torch::cat(parts); };
  return {joined(scores), slots.empty() ? Tensor() : joined(slots)};
}

// Causal lengths [n] (int64 on `device`) of rows at positions query_start .. query_start + n - 1
// over L keys.
Tensor row_lengths(int64_t query_start, int64_t n, int64_t L, torch::Device device) {
  return torch::arange(query_start + 1, query_start + n + 1, torch::TensorOptions(torch::kLong).device(device))
      .clamp_max(L);
}

}  // namespace

IndexerSelection indexer_select(const Tensor& iq, const Tensor& iw, const Tensor& index_k, int64_t query_start,
                                int64_t topk) {
  const int64_t B = iq.size(0), n = iq.size(1), L = index_k.size(1);
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(iq.device());
  auto visible = window_mask(torch::arange(query_start, query_start + n, opts), torch::arange(L, opts), 0);  // [n, L]
  if (indexer_kernels_serve(iq, index_k, topk)) {
    auto [scores, idx] = kernel_selection(iq, iw, index_k.to(iq.scalar_type()), row_lengths(query_start, n, L, iq.device()),
                                          topk);
    if (!idx.defined()) return {scores, visible.expand({B, n, L})};
    return {scores, torch::zeros({B, n, L}, visible.options()).scatter_(2, idx, true) & visible};
  }
  auto scores = lightning_indexer_scores(iq, iw, index_k);  // [B, n, L]
  visible = visible.expand_as(scores);
  return {scores, topk == 0 ? visible : topk_mask(scores, visible, topk)};
}

Tensor indexer_topk_attention(const Tensor& iq, const Tensor& iw, const Tensor& index_k, const Tensor& q,
                              const Tensor& k, const Tensor& v, int64_t query_start, int64_t topk, double scale,
                              int64_t block_rows) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), L = k.size(2), H_kv = k.size(1);
  if (!decode_options().dsa_sparse_prefill || topk <= 0 || topk >= L || !indexer_kernels_serve(iq, index_k, topk))
    return {};
  if (torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return {};
  // Every row of a sequence reads that sequence's cache: a zero row stride, as for the index keys.
  auto rows = [&](const Tensor& x, int64_t b, int64_t n) { return x[b].unsqueeze(0).expand({n, H_kv, L, x.size(3)}); };
  if (!ops::sparse_attention_decode_supported(q[0].transpose(0, 1), rows(k, 0, T), rows(v, 0, T))) return {};
  if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const auto keys = index_k.to(iq.scalar_type());
  auto out = torch::empty({B, T, H, v.size(3)}, q.options());
  for (int64_t r0 = 0; r0 < T; r0 += block_rows) {
    const int64_t n = std::min(block_rows, T - r0);
    const auto lens = row_lengths(query_start + r0, n, L, q.device());
    const auto idx = kernel_selection(iq.narrow(1, r0, n), iw.narrow(1, r0, n), keys, lens, topk).second;  // [B, n, topk]
    for (int64_t b = 0; b < B; ++b)
      out[b].narrow(0, r0, n).copy_(ops::sparse_attention_decode_fused(
          q[b].narrow(1, r0, n).transpose(0, 1), rows(k, b, n), rows(v, b, n), idx[b], lens.clamp_max(topk), scale));
  }
  return out;
}

namespace {

// Holds the caller's query function, its autocast state and the kernel switches in force for the
// backward, which runs on autograd's thread (where neither is the forward's by itself).
struct QueriesHolder : torch::CustomClassHolder {
  IndexerQueries queries;
  AutocastState autocast;
  DecodeOptions kernel_options;
};

// indexer_loss_blocked's autograd function. Inputs: x (what the queries read; no gradient), index_k
// (differentiable), q, k (the target); outputs: the loss and the support. A block of rows [r0, r0 + n)
// scores only the keys its last row can see, the first query_start + r0 + n. The forward takes each
// block's loss and its gradient with respect to the block's scores (the target is fixed, so this is
// exact, and in closed form); the backward carries that gradient back through a recompute of the
// scores. Blocks hold about block_bytes each (indexer_loss_row_bytes). Saved: x,
// index_k and each block's scores' gradient [B, n, keys] in the accumulation dtype; not the queries
// ([B, T, H_I, d_I]: at 64 index heads of 128 dims, 16 KiB a token in bf16, more than the rest of a
// layer application's state under per-loop checkpointing), which the backward projects again.
struct IndexerLossFunction : public torch::autograd::Function<IndexerLossFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const Tensor& index_k, const Tensor& q, const Tensor& k,
                                                int64_t query_start, int64_t topk, double scale, int64_t block_bytes,
                                                c10::intrusive_ptr<QueriesHolder> holder) {
    holder->autocast = AutocastState::current();
    holder->kernel_options = decode_options();
    auto [iq, iw] = holder->queries(x);  // Function::forward records no graph
    const auto compute = product_dtype(iq, index_k);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // dtypes set here
    const int64_t B = iq.size(0), T = iq.size(1), L = index_k.size(1);
    const auto keys = index_k.to(compute);
    iq = iq.to(compute), iw = iw.to(compute);
    const bool kernels = indexer_kernels_serve(iq, keys, topk);
    // The main attention's queries scaled and heads-major, its keys transposed, once for every
    // block: a block's scores then read narrows of them without copying (scaled_scores).
    const auto q_rows = (q * attention_scale(scale, q.size(3))).contiguous();
    const auto k_t = k.transpose(-1, -2).contiguous();
    const int64_t block_rows = std::clamp<int64_t>(
        block_bytes / indexer_loss_row_bytes(B, q.size(1), iq.size(2), L, kernels), 1, std::max<int64_t>(T, 1));
    Tensor loss;
    std::vector<Tensor> supports, saved{x, index_k};
    for (int64_t r0 = 0; r0 < T; r0 += block_rows) {
      const int64_t n = std::min(block_rows, T - r0), seen = std::min(L, query_start + r0 + n);
      auto sel = indexer_select(iq.narrow(1, r0, n), iw.narrow(1, r0, n), keys.narrow(1, 0, seen), query_start + r0,
                                topk);
      const auto dt = accum_dtype(sel.scores);
      const auto p = support_target(q_rows.narrow(2, r0, n), k_t.narrow(-1, 0, seen), sel.support, dt);
      const auto log_q = support_log_softmax(sel.scores.to(dt), sel.support);
      // The block's share n / T of the mean over all B T rows, and its gradient with respect to the
      // scores in closed form: per row, softmax(scores) times the target's mass minus the target.
      const double share = 1.0 / static_cast<double>(B * T);
      auto part = kl_rows(p, log_q).sum() * share;
      auto grad = log_q.exp().masked_fill_(~sel.support, 0.0);  // the indexer's probabilities on the support
      saved.push_back(grad.mul_(p.sum(-1, /*keepdim=*/true) * share).sub_(p, share));
      loss = loss.defined() ? loss + part : part;
      supports.push_back(seen == L ? sel.support : torch::constant_pad_nd(sel.support, {0, L - seen}, 0));
    }
    auto support = supports.size() == 1 ? supports[0] : torch::cat(supports, 1);  // [B, T, L]
    ctx->save_for_backward(saved);
    ctx->saved_data["holder"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["block_rows"] = block_rows;
    ctx->saved_data["query_start"] = query_start;
    ctx->mark_non_differentiable({support});
    return {loss, support};
  }

  // The queries projected again (with a graph, under the forward's autocast state), then per block
  // the saved gradient (times the loss's) carried to them and the keys, by the backward kernel where
  // it serves (DecodeOptions::dsa_index_kernels, bf16), else through the block's scores recomputed
  // with a graph over leaves of its inputs; last, the queries' gradients into what they read.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &index_k = saved[1];
    auto holder = c10::static_intrusive_pointer_cast<QueriesHolder>(ctx->saved_data["holder"].toCapsule());
    DecodeOptionsGuard kernel_options(holder->kernel_options);
    Tensor iq, iw;
    torch::ScalarType compute;
    {
      AutocastStateScope autocast(holder->autocast);
      torch::AutoGradMode grad_mode(true);
      std::tie(iq, iw) = holder->queries(x);
      compute = product_dtype(iq, index_k);
    }
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const int64_t block_rows = ctx->saved_data["block_rows"].toInt(), T = iq.size(1), L = index_k.size(1);
    const int64_t query_start = ctx->saved_data["query_start"].toInt();
    // d_iq packed, as the kernel's dq_out takes it.
    auto d_iq = torch::empty(iq.sizes(), iq.options()), d_iw = torch::empty_like(iw);
    auto d_keys = torch::zeros(index_k.sizes(), index_k.options().dtype(accum_dtype(index_k)));
    const auto iq_c = iq.detach().to(compute), iw_c = iw.detach().to(compute), keys_c = index_k.to(compute);
    const bool kernel = decode_options().dsa_index_kernels && ops::dsa_index_backward_supported(iq_c, keys_c);
    // The kernel writes d(iq) into d_iq's rows itself where they share a dtype.
    const bool dq_in_place = kernel && d_iq.scalar_type() == iq_c.scalar_type();
    {
      torch::AutoGradMode grad_mode(!kernel);
      // saved: x, index_k, then one scores' gradient per block.
      for (int64_t r0 = 0, block = 2; r0 < T; r0 += block_rows, ++block) {
        const int64_t n = std::min(block_rows, T - r0), seen = std::min(L, query_start + r0 + n);
        const auto d = saved[block] * grads[0];  // [B, n, seen]
        std::vector<Tensor> g;                   // d(iq), d(iw), d(keys) of the block
        if (kernel) {
          auto k = ops::dsa_index_backward(iq_c.narrow(1, r0, n), iw_c.narrow(1, r0, n), keys_c.narrow(1, 0, seen), d,
                                           query_start + r0, dq_in_place ? d_iq.narrow(1, r0, n) : Tensor());
          g = {k.dq, k.dw, k.d_keys};
        } else {
          const auto iq_b = iq_c.narrow(1, r0, n).detach().requires_grad_(true);
          const auto iw_b = iw_c.narrow(1, r0, n).detach().requires_grad_(true);
          const auto keys_b = keys_c.narrow(1, 0, seen).detach().requires_grad_(true);
          auto scores = lightning_indexer_scores(iq_b, iw_b, keys_b);
          g = torch::autograd::grad({scores}, {iq_b, iw_b, keys_b}, {d.to(scores.scalar_type())});
        }
        if (!dq_in_place) d_iq.narrow(1, r0, n).copy_(g[0]);
        d_iw.narrow(1, r0, n).copy_(g[1]);
        d_keys.narrow(1, 0, seen) += g[2];
      }
    }
    std::vector<Tensor> roots, root_grads;
    for (auto [t, g] : {std::pair{iq, d_iq}, std::pair{iw, d_iw}})
      if (t.requires_grad()) roots.push_back(t), root_grads.push_back(g);
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    return {Tensor(), d_keys.to(index_k.scalar_type()), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

}  // namespace

int64_t indexer_loss_row_bytes(int64_t batch, int64_t heads, int64_t index_heads, int64_t keys, bool kernels) {
  // fp32-sized per key: the main attention's scores, mask and softmax per head (3 H); the index
  // scores, the target, the log-distribution, the KL's terms and the saved gradient (~8); the
  // dense logits and their ReLU per index head (2 H_I) where the kernels do not select.
  return batch * std::max<int64_t>(keys, 1) * (3 * heads + 8 + (kernels ? 0 : 2 * index_heads)) * 4;
}

IndexerLoss indexer_loss_blocked(const IndexerQueries& queries, const Tensor& x, const Tensor& index_k,
                                 const Tensor& q, const Tensor& k, int64_t query_start, int64_t topk, double scale,
                                 int64_t block_bytes) {
  LT2_CHECK(block_bytes > 0, "indexer_loss_blocked: block_bytes must be > 0, found ", block_bytes);
  LT2_CHECK(!x.requires_grad(), "indexer_loss_blocked: x must not require a gradient (detach it: the queries' "
            "gradients reach only what the query function reads besides x)");
  auto holder = c10::make_intrusive<QueriesHolder>();
  holder->queries = queries;
  auto out = IndexerLossFunction::apply(x, index_k, q.detach(), k.detach(), query_start, topk, scale, block_bytes,
                                        holder);
  return {out[0], out[1]};
}

int64_t nsa_num_blocks(int64_t length, int64_t block, int64_t stride) {
  return length >= block ? (length - block) / stride + 1 : 0;
}

Tensor nsa_unfold_blocks(const Tensor& x, int64_t block, int64_t stride) {
  const int64_t NC = nsa_num_blocks(x.size(1), block, stride);
  if (NC == 0) return x.new_empty({x.size(0), 0, x.size(2), block, x.size(3)});
  auto used = x.narrow(1, 0, (NC - 1) * stride + block);  // [B, L', H, D]
  return used.unfold(1, block, stride).permute({0, 1, 2, 4, 3});  // [B, NC, H, block, D]
}

Tensor nsa_overlap_matrix(int64_t n_cmp, int64_t n_slc, int64_t l, int64_t d, int64_t l_sel,
                          torch::TensorOptions opts) {
  LT2_CHECK(l % d == 0 && l_sel % d == 0, "nsa: the compression stride ", d,
            " must divide the compression block ", l, " and the selection block ", l_sel);
  // The last one asked for: every NSA layer and loop of a decode step (whose shapes are fixed by
  // the cache length) asks for the same matrix, so a step builds it once, not per layer.
  struct Last {
    std::vector<int64_t> key;
    torch::Device device{torch::kCPU};
    torch::ScalarType dtype = torch::kFloat32;
    Tensor matrix;
  };
  thread_local Last last;
  const std::vector<int64_t> key{n_cmp, n_slc, l, d, l_sel};
  const auto dtype = opts.dtype().toScalarType();
  if (last.matrix.defined() && last.key == key && last.device == opts.device() && last.dtype == dtype)
    return last.matrix;
  torch::NoGradGuard ng;
  const int64_t units_cmp = l / d, units_sel = l_sel / d;  // block lengths in stride units
  auto lopts = torch::TensorOptions().dtype(torch::kLong).device(opts.device());
  auto i = torch::arange(n_cmp, lopts).unsqueeze(1);  // compression block i: units [i, i + l/d)
  auto j = torch::arange(n_slc, lopts).unsqueeze(0);  // selection block j: units [j l'/d, (j+1) l'/d)
  auto lo = torch::maximum(i, j * units_sel);
  auto hi = torch::minimum(i + units_cmp, (j + 1) * units_sel);
  last = Last{key, opts.device(), dtype, (hi - lo).clamp_min(0).to(dtype)};  // [NC, NS]
  return last.matrix;
}

namespace {

// Selection scores (forced visible blocks +inf) and visibility, both [B, H_kv, T, NS].
std::pair<Tensor, Tensor> nsa_selection_scores(const Tensor& importance, const Tensor& q_pos, int64_t block,
                                               int64_t n_local) {
  const int64_t NS = importance.size(-1);
  auto j = torch::arange(NS, q_pos.options());               // [NS]
  auto own = torch::div(q_pos, block, "floor").unsqueeze(-1);  // [..., T, 1] block holding the query
  auto visible = j <= own;                                   // [..., T, NS]
  auto forced = visible & ((j == 0) | (j > own - n_local));
  auto scores = importance.masked_fill(forced, std::numeric_limits<double>::infinity());
  return {scores, visible.expand_as(scores)};
}

// nsa_select_blocks on its CUDA kernel (kernels/prefill.h) where DecodeOptions::nsa_selection_kernels is
// on and it takes the inputs (CUDA, an fp32, bf16 or fp16 importance, at most kNsaSelectMaxBlocks blocks a
// row, positions broadcastable to [B, H_kv, T]); undefined otherwise.
Tensor select_blocks_by_kernel(const Tensor& importance, const Tensor& q_pos, int64_t block, int64_t n_select,
                               int64_t n_local) {
#ifdef LT2_WITH_CUDA
  const auto dt = importance.scalar_type();
  if (!decode_options().nsa_selection_kernels || !importance.is_cuda() || importance.dim() != 4 ||
      !(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf) || q_pos.device() != importance.device())
    return {};
  const int64_t B = importance.size(0), H_kv = importance.size(1), T = importance.size(2), NS = importance.size(3);
  if (!kernels::nsa_select_blocks_supported(B * H_kv * T, NS) || B > INT32_MAX || H_kv > INT32_MAX ||
      T > INT32_MAX || block > INT32_MAX || q_pos.dim() > 3 || !at::is_expandable_to(q_pos.sizes(), {B, H_kv, T}))
    return {};
  c10::cuda::CUDAGuard guard(importance.device());
  const auto scores = importance.contiguous();
  const auto positions = q_pos.to(torch::kLong).expand({B, H_kv, T});
  auto selected = torch::empty({B, H_kv, T, NS}, importance.options().dtype(torch::kBool));
  kernels::NsaSelectParams p{};
  p.importance = scores.data_ptr(), p.dtype = ops::detail::kernel_dtype(dt);
  p.positions = positions.data_ptr<int64_t>();
  p.pos_stride_b = positions.stride(0), p.pos_stride_h = positions.stride(1), p.pos_stride_t = positions.stride(2);
  p.selected = selected.data_ptr<bool>();
  p.batch = static_cast<int>(B), p.kv_heads = static_cast<int>(H_kv), p.length = static_cast<int>(T);
  p.blocks = static_cast<int>(NS), p.block = static_cast<int>(block);
  p.n_select = static_cast<int>(std::clamp<int64_t>(n_select, 0, NS));
  p.n_local = static_cast<int>(std::clamp<int64_t>(n_local, 0, INT32_MAX));
  kernels::nsa_select_blocks(p, ops::detail::current_stream(importance));
  return selected;
#else
  (void)importance, (void)q_pos, (void)block, (void)n_select, (void)n_local;
  return {};
#endif
}

}  // namespace

Tensor nsa_select_blocks(const Tensor& importance, const Tensor& q_pos, int64_t block,
                         int64_t n_select, int64_t n_local) {
  if (auto selected = select_blocks_by_kernel(importance, q_pos, block, n_select, n_local); selected.defined())
    return selected;
  auto [scores, visible] = nsa_selection_scores(importance, q_pos, block, n_local);
  return topk_mask(scores, visible, n_select);
}

Tensor nsa_select_block_indices(const Tensor& importance, const Tensor& q_pos, int64_t block,
                                int64_t n_select, int64_t n_local) {
  auto [scores, visible] = nsa_selection_scores(importance, q_pos, block, n_local);
  return topk_indices(scores, visible, n_select);
}

namespace {

// nsa_selection_bias's libtorch form: one broadcast `where` written as [B, H_kv, G, n, blocks, block], the
// selection broadcast over a block's keys and a [n, blocks x block] causal bias over batch and heads (no
// [B, H, n, keys] boolean and no gather of the blocks out to the keys).
void selection_bias_by_where(const Tensor& selected, int64_t G, int64_t L, int64_t T, int64_t r0, int64_t n,
                             int64_t blocks, int64_t block, const Tensor& bias) {
  const int64_t B = selected.size(0), H_kv = selected.size(1);
  const auto opts = bias.options();
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const auto lopts = torch::TensorOptions().dtype(torch::kLong).device(selected.device());
  const auto k_pos = torch::arange(blocks * block, lopts), q_pos = torch::arange(L - T + r0, L - T + r0 + n, lopts);
  const auto causal = torch::where(window_mask(q_pos, k_pos, 0), torch::zeros({}, opts), torch::full({}, neg_inf, opts));
  const std::vector<int64_t> shape{B, H_kv, G, n, blocks, block};
  auto per_block = bias.view(shape);
  at::where_out(per_block,
                selected.narrow(2, r0, n).narrow(3, 0, blocks).unsqueeze(2).unsqueeze(-1).expand(shape),
                causal.view({1, 1, 1, n, blocks, block}).expand(shape), torch::full({}, neg_inf, opts));
}

// nsa_selection_bias on its CUDA kernel (kernels/prefill.h: selection_bias) where it takes the inputs;
// false otherwise.
bool selection_bias_by_kernel(const Tensor& selected, int64_t G, int64_t L, int64_t T, int64_t r0, int64_t n,
                              int64_t blocks, int64_t block, const Tensor& bias) {
#ifdef LT2_WITH_CUDA
  const int64_t B = selected.size(0), H_kv = selected.size(1), H = H_kv * G, cols = blocks * block;
  if (!selected.is_cuda() || !selected.is_contiguous() || !ops::detail::kernel_dtype_ok(bias.scalar_type()) ||
      !kernels::selection_bias_supported(B * H * n, cols, block) || H > INT32_MAX || T > INT32_MAX ||
      bias.stride(2) > INT32_MAX || bias.stride(2) % 8 != 0 || reinterpret_cast<uintptr_t>(bias.data_ptr()) % 16 != 0)
    return false;
  c10::cuda::CUDAGuard guard(selected.device());
  kernels::SelectionBiasParams p{};
  p.selected = selected.data_ptr<bool>();
  p.selected_rows = selected.size(2), p.selected_blocks = selected.size(3);
  p.bias = bias.data_ptr(), p.dtype = ops::detail::kernel_dtype(bias.scalar_type());
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(H), p.kv_heads = static_cast<int>(H_kv);
  p.rows = static_cast<int>(n), p.row0 = static_cast<int>(r0), p.cols = static_cast<int>(cols);
  p.pitch = static_cast<int>(bias.stride(2)), p.block = static_cast<int>(block);
  p.first_position = L - T + r0;
  kernels::selection_bias(p, ops::detail::current_stream(selected));
  return true;
#else
  (void)selected, (void)G, (void)L, (void)T, (void)r0, (void)n, (void)blocks, (void)block, (void)bias;
  return false;
#endif
}

}  // namespace

Tensor nsa_selection_bias(const Tensor& selected, int64_t block, int64_t G, int64_t L, int64_t T, int64_t r0, int64_t n,
                          int64_t keys, torch::ScalarType dt, bool kernel) {
  LT2_CHECK(selected.dim() == 4 && selected.scalar_type() == torch::kBool && block > 0 && G > 0 && T <= L &&
                r0 >= 0 && n >= 0 && r0 + n <= selected.size(2) && keys >= 0 && keys <= L - T + r0 + n &&
                (keys + block - 1) / block <= selected.size(3),
            "nsa_selection_bias: selected [B, H_kv, T, ceil(L / block)] bool with rows r0 .. r0 + n and keys up to the "
            "last row's position, found selected ", selected.sizes(), " ", selected.scalar_type(), ", block ", block,
            ", L ", L, ", T ", T, ", rows ", r0, " + ", n, ", keys ", keys);
  const int64_t B = selected.size(0), H_kv = selected.size(1), blocks = (keys + block - 1) / block;
  auto bias = torch::empty({B, H_kv * G, n, (blocks * block + 15) / 16 * 16}, selected.options().dtype(dt))
                  .narrow(-1, 0, blocks * block);
  if (!kernel || !selection_bias_by_kernel(selected, G, L, T, r0, n, blocks, block, bias))
    selection_bias_by_where(selected, G, L, T, r0, n, blocks, block, bias);
  return bias.narrow(-1, 0, keys);
}

namespace {

#ifdef LT2_WITH_CUDA
// selected_block_attention on libtorch's fused kernels with an additive mask, rows in blocks of `rows`:
// q [B, H, T, D], k and v repeated to the H query heads. Each block goes to cuDNN's attention where
// libtorch's SDPA would take it for the first block's inputs (on Hopper), else to the memory-efficient
// kernel. Saves q, k, v, the output, each block's log-sum-exp and `selected`; the backward makes each
// block's mask again.
struct SelectedBlockFunction : public torch::autograd::Function<SelectedBlockFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& selected, int64_t block, double scale, int64_t rows) {
    c10::cuda::CUDAGuard guard(q.device());
    const int64_t T = q.size(2), L = k.size(2), G = q.size(1) / selected.size(1);
    // [B, T, H, D_v] storage, as SDPA's kernels write theirs: the caller's [B, T, H, D_v] is a view.
    auto out = torch::empty({q.size(0), T, q.size(1), v.size(3)}, q.options()).transpose(1, 2);
    std::vector<Tensor> saved{q, k, v, out, selected};
    // The masks' switch as in force here, for the backward (which runs on autograd's thread).
    const bool kernel_masks = decode_options().nsa_selection_kernels;
    bool cudnn = false;
    for (int64_t r0 = 0; r0 < T; r0 += rows) {
      const int64_t n = std::min(rows, T - r0), keys = L - T + r0 + n;
      const auto bias = nsa_selection_bias(selected, block, G, L, T, r0, n, keys, q.scalar_type(), kernel_masks);
      const auto qr = q.narrow(2, r0, n), kr = k.narrow(2, 0, keys), vr = v.narrow(2, 0, keys);
      if (r0 == 0)
        cudnn = at::_fused_sdp_choice(qr, kr, vr, bias, 0.0, false, scale) ==
                static_cast<int64_t>(at::SDPBackend::cudnn_attention);
      Tensor o, lse, seed, offset;
      if (cudnn) {
        auto r = at::_scaled_dot_product_cudnn_attention(qr, kr, vr, bias, /*compute_log_sumexp=*/true,
                                                         /*dropout_p=*/0.0, /*is_causal=*/false,
                                                         /*return_debug_mask=*/false, scale);
        o = std::get<0>(r), lse = std::get<1>(r), seed = std::get<6>(r), offset = std::get<7>(r);
      } else {
        std::tie(o, lse, seed, offset) = at::_scaled_dot_product_efficient_attention(
            qr, kr, vr, bias, /*compute_log_sumexp=*/true, /*dropout_p=*/0.0, /*is_causal=*/false, scale);
      }
      out.narrow(2, r0, n).copy_(o);
      saved.insert(saved.end(), {lse, seed, offset});
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["block"] = block;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["cudnn"] = cudnn;
    ctx->saved_data["kernel_masks"] = kernel_masks;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &selected = saved[4];
    const int64_t block = ctx->saved_data["block"].toInt(), rows = ctx->saved_data["rows"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool cudnn = ctx->saved_data["cudnn"].toBool(), kernel_masks = ctx->saved_data["kernel_masks"].toBool();
    c10::cuda::CUDAGuard guard(q.device());
    const int64_t T = q.size(2), L = k.size(2), G = q.size(1) / selected.size(1);
    const auto dout = grads[0].transpose(1, 2).contiguous().transpose(1, 2);  // the output's layout
    // The row blocks from the last, whose keys are all L: its dk and dv start the fp32 sums (no zeros to
    // add to), or are the gradients where it is the only block; the earlier blocks add to their keys.
    auto dq = torch::empty_like(q);
    const int64_t blocks = (T + rows - 1) / rows;
    Tensor dk, dv;
    for (int64_t b = blocks - 1; b >= 0; --b) {
      const int64_t r0 = b * rows, n = std::min(rows, T - r0), keys = L - T + r0 + n;
      const auto bias = nsa_selection_bias(selected, block, G, L, T, r0, n, keys, q.scalar_type(), kernel_masks);
      const Tensor &lse = saved[5 + 3 * b], &seed = saved[6 + 3 * b], &offset = saved[7 + 3 * b];
      const auto dout_r = dout.narrow(2, r0, n), qr = q.narrow(2, r0, n), kr = k.narrow(2, 0, keys),
                 vr = v.narrow(2, 0, keys), out_r = out.narrow(2, r0, n);
      Tensor dq_r, dk_r, dv_r, unused;
      if (cudnn)
        std::tie(dq_r, dk_r, dv_r) = at::_scaled_dot_product_cudnn_attention_backward(
            dout_r, qr, kr, vr, out_r, lse, seed, offset, bias, Tensor(), Tensor(), n, keys, /*dropout_p=*/0.0,
            /*is_causal=*/false, scale);
      else
        std::tie(dq_r, dk_r, dv_r, unused) = at::_scaled_dot_product_efficient_attention_backward(
            dout_r, qr, kr, vr, bias, out_r, lse, seed, offset, /*dropout_p=*/0.0, {true, true, true, false},
            /*is_causal=*/false, scale);
      dq.narrow(2, r0, n).copy_(dq_r);
      if (!dk.defined()) {
        dk = blocks == 1 ? dk_r : dk_r.to(torch::kFloat32);
        dv = blocks == 1 ? dv_r : dv_r.to(torch::kFloat32);
      } else {
        dk.narrow(2, 0, keys).add_(dk_r);
        dv.narrow(2, 0, keys).add_(dv_r);
      }
    }
    if (!dk.defined()) dk = torch::zeros_like(k), dv = torch::zeros_like(v);  // no query rows
    return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type()), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

#endif

}  // namespace

bool selected_block_kernels_serve(const Tensor& q, const Tensor& k, const Tensor& v) {
#ifdef LT2_WITH_CUDA
  const auto dt = q.scalar_type();
  return q.is_cuda() && (dt == torch::kBFloat16 || dt == torch::kHalf) &&
         k.scalar_type() == dt && v.scalar_type() == dt && q.size(3) == k.size(3) && q.size(3) % 8 == 0 &&
         v.size(3) % 8 == 0 && q.size(2) <= k.size(2);
#else
  (void)q, (void)k, (void)v;
  return false;
#endif
}

Tensor selected_block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& selected,
                                int64_t block, double scale, int64_t block_bytes) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), H_kv = k.size(1), L = k.size(2);
  LT2_CHECK(block > 0 && H % H_kv == 0 && T <= L && selected.dim() == 4 && selected.size(0) == B &&
                selected.size(1) == H_kv && selected.size(2) == T && selected.size(3) == (L + block - 1) / block,
            "selected_block_attention: q [B, H, T, D], k and v [B, H_kv, L, D] (H_kv | H, T <= L) and selected [B, "
            "H_kv, T, ceil(L / block)], found ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", selected.sizes(),
            " (block ", block, ")");
  const int64_t G = H / H_kv;
#ifdef LT2_WITH_CUDA
  if (selected_block_kernels_serve(q, k, v)) {
    const int64_t row_bytes = B * H * ((L + 15) / 16 * 16) * q.element_size();
    const int64_t rows = std::clamp<int64_t>(block_bytes / row_bytes, 1, std::max<int64_t>(T, 1));
    auto heads = [&](const Tensor& x) { return G == 1 ? x : x.repeat_interleave(G, 1); };
    if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    return SelectedBlockFunction::apply(q, heads(k), heads(v), selected, block, scale, rows).transpose(1, 2);
  }
#endif
  return masked_attention(
      q, k, v,
      nsa_selection_bias(selected, block, G, L, T, 0, T, L, q.scalar_type(), decode_options().nsa_selection_kernels),
      scale);
}

}  // namespace lt2
