#include "lt2/ops/chunking.h"

#include <limits>

#include "lt2/ops/decode_options.h"
#include "lt2/ops/fused_common.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {
// x in dtype `dt`, in one copy (none where it already is in dt). Packed only where it converts: without a
// conversion libtorch's `to` keeps a permuted or expanded view as it is (its format counts as contiguous).
Tensor in_dtype(const Tensor& x, torch::ScalarType dt) {
  return x.to(x.options().dtype(dt), /*non_blocking=*/false, /*copy=*/false, torch::MemoryFormat::Contiguous);
}
}  // namespace

Tensor to_chunks(const Tensor& x, int64_t chunk, torch::ScalarType dt) {
  LT2_CHECK(chunk > 0, "chunk size must be > 0, found ", chunk);
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  const int64_t N = (T + chunk - 1) / chunk;
  auto y = N * chunk != T ? torch::constant_pad_nd(x, {0, 0, 0, 0, 0, N * chunk - T}) : x;
  return in_dtype(y.view({B, N, chunk, H, D}).permute({0, 3, 1, 2, 4}), dt);  // [B, H, N, C, D]
}

Tensor from_chunks(const Tensor& y, int64_t T, torch::ScalarType dt) {
  const int64_t B = y.size(0), H = y.size(1), N = y.size(2), C = y.size(3), D = y.size(4);
  return in_dtype(y.permute({0, 2, 3, 1, 4}), dt).view({B, N * C, H, D}).narrow(1, 0, T);
}

Tensor chunk_outputs(const Tensor& q_start, const Tensor& states, const Tensor& a, const Tensor& v) {
  auto flat = [](const Tensor& t) { return t.reshape({-1, t.size(-2), t.size(-1)}); };
  auto shape = q_start.sizes().vec();
  shape.back() = v.size(-1);
  return torch::baddbmm(torch::bmm(flat(a), flat(v)), flat(q_start), flat(states)).view(shape);
}

#ifdef LT2_WITH_CUDA
namespace {
// Autograd over the chunk gate kernels (kernels/prefill.h): g [B, T, H, D] packed fp32 in, G
// [B, H, N, C, D] out; nothing is saved but the sizes.
struct ChunkGateFunction : public torch::autograd::Function<ChunkGateFunction> {
  static kernels::ChunkGateParams params(int64_t B, int64_t T, int64_t H, int64_t D, int64_t chunk) {
    kernels::ChunkGateParams p{};
    p.batch = B, p.tokens = T;
    p.heads = static_cast<int>(H), p.dim = static_cast<int>(D), p.chunk = static_cast<int>(chunk);
    return p;
  }
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& g, int64_t chunk) {
    c10::cuda::CUDAGuard guard(g.device());
    const int64_t B = g.size(0), T = g.size(1), H = g.size(2), D = g.size(3), N = (T + chunk - 1) / chunk;
    auto G = torch::empty({B, H, N, chunk, D}, g.options());
    auto p = params(B, T, H, D, chunk);
    p.in = g.data_ptr<float>(), p.out = G.data_ptr<float>();
    kernels::chunk_gate_forward(p, detail::current_stream(g));
    ctx->saved_data["sizes"] = std::vector<int64_t>{B, T, H, D, chunk};
    return G;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->saved_data["sizes"].toIntVector();
    const auto dG = grads[0].to(torch::kFloat32).contiguous();
    c10::cuda::CUDAGuard guard(dG.device());
    auto dg = torch::empty({s[0], s[1], s[2], s[3]}, dG.options());
    auto p = params(s[0], s[1], s[2], s[3], s[4]);
    p.in = dG.data_ptr<float>(), p.out = dg.data_ptr<float>();
    kernels::chunk_gate_backward(p, detail::current_stream(dG));
    return {dg, Tensor()};
  }
};
}  // namespace
#endif

Tensor chunk_cumulative_gate(const Tensor& g, int64_t B, int64_t T, int64_t H, int64_t chunk,
                             torch::ScalarType dt, const torch::Device& device) {
  const int64_t N = (T + chunk - 1) / chunk;
  if (!g.defined()) return torch::zeros({B, H, N, chunk, 1}, torch::TensorOptions().dtype(dt).device(device));
  LT2_CHECK(g.dim() == 3 || g.dim() == 4, "log-gate must be [B, T, H] or [B, T, H, K], found ",
            g.sizes());
  auto g4 = g.dim() == 3 ? g.unsqueeze(-1) : g;  // [B, T, H, 1 or K]
#ifdef LT2_WITH_CUDA
  if (decode_options().chunk_gate && g4.is_cuda() && dt == torch::kFloat32 && g4.size(2) <= INT32_MAX &&
      g4.size(3) <= INT32_MAX && chunk <= INT32_MAX)
    return ChunkGateFunction::apply(in_dtype(g4, dt).contiguous(), chunk);  // packed rows for the kernel
#endif
  return to_chunks(g4, chunk, dt).cumsum(-2);   // [B, H, N, C, 1 or K]
}

DocumentChunks::DocumentChunks(const std::vector<int64_t>& cu_seqlens, int64_t T, int64_t chunk,
                               const torch::Device& device, const char* op)
    : op_(op), chunk_(chunk), T_(T) {
  LT2_CHECK(chunk > 0, op, ": chunk size must be > 0, found ", chunk);
  LT2_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == T, op,
            ": cu_seqlens must run from 0 to T = ", T, " with at least one document, found ",
            torch::IntArrayRef(cu_seqlens));
  documents_ = static_cast<int64_t>(cu_seqlens.size()) - 1;
  std::vector<int64_t> slots, where(T), firsts, lasts, present_docs;
  for (int64_t d = 0; d < documents_; ++d) {
    const int64_t begin = cu_seqlens[d], end = cu_seqlens[d + 1];
    LT2_CHECK(begin <= end, op, ": cu_seqlens must not descend, found ", torch::IntArrayRef(cu_seqlens));
    if (begin == end) continue;
    present_docs.push_back(d);
    firsts.push_back(static_cast<int64_t>(slots.size()) / chunk);
    for (int64_t t = begin; t < end; ++t) {
      where[t] = static_cast<int64_t>(slots.size());
      slots.push_back(t);
    }
    while (slots.size() % chunk != 0) slots.push_back(T);
    lasts.push_back(static_cast<int64_t>(slots.size()) / chunk - 1);
  }
  chunks_ = static_cast<int64_t>(slots.size()) / chunk;
  const auto on_device = [&](const std::vector<int64_t>& x) { return torch::tensor(x, torch::kLong).to(device); };
  present = on_device(present_docs);
  first_chunk = torch::tensor(firsts, torch::kLong);
  last_chunk = on_device(lasts);
  slots_ = on_device(slots);
  where_ = on_device(where);
}

Tensor DocumentChunks::to_chunks(const Tensor& x, torch::ScalarType dt) const {
  LT2_CHECK(x.dim() == 4 && x.size(0) == 1 && x.size(1) == T_, op_, ": packed documents sit in one row of T = ", T_,
            " tokens [1, T, H, X], found ", x.sizes());
  const int64_t H = x.size(2), X = x.size(3);
  return in_dtype(to_padded_rows(x.to(dt)).view({1, chunks_, chunk_, H, X}).permute({0, 3, 1, 2, 4}), dt);
}

Tensor DocumentChunks::from_chunks(const Tensor& y, torch::ScalarType dt) const {
  const int64_t H = y.size(1), X = y.size(4);
  return from_padded_rows(in_dtype(y.permute({0, 2, 3, 1, 4}), dt).view({1, chunks_ * chunk_, H, X}));
}

Tensor DocumentChunks::to_padded_rows(const Tensor& x) const {
  LT2_CHECK(x.dim() >= 2 && x.size(0) == 1 && x.size(1) == T_, op_, ": packed documents sit in one row of T = ", T_,
            " tokens [1, T, ...], found ", x.sizes());
  auto pad = x.sizes().vec();
  pad[1] = 1;
  return torch::cat({x, torch::zeros(pad, x.options())}, 1).index_select(1, slots_);  // token T: the zero row
}

Tensor DocumentChunks::from_padded_rows(const Tensor& y) const { return y.index_select(1, where_); }

Tensor DocumentChunks::cumulative_gate(const Tensor& g, int64_t H, torch::ScalarType dt) const {
  if (!g.defined()) return torch::zeros({1, H, chunks_, chunk_, 1}, torch::TensorOptions().dtype(dt).device(slots_.device()));
  LT2_CHECK(g.dim() == 3 || g.dim() == 4, op_, ": log-gate must be [1, T, H] or [1, T, H, K], found ", g.sizes());
  return to_chunks(g.dim() == 3 ? g.unsqueeze(-1) : g, dt).cumsum(-2);  // [1, H, N, C, 1 or K]
}

namespace {

// [C, C] mask of the kept entries: j <= i (inclusive) or j < i.
Tensor causal_keep(int64_t C, bool inclusive, const torch::Device& device) {
  auto ones = torch::ones({C, C}, torch::TensorOptions().dtype(torch::kBool).device(device));
  return inclusive ? ones.tril() : ones.tril(-1);
}

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

#ifdef LT2_WITH_CUDA
// The kernels' view of packed fp32 G [count, C, K] and of a and b: packed fp32 [count, C, K] too, or
// token rows [B, T, H, K] in place with one row stride (token_rows_in_place), of one dtype (fp32 or
// bf16), with G [B, H, N, C, K]; the scores scaled by `scale`.
kernels::ChannelScoresParams channel_scores_params(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive,
                                                   double scale) {
  kernels::ChannelScoresParams p{};
  p.a = a.data_ptr(), p.b = b.data_ptr(), p.g = G.data_ptr<float>();
  p.chunk = static_cast<int>(G.size(-2)), p.dim = static_cast<int>(G.size(-1));
  p.count = G.numel() / (G.size(-2) * G.size(-1));
  p.inclusive = inclusive;
  p.scale = static_cast<float>(scale);
  p.dtype = detail::kernel_dtype(a.scalar_type());
  p.token_rows = a.dim() == 4;
  if (p.token_rows) p.seq = a.size(1), p.heads = static_cast<int>(a.size(2)), p.row_stride = a.stride(1);
  return p;
}

// The scores [count, C, C] fp32 by the forward kernel, and with `self_scores` b's strict scores with
// itself into it (the same shape) in the same pass.
Tensor channel_scores_by_kernel(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive, double scale = 1.0,
                                const Tensor& self_scores = Tensor()) {
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t C = G.size(-2);
  auto scores = torch::empty({G.numel() / (C * G.size(-1)), C, C}, G.options());
  auto p = channel_scores_params(a, b, G, inclusive, scale);
  p.scores = scores.data_ptr<float>();
  if (self_scores.defined()) p.self_scores = self_scores.data_ptr<float>();
  kernels::channel_scores_forward(p, detail::current_stream(a));
  return scores;
}

// The backward kernel from d_scores (and with d_self_scores b's self scores' gradient in the same pass)
// into da, db (a's and b's layout and dtype) and dG, written or added.
void channel_scores_backward_by_kernel(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive,
                                       const Tensor& d_scores, const Tensor& da, const Tensor& db, const Tensor& dG,
                                       bool accumulate, double scale = 1.0,
                                       const Tensor& d_self_scores = Tensor()) {
  c10::cuda::CUDAGuard guard(a.device());
  kernels::ChannelScoresBackwardParams bp{};
  bp.forward = channel_scores_params(a, b, G, inclusive, scale);
  const int64_t scores = bp.forward.count * bp.forward.chunk * bp.forward.chunk;
  for (const Tensor* d : {&d_scores, &d_self_scores})
    LT2_CHECK(!d->defined() || (d->numel() == scores && d->device() == a.device()), "channel_scores_backward: ",
              "the scores' gradients must be [count, C, C] (", scores, " elements) on a's device, found ",
              d->sizes(), " on ", d->device());
  const auto ds = d_scores.to(torch::kFloat32).contiguous();
  const auto d_self = d_self_scores.defined() ? d_self_scores.to(torch::kFloat32).contiguous() : Tensor();
  bp.d_scores = ds.data_ptr<float>();
  bp.d_self_scores = d_self.defined() ? d_self.data_ptr<float>() : nullptr;
  bp.da = da.data_ptr(), bp.db = db.data_ptr(), bp.dg = dG.data_ptr<float>();
  bp.accumulate = accumulate;
  kernels::channel_scores_backward(bp, detail::current_stream(a));
}

// Autograd over the per-channel score kernels (kernels/prefill.h has the formulas): a, b and G as
// channel_scores_params takes them are all that is saved; the exponentials are recomputed in the
// backward, and a's and b's gradients come in their layout and dtype (token rows as wide apart as theirs:
// column slices of a buffer as wide as their rows). Returns [count, C, C] fp32.
struct ChannelScoresFunction : public torch::autograd::Function<ChannelScoresFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& a, const Tensor& b, const Tensor& G,
                        bool inclusive) {
    ctx->save_for_backward({a, b, G});
    ctx->saved_data["inclusive"] = inclusive;
    return channel_scores_by_kernel(a, b, G, inclusive);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &a = saved[0], &b = saved[1], &G = saved[2];
    auto da = gradient_like(a, a.scalar_type()), db = gradient_like(b, b.scalar_type());
    auto dG = torch::empty_like(G);
    channel_scores_backward_by_kernel(a, b, G, ctx->saved_data["inclusive"].toBool(), grads[0], da, db, dG,
                                      /*accumulate=*/false);
    return {da, db, dG, Tensor()};
  }
};

// Whether the kernels can read a and b as token rows under G: CUDA, one dtype (fp32 or bf16), rows in
// place with one stride, G fp32 on their device (the switches aside).
bool score_rows_readable(const Tensor& a, const Tensor& b, const Tensor& G) {
  const auto dt = a.scalar_type();
  return a.is_cuda() && (dt == torch::kFloat32 || dt == torch::kBFloat16) && b.scalar_type() == dt &&
         token_rows_in_place(a) && token_rows_in_place(b) && a.stride(1) == b.stride(1) &&
         G.scalar_type() == torch::kFloat32 && G.device() == a.device();
}

// Whether the kernels take the gate G [..., C, K]: on, CUDA, fp32, C within the kernels' bound and the
// chunk count within a grid.
bool channel_scores_kernel_takes(const Tensor& G) {
  if (!decode_options().channel_scores || !G.is_cuda() || G.scalar_type() != torch::kFloat32 ||
      G.size(-2) > kernels::kMaxChannelScoresChunk || G.size(-1) > INT32_MAX)
    return false;
  return G.numel() / (G.size(-2) * G.size(-1)) <= INT32_MAX;
}

// Whether they take these chunk-layout scores: the gate, and a and b fp32 of its shape.
bool channel_scores_kernel_applies(const Tensor& a, const Tensor& b, const Tensor& G) {
  return channel_scores_kernel_takes(G) && a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32 &&
         a.sizes() == G.sizes() && b.sizes() == G.sizes();
}

Tensor channel_scores_cuda(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive) {
  const int64_t C = a.size(-2), K = a.size(-1);
  auto packed = [&](const Tensor& x) { return x.reshape({-1, C, K}).contiguous(); };
  auto shape = a.sizes().vec();
  shape.back() = C;
  return ChannelScoresFunction::apply(packed(a), packed(b), packed(G), inclusive).view(shape);
}
#endif

// Per-channel decayed scores by direct pairwise exponents: [..., C, C, K] intermediates.
Tensor channel_scores_pairwise(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive) {
  auto keep = causal_keep(a.size(-2), inclusive, a.device());
  auto rel = G.unsqueeze(-2) - G.unsqueeze(-3);              // [..., C, C, K]: G_i[d] - G_j[d]
  auto decay = rel.masked_fill(keep.logical_not().unsqueeze(-1), kNegInf).exp();
  return (a.unsqueeze(-2) * b.unsqueeze(-3) * decay).sum(-1);  // [..., C, C]
}

}  // namespace

Tensor decayed_scores(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive) {
  const int64_t C = a.size(-2), K = a.size(-1);
  if (G.size(-1) == 1) {
    auto keep = causal_keep(C, inclusive, a.device());
    auto rel = G - G.transpose(-1, -2);                      // [..., C, C]: G_i - G_j
    return torch::matmul(a, b.transpose(-1, -2)) * rel.masked_fill(keep.logical_not(), kNegInf).exp();
  }
#ifdef LT2_WITH_CUDA
  if (channel_scores_kernel_applies(a, b, G)) return channel_scores_cuda(a, b, G, inclusive);
#endif
  // Per-channel decay. Split the chunk into S sub-chunks of c = 16 tokens (fla's KDA layout):
  // diagonal c x c blocks pairwise, off-diagonal blocks (I > J) as a matmul after factoring
  //   exp(G_i - G_j) = exp(G_i - G_n) exp(G_n - G_j),  n = the first token of sub-chunk I,
  // where both factors have exponents <= 0 (G is non-increasing). Intermediates shrink from
  // [C, C, K] to [C, c, K] + [S, C, K] per chunk.
  constexpr int64_t c = 16;
  if (C <= c || C % c != 0) return channel_scores_pairwise(a, b, G, inclusive);
  const int64_t S = C / c;
  auto batch = a.sizes().slice(0, a.dim() - 2).vec();
  auto sub = [&](const Tensor& x) {
    auto shape = batch;
    shape.insert(shape.end(), {S, c, K});
    return x.reshape(shape);                                 // [..., S, c, K]
  };
  auto as = sub(a), bs = sub(b), Gs = sub(G);
  auto diagonal = channel_scores_pairwise(as, bs, Gs, inclusive);  // [..., S, c, c]
  auto G_ref = Gs.narrow(-2, 0, 1);                           // [..., S, 1, K] first token of I
  auto a_ref = as * (Gs - G_ref).exp();                       // [..., S, c, K]
  auto later = torch::ones({S, S}, torch::TensorOptions().dtype(torch::kBool).device(a.device())).tril(-1);
  auto rel = G_ref.unsqueeze(-3) - Gs.unsqueeze(-4);          // [..., S(I), S(J), c, K]: G_n(I) - G_j
  auto b_ref = bs.unsqueeze(-4) *
               rel.masked_fill(later.logical_not().view({S, S, 1, 1}), kNegInf).exp();
  auto off = torch::matmul(a_ref.unsqueeze(-3), b_ref.transpose(-1, -2));  // [..., S, S, c, c]
  auto eye = torch::eye(S, torch::TensorOptions().dtype(a.scalar_type()).device(a.device()));
  auto blocks = off + eye.view({S, S, 1, 1}) * diagonal.unsqueeze(-3);      // [..., S, S, c, c]
  auto shape = batch;
  shape.insert(shape.end(), {C, C});
  return blocks.transpose(-3, -2).reshape(shape);             // [..., S, c, S, c] -> [..., C, C]
}

Tensor decayed_scores_of_rows(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive) {
  const int64_t C = G.size(-2);
  LT2_CHECK(a.dim() == 4 && b.sizes() == a.sizes() && G.dim() == 5 && G.size(0) == a.size(0) &&
                G.size(1) == a.size(2) && G.size(2) == (a.size(1) + C - 1) / C && G.size(4) == a.size(3),
            "decayed_scores_of_rows: a and b [B, T, H, K] and G [B, H, ceil(T / C), C, K], found ", a.sizes(), ", ",
            b.sizes(), " and ", G.sizes());
#ifdef LT2_WITH_CUDA
  if (score_rows_kernel_serves(a, b, G))
    return ChannelScoresFunction::apply(a, b, G.contiguous(), inclusive).view({G.size(0), G.size(1), G.size(2), C, C});
#endif
  const auto a_chunks = to_chunks(a, C, G.scalar_type());
  return decayed_scores(a_chunks, b.is_same(a) ? a_chunks : to_chunks(b, C, G.scalar_type()), G, inclusive);
}

bool score_rows_kernel_serves(const Tensor& a, const Tensor& b, const Tensor& G) {
#ifdef LT2_WITH_CUDA
  return decode_options().channel_score_rows && channel_scores_kernel_takes(G) && score_rows_readable(a, b, G);
#else
  return false;
#endif
}

#ifdef LT2_WITH_CUDA
namespace {
// The scores of a's and b's token rows [B, H, N, C, C] by the forward kernel (`self_scores`, of that shape,
// takes b's strict scores with itself in the same pass), checked for what the kernels read in place.
Tensor score_rows_checked(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive, double scale,
                          const Tensor& self_scores, const char* op) {
  LT2_CHECK(score_rows_readable(a, b, G) && G.is_contiguous(), op,
            ": a and b token rows the kernels read in place, G packed fp32 on their device, found ", a.sizes(), ", ",
            b.sizes(), ", ", G.sizes());
  const int64_t C = G.size(-2);
  return channel_scores_by_kernel(a, b, G, inclusive, scale, self_scores)
      .view({G.size(0), G.size(1), G.size(2), C, C});
}
}  // namespace
#endif

Tensor score_rows_by_kernel(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive, double scale) {
#ifdef LT2_WITH_CUDA
  return score_rows_checked(a, b, G, inclusive, scale, Tensor(), "score_rows_by_kernel");
#else
  detail::no_cuda("score_rows_by_kernel");
#endif
}

std::pair<Tensor, Tensor> score_row_pair_by_kernel(const Tensor& q, const Tensor& k, const Tensor& G, double scale) {
#ifdef LT2_WITH_CUDA
  auto shape = G.sizes().vec();  // [B, H, N, C, K] -> [B, H, N, C, C]
  shape.back() = G.size(-2);
  auto kk = torch::empty(shape, G.options());
  return {score_rows_checked(q, k, G, /*inclusive=*/true, scale, kk, "score_row_pair_by_kernel"), kk};
#else
  detail::no_cuda("score_row_pair_by_kernel");
#endif
}

#ifdef LT2_WITH_CUDA
namespace {
void check_score_row_gradients(const Tensor& a, const Tensor& b, const Tensor& G, const Tensor& da, const Tensor& db,
                               const Tensor& dG, const char* op) {
  LT2_CHECK(score_rows_readable(a, b, G) && G.is_contiguous() && dG.sizes() == G.sizes() && dG.is_contiguous() &&
                da.strides() == a.strides() && db.strides() == b.strides(),
            op, ": da, db and dG must have a's, b's and G's layouts");
}
}  // namespace
#endif

void add_score_rows_backward(const Tensor& a, const Tensor& b, const Tensor& G, bool inclusive, const Tensor& d_scores,
                             const Tensor& da, const Tensor& db, const Tensor& dG, double scale) {
#ifdef LT2_WITH_CUDA
  check_score_row_gradients(a, b, G, da, db, dG, "add_score_rows_backward");
  channel_scores_backward_by_kernel(a, b, G, inclusive, d_scores, da, db, dG, /*accumulate=*/true, scale);
#else
  detail::no_cuda("add_score_rows_backward");
#endif
}

void add_score_row_pair_backward(const Tensor& q, const Tensor& k, const Tensor& G, const Tensor& d_qk,
                                 const Tensor& d_kk, const Tensor& dq, const Tensor& dk, const Tensor& dG,
                                 double scale) {
#ifdef LT2_WITH_CUDA
  check_score_row_gradients(q, k, G, dq, dk, dG, "add_score_row_pair_backward");
  LT2_CHECK(dq.data_ptr() != dk.data_ptr(), "add_score_row_pair_backward: dq and dk must be apart");
  channel_scores_backward_by_kernel(q, k, G, /*inclusive=*/true, d_qk, dq, dk, dG, /*accumulate=*/true, scale, d_kk);
#else
  detail::no_cuda("add_score_row_pair_backward");
#endif
}

namespace {
// Whether token rows t [B, T, H, D] are a column slice of wider rows (their tokens more than H D apart).
bool column_slice(const Tensor& t) { return t.dim() == 4 && t.stride(1) > t.size(2) * t.size(3); }
}  // namespace

Tensor gradient_like(const Tensor& t, torch::ScalarType dtype) {
  const auto options = t.options().dtype(dtype);
  if (!column_slice(t)) return torch::empty(t.sizes(), options);
  return torch::empty({t.size(0), t.size(1), t.stride(1)}, options)
      .narrow(2, 0, t.size(2) * t.size(3))
      .view(t.sizes());
}

std::vector<Tensor> shared_gradients(const std::vector<Tensor>& ts, torch::ScalarType dtype) {
  std::vector<Tensor> out(ts.size());
  std::vector<bool> seen(ts.size(), false);
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    if (seen[i] || !column_slice(t)) continue;
    // t and the later slices that are other columns of its rows, each at its column of one [B, T, row]
    // buffer (t's columns counted from a row's start: its storage offset modulo the row).
    const int64_t row = t.stride(1), shift = t.storage_offset() % row - t.storage_offset();
    std::vector<std::pair<size_t, int64_t>> columns;  // (index, first column)
    for (size_t j = i; j < ts.size(); ++j) {
      const Tensor& u = ts[j];
      if (seen[j] || !column_slice(u) || u.strides() != t.strides() ||
          u.sizes().slice(0, 2) != t.sizes().slice(0, 2) || !u.storage().is_alias_of(t.storage()))
        continue;
      const int64_t column = shift + u.storage_offset();
      if (column >= 0 && column + u.size(2) * u.size(3) <= row) columns.emplace_back(j, column), seen[j] = true;
    }
    if (columns.size() < 2) continue;  // a slice alone
    const auto buffer = torch::empty({t.size(0), t.size(1), row}, t.options().dtype(dtype));
    for (const auto& [j, column] : columns)
      out[j] = buffer.narrow(2, column, ts[j].size(2) * ts[j].size(3)).view(ts[j].sizes());
  }
  return out;
}

bool token_rows_in_place(const Tensor& t) {
  return t.dim() == 4 && t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) >= t.size(2) * t.size(3) &&
         (t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1));
}

Tensor state_decay(const Tensor& g, torch::ScalarType dt) {
  return (g.dim() == 2 ? g.unsqueeze(-1) : g).unsqueeze(-1).to(dt);  // [B, H, 1 or K, 1]
}

void check_recurrence_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const char* op) {
  LT2_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), op, ": q and k must be [B, T, H, K], found ",
            q.sizes(), " and ", k.sizes());
  LT2_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
            op, ": v must be [B, T, H, V] matching q ", q.sizes(), ", found ", v.sizes());
  LT2_CHECK(!g.defined() || g.sizes() == q.sizes().slice(0, 3) || g.sizes() == q.sizes(), op,
            ": g must be [B, T, H] or [B, T, H, K], found ", g.sizes());
}

Tensor initial_or_zero_state(const Tensor& initial_state, int64_t B, int64_t H, int64_t K,
                             int64_t V, torch::ScalarType dt, const torch::Device& device) {
  if (!initial_state.defined())
    return torch::zeros({B, H, K, V}, torch::TensorOptions().dtype(dt).device(device));
  LT2_CHECK(initial_state.sizes() == torch::IntArrayRef({B, H, K, V}),
            "initial state must be [B, H, K, V] = [", B, ", ", H, ", ", K, ", ", V, "], found ",
            initial_state.sizes());
  return initial_state.to(dt);
}

}  // namespace lt2::ops
