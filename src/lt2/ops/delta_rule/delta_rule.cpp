#include "lt2/ops/delta_rule/delta_rule.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "lt2/ops/chunking.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"

#ifdef LT2_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "lt2/kernels/prefill.h"
#endif

namespace lt2::ops {

namespace {

#ifdef LT2_WITH_CUDA
// Whether the kernels' fp32 products run as one TF32 product each, as the fp32 matmuls around
// them do under lt2::Tf32Scope (training and the engine under bf16); else 3xTF32, fp32's accuracy.
bool tf32_products() { return at::globalContext().allowTF32CuBLAS(); }

// A packed (contiguous), 16-byte aligned tensor for the CUDA kernels' 16-byte accesses: t itself
// where it is one, else a copy (a contiguous view may start anywhere); undefined stays undefined.
Tensor aligned_packed(const Tensor& t) {
  if (!t.defined()) return t;
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// Token rows [B, T, H, D] for the preparation kernels' 16-byte loads: t itself where they read it in
// place (token_rows_in_place: packed, or a column slice of a projection's output) from a 16-byte
// aligned start with rows a multiple of 16 bytes apart, else a packed, aligned copy.
Tensor aligned_token_rows(const Tensor& t) {
  if (!t.defined()) return t;
  const bool in_place = token_rows_in_place(t) && t.stride(1) * t.element_size() % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return in_place ? t : aligned_packed(t);
}
#endif

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                  const Tensor& g) {
  check_recurrence_inputs(q, k, v, g, "delta rule");
  LT2_CHECK(beta.sizes() == q.sizes().slice(0, 3), "delta rule: beta must be [B, T, H], found ",
            beta.sizes());
}

// One token of the recurrence, functional (differentiable). q, k [B, H, K], v [B, H, V],
// beta [B, H], decay [B, H, 1 or K, 1] log-gate or undefined; S [B, H, K, V]. Returns {o, S'}.
std::pair<Tensor, Tensor> delta_token(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& beta, const Tensor& decay, double scale,
                                      Tensor S) {
  if (decay.defined()) S = S * decay.exp();                       // decay first
  auto pred = torch::matmul(k.unsqueeze(-2), S).squeeze(-2);       // [B, H, V] = S^T k
  auto u = beta.unsqueeze(-1) * (v - pred);                        // [B, H, V]
  S = S + k.unsqueeze(-1) * u.unsqueeze(-2);                       // [B, H, K, V]
  auto o = torch::matmul(q.unsqueeze(-2), S).squeeze(-2) * scale;  // [B, H, V] = scale S^T q
  return {o, S};
}

// Whether autograd will need gradients of any of `tensors`.
bool needs_grad(std::initializer_list<const Tensor*> tensors) {
  if (!torch::GradMode::is_enabled()) return false;
  for (const Tensor* t : tensors)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

std::string shape_of(const Tensor& t) { return t.defined() ? cat(t.sizes()) : std::string("undefined"); }

// The scan's inputs have consistent shapes, one dtype and one device, those of w (or, without w,
// of kt). Returns {B, H, N, C, K, V}.
std::array<int64_t, 6> check_scan_inputs(const ChunkScanInputs& in, const char* op) {
  LT2_CHECK(in.u.defined() && in.u.dim() == 5, op, ": u must be [B, H, N, C, V], found ", shape_of(in.u));
  LT2_CHECK(in.w.defined() ? in.w.dim() == 5 : in.kt.defined() && in.kt.dim() == 5, op,
            in.w.defined() ? ": w must be [B, H, N, C, K], found " : ": without w, kt must be [B, H, N, K, C], found ",
            shape_of(in.w.defined() ? in.w : in.kt));
  const Tensor& keys = in.w.defined() ? in.w : in.kt;
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2);
  const int64_t C = in.w.defined() ? in.w.size(3) : in.kt.size(4), K = in.w.defined() ? in.w.size(4) : in.kt.size(3);
  const int64_t V = in.u.size(4);
  const auto dtype = keys.scalar_type();
  const auto device = keys.device();
  auto check = [&](const Tensor& t, std::vector<int64_t> expected, const char* name) {
    LT2_CHECK(t.defined() && t.dim() == static_cast<int64_t>(expected.size()) &&
                  t.sizes() == torch::IntArrayRef(expected), op, ": ", name, " must be ",
              torch::IntArrayRef(expected), ", found ", shape_of(t));
    LT2_CHECK(t.scalar_type() == dtype && t.device() == device, op, ": ", name, " must be ", dtype, " on ", device,
              " like ", in.w.defined() ? "w" : "kt", ", found ", t.scalar_type(), " on ", t.device());
  };
  check(in.u, {B, H, N, C, V}, "u");
  if (in.kt.defined()) check(in.kt, {B, H, N, K, C}, "kt");
  const bool per_channel = in.carry.defined() && in.carry.dim() == 5 && in.carry.size(3) == K && K != 1;
  check(in.carry, {B, H, N, per_channel ? K : 1, 1}, "carry (per head [B, H, N, 1, 1] or per key channel)");
  if (in.initial_state.defined()) check(in.initial_state, {B, H, K, V}, "initial_state");
  if (in.addend.defined()) check(in.addend, {B, H, N, K, V}, "addend");
  if (in.resets.defined()) {
    LT2_CHECK(B == 1, op, ": resets (packed documents) need batch 1, found ", B);
    LT2_CHECK(in.resets.sizes() == torch::IntArrayRef({N}) && in.resets.scalar_type() == torch::kInt32 &&
                  in.resets.device() == device,
              op, ": resets must be [", N, "] int32 on ", device, ", found ", shape_of(in.resets), " ",
              in.resets.scalar_type(), " on ", in.resets.device());
  }
  if (in.reset_states.defined()) {
    LT2_CHECK(in.resets.defined(), op, ": reset_states given without resets");
    check(in.reset_states, {in.reset_states.size(0), H, K, V}, "reset_states");
  }
  return {B, H, N, C, K, V};
}

// chunk_state_scan as a loop of libtorch ops over the chunks.
ChunkScanResult chunk_state_scan_loop(const ChunkScanInputs& in) {
  const auto [B, H, N, C, K, V] = check_scan_inputs(in, "chunk_state_scan");
  auto S = in.initial_state.defined() ? in.initial_state.clone()
                                      : torch::zeros({B, H, K, V}, in.u.options());
  std::vector<int32_t> resets(N, -1);
  if (in.resets.defined()) {
    auto r = in.resets.to(torch::kCPU).contiguous();
    std::copy(r.data_ptr<int32_t>(), r.data_ptr<int32_t>() + N, resets.begin());
  }
  std::vector<Tensor> states(N), vs(N);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t n = in.reverse ? N - 1 - i : i;
    if (resets[n] >= 0)
      S = in.reset_states.defined() ? in.reset_states.select(0, resets[n]).unsqueeze(0) : torch::zeros_like(S);
    states[n] = S;
    vs[n] = in.w.defined() ? in.u.select(2, n) - torch::matmul(in.w.select(2, n), S) : in.u.select(2, n);
    S = in.carry.select(2, n) * S;
    if (in.kt.defined()) S = S + torch::matmul(in.kt.select(2, n), vs[n]);
    if (in.addend.defined()) S = S + in.addend.select(2, n);
  }
  if (N == 0) return {torch::empty({B, H, 0, K, V}, in.u.options()), in.u, S};
  return {torch::stack(states, 2), in.w.defined() ? torch::stack(vs, 2) : in.u, S};
}

// Packed documents starting at chunks doc_starts [D] (int64, ascending, first 0) of N: the
// forward scan's resets (document d's first chunk restarts from doc_states[d]) and the backward's
// (the state gradient restarts at zero after each document's last chunk but the row's last).
std::pair<Tensor, Tensor> document_resets(const Tensor& doc_starts, int64_t N, const torch::Device& device) {
  auto starts = doc_starts.to(torch::kCPU, torch::kLong).contiguous();
  const int64_t D = starts.numel();
  const int64_t* first = starts.data_ptr<int64_t>();
  LT2_CHECK(D >= 1 && first[0] == 0, "chunk_state_scan: doc_starts must begin with chunk 0, found ",
            D == 0 ? std::string("none") : std::to_string(first[0]));
  auto forward = torch::full({N}, -1, torch::kInt32), backward = torch::full({N}, -1, torch::kInt32);
  auto f = forward.accessor<int32_t, 1>(), b = backward.accessor<int32_t, 1>();
  for (int64_t d = 0; d < D; ++d) {
    LT2_CHECK(first[d] < N && (d == 0 || first[d] > first[d - 1]), "chunk_state_scan: doc_starts must ascend within [0, ",
              N, "), found ", first[d], " at ", d);
    f[first[d]] = static_cast<int32_t>(d);
    if (d > 0) b[first[d] - 1] = 0;
  }
  return {forward.to(device), backward.to(device)};
}

// -x^T over the last two dims, packed: one pass (negating the transposed view, then packing it for
// the kernel, would be two); on CUDA in fp32 by the tiled kernel (kernels/prefill.h, switch
// DecodeOptions::scan_backward_products), whose reads and writes are both coalesced.
Tensor negated_transpose(const Tensor& x) {
  auto sizes = x.sizes().vec();
  std::swap(sizes[sizes.size() - 1], sizes[sizes.size() - 2]);
  auto out = torch::empty(sizes, x.options());
#ifdef LT2_WITH_CUDA
  const int64_t rows = x.size(-2), cols = x.size(-1);
  if (decode_options().scan_backward_products && x.is_cuda() && x.scalar_type() == torch::kFloat32 &&
      rows <= INT32_MAX && cols <= INT32_MAX && out.numel() > 0) {
    const auto packed = x.contiguous();
    c10::cuda::CUDAGuard guard(x.device());
    kernels::negated_transpose({packed.data_ptr<float>(), out.data_ptr<float>(), x.numel() / (rows * cols),
                                static_cast<int>(rows), static_cast<int>(cols)},
                               detail::current_stream(x));
    return out;
  }
#endif
  at::neg_out(out, x.transpose(-1, -2));
  return out;
}

// alpha A B over the leading (batch) dims, alpha folded into the GEMM rather than a pass of its own.
Tensor batched_product(const Tensor& a, const Tensor& b, double alpha) {
  auto sizes = a.sizes().vec();
  sizes.back() = b.size(-1);
  const auto a3 = a.reshape({-1, a.size(-2), a.size(-1)}), b3 = b.reshape({-1, b.size(-2), b.size(-1)});
  auto out = torch::empty({a3.size(0), a3.size(1), b3.size(2)}, a.options());
  return at::baddbmm_out(out, out, a3, b3, /*beta=*/0, alpha).view(sizes);
}

// The scan backward's products from G_{n+1} (g_next), S_n (states), the forward's values (v) and the
// adjoint's dU (du; read with W): dKt = G_{n+1} v^T, dW = -dU S_n^T (with W) and the carry's gradient
// sum_v G_{n+1} S_n (summed over k too for a per-head carry), by one kernel reading each operand once
// (kernels/prefill.h: scan_backward_products) where DecodeOptions::scan_backward_products is on and it
// serves the dims; nullopt otherwise (the caller's batched products and row dots).
struct ScanProducts {
  Tensor dkt, dw, dcarry;
};
std::optional<ScanProducts> scan_products_by_kernel(const Tensor& g_next, const Tensor& states, const Tensor& v,
                                                    const Tensor& du, bool with_w, bool per_head_carry) {
#ifdef LT2_WITH_CUDA
  const int64_t B = g_next.size(0), H = g_next.size(1), N = g_next.size(2), K = g_next.size(3), V = g_next.size(4),
                C = v.size(3);
  if (!decode_options().scan_backward_products || !g_next.is_cuda() || K > INT32_MAX || V > INT32_MAX ||
      C > INT32_MAX ||
      !kernels::scan_backward_products_supported(static_cast<int>(K), static_cast<int>(V), static_cast<int>(C)))
    return std::nullopt;
  const auto g = aligned_packed(g_next), s = aligned_packed(states), x = aligned_packed(v);
  const auto d = with_w ? aligned_packed(du) : Tensor();
  const auto f32 = g.options();
  ScanProducts out{torch::empty({B, H, N, K, C}, f32), with_w ? torch::empty({B, H, N, C, K}, f32) : Tensor(),
                   torch::empty({B, H, N, per_head_carry ? 1 : K, 1}, f32)};
  c10::cuda::CUDAGuard guard(g.device());
  kernels::ScanBackwardProductsParams p{};
  p.g_next = g.data_ptr<float>(), p.states = s.data_ptr<float>(), p.values = x.data_ptr<float>();
  p.du = with_w ? d.data_ptr<float>() : nullptr;
  p.dkt = out.dkt.data_ptr<float>(), p.dw = with_w ? out.dw.data_ptr<float>() : nullptr;
  p.dcarry = out.dcarry.data_ptr<float>();
  p.count = B * H * N;
  p.head_k = static_cast<int>(K), p.head_v = static_cast<int>(V), p.chunk_size = static_cast<int>(C);
  p.per_head_carry = per_head_carry;
  p.tf32 = tf32_products();
  kernels::scan_backward_products(p, detail::current_stream(g));
  return out;
#else
  return std::nullopt;
#endif
}

// Autograd for the forward scan; the formulas are in delta_rule.h (chunk_state_scan_differentiable).
// Function::apply takes no undefined tensors: an absent optional input travels as an empty tensor.
Tensor absent_as_empty(const Tensor& t) { return t.defined() ? t : torch::empty({0}); }
Tensor empty_as_absent(const Tensor& t) { return t.numel() > 0 ? t : Tensor(); }

struct ChunkStateScanFunction : public torch::autograd::Function<ChunkStateScanFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& given_w,
                                                const Tensor& u, const Tensor& kt, const Tensor& carry,
                                                const Tensor& given_initial_state, const Tensor& given_doc_starts,
                                                const Tensor& given_doc_states) {
    const Tensor w = empty_as_absent(given_w), initial_state = empty_as_absent(given_initial_state),
                 doc_starts = empty_as_absent(given_doc_starts), doc_states = empty_as_absent(given_doc_states);
    Tensor resets, adjoint_resets;
    if (doc_starts.defined()) std::tie(resets, adjoint_resets) = document_resets(doc_starts, u.size(2), u.device());
    auto r = chunk_state_scan({w, u, kt, carry, initial_state, Tensor(), false, resets, doc_states});
    ctx->save_for_backward({absent_as_empty(w), kt, carry, r.states, r.v});
    // The switches the backward reads, as in force here: decode_options() is the calling thread's, and
    // autograd runs a CUDA backward on a thread of its own (where it would read the defaults).
    const DecodeOptions& options = decode_options();
    ctx->saved_data["delta_rule_scan"] = options.delta_rule_scan;
    ctx->saved_data["scan_value_block"] = options.scan_value_block;
    ctx->saved_data["scan_backward_products"] = options.scan_backward_products;
    ctx->saved_data["has_initial_state"] = initial_state.defined() && !doc_starts.defined();
    ctx->saved_data["has_doc_states"] = doc_states.defined();
    if (doc_starts.defined()) {
      ctx->saved_data["adjoint_resets"] = adjoint_resets;
      ctx->saved_data["doc_starts"] = doc_starts.to(u.device(), torch::kLong);
    }
    return {r.states, r.v, r.final_state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    DecodeOptions options;  // the forward's switches on this thread (the rest are not read here)
    options.delta_rule_scan = ctx->saved_data["delta_rule_scan"].toBool();
    options.scan_value_block = ctx->saved_data["scan_value_block"].toInt();
    options.scan_backward_products = ctx->saved_data["scan_backward_products"].toBool();
    const DecodeOptionsGuard forward_options(options);
    const auto saved = ctx->get_saved_variables();
    const Tensor w = empty_as_absent(saved[0]), &kt = saved[1], &carry = saved[2], &states = saved[3], &v = saved[4];
    const Tensor d_states = grads[0], d_final = grads[2];
    const Tensor d_v = grads[1].defined() ? grads[1] : torch::zeros_like(v);
    const bool documents = ctx->saved_data.find("doc_starts") != ctx->saved_data.end();
    const Tensor adjoint_resets = documents ? ctx->saved_data["adjoint_resets"].toTensor() : Tensor();
    const auto adjoint = chunk_state_scan({negated_transpose(kt), d_v, w.defined() ? negated_transpose(w) : Tensor(),
                                           carry, d_final, d_states, /*reverse=*/true, adjoint_resets, Tensor()});
    const Tensor& g_next = adjoint.states;  // G_{n+1}: the gradient of the state leaving chunk n
    auto products = scan_products_by_kernel(g_next, states, v, adjoint.v, w.defined(), carry.size(3) == 1);
    if (!products) {
      products = ScanProducts{torch::matmul(g_next, v.transpose(-1, -2)),
                              w.defined() ? batched_product(adjoint.v, states.transpose(-1, -2), -1.0) : Tensor(),
                              last_dim_dots(g_next, states)};  // [B, H, N, K, 1]
      if (carry.size(3) == 1) products->dcarry = products->dcarry.sum(-2, /*keepdim=*/true);
    }
    Tensor d_doc_states;
    if (ctx->saved_data["has_doc_states"].toBool()) {
      // G_n at each document's first chunk n: the gradient of the state it restarted from.
      const Tensor first = ctx->saved_data["doc_starts"].toTensor();
      auto at = [&](const Tensor& t) { return t.index_select(2, first); };
      auto g = at(carry) * at(g_next);
      if (w.defined()) g = g - torch::matmul(at(w).transpose(-1, -2), at(adjoint.v));
      if (d_states.defined()) g = g + at(d_states);
      d_doc_states = g.squeeze(0).transpose(0, 1);  // [D, H, K, V]
    }
    return {products->dw,
            adjoint.v,  // dU
            products->dkt,
            products->dcarry,
            ctx->saved_data["has_initial_state"].toBool() ? adjoint.final_state : Tensor(),
            Tensor(),
            d_doc_states};
  }
};

struct UnitLowerInverseFunction : public torch::autograd::Function<UnitLowerInverseFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& L) {
    auto T = unit_lower_inverse_cuda(L);
    ctx->save_for_backward({T});
    return T;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor Tt = ctx->get_saved_variables()[0].transpose(-1, -2);
    return {-torch::matmul(torch::matmul(Tt, grads[0]), Tt).tril(-1)};
  }

  // The kernel: L float32 on CUDA, C <= kMaxScanChunk.
  static Tensor unit_lower_inverse_cuda(const Tensor& L) {
#ifdef LT2_WITH_CUDA
    const auto l = L.contiguous();
    auto T = torch::empty_like(l);
    c10::cuda::CUDAGuard guard(l.device());
    kernels::unit_lower_inverse({l.data_ptr<float>(), T.data_ptr<float>(), l.numel() / (l.size(-1) * l.size(-1)),
                                 static_cast<int>(l.size(-1))},
                                detail::current_stream(l));
    return T;
#else
    detail::no_cuda("unit_lower_inverse");
#endif
  }
};

}  // namespace

Tensor last_dim_dots(const Tensor& x, const Tensor& y) {
#ifdef LT2_WITH_CUDA
  if (x.is_cuda() && x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
      x.sizes() == y.sizes() && x.size(-1) % 4 == 0 && x.size(-1) <= INT32_MAX) {
    const auto a = aligned_packed(x), b = aligned_packed(y);
    auto sizes = x.sizes().vec();
    sizes.back() = 1;
    auto out = torch::empty(sizes, x.options());
    c10::cuda::CUDAGuard guard(x.device());
    kernels::row_dots({a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), out.numel(),
                       static_cast<int>(x.size(-1))},
                      detail::current_stream(x));
    return out;
  }
#endif
  return (x * y).sum(-1, /*keepdim=*/true);
}

Tensor unit_lower_inverse(const Tensor& L) {
  LT2_CHECK(L.dim() >= 2 && L.size(-1) == L.size(-2), "unit_lower_inverse: L must be [..., C, C], found ",
            L.sizes());
  const int64_t C = L.size(-1);
#ifdef LT2_WITH_CUDA
  if (L.is_cuda() && L.scalar_type() == torch::kFloat32 && C >= 1 && C <= kernels::kMaxScanChunk)
    return UnitLowerInverseFunction::apply(L);
#endif
  auto eye = torch::eye(C, L.options()).expand(L.sizes());
  return torch::linalg_solve_triangular(L, eye, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
}

bool chunk_state_scan_supported(int64_t K, int64_t V, int64_t C, const torch::Device& device) {
#ifdef LT2_WITH_CUDA
  if (!device.is_cuda() || K > INT32_MAX || V > INT32_MAX || C > INT32_MAX) return false;  // the kernel checks the rest
  return kernels::delta_rule_scan_supported(static_cast<int>(K), static_cast<int>(V), static_cast<int>(C),
                                            detail::cuda_index(device));
#else
  return false;
#endif
}

ChunkScanResult chunk_state_scan_cuda(const ChunkScanInputs& in, int value_block) {
  const char* op = "chunk_state_scan_cuda";
#ifdef LT2_WITH_CUDA
  const auto [B, H, N, C, K, V] = check_scan_inputs(in, op);
  const auto device = in.u.device();
  LT2_CHECK(device.is_cuda() && in.u.scalar_type() == torch::kFloat32, op,
            ": the inputs must be float32 CUDA tensors, found ", in.u.scalar_type(), " on ", device);
  LT2_CHECK(chunk_state_scan_supported(K, V, C, device), op, ": no kernel for K ", K, ", V ", V, ", C ", C, " on ",
            device, " (needs K and C multiples of 4, K <= ", kernels::kMaxScanHeadK, ", C <= ",
            kernels::kMaxScanChunk, ", V a multiple of 8)");
  LT2_CHECK(N <= INT32_MAX, op, ": ", N, " chunks (at most ", INT32_MAX, ")");
  const auto w = aligned_packed(in.w), u = aligned_packed(in.u), kt = aligned_packed(in.kt);
  const auto carry = aligned_packed(in.carry), s0 = aligned_packed(in.initial_state);
  const auto addend = aligned_packed(in.addend), reset_states = aligned_packed(in.reset_states);
  const auto resets = in.resets.defined() ? in.resets.contiguous() : Tensor();
  c10::cuda::CUDAGuard guard(device);
  // Without w, V_n is U_n: the result's v is u itself.
  ChunkScanResult r{torch::empty({B, H, N, K, V}, u.options()),
                    w.defined() ? torch::empty({B, H, N, C, V}, u.options()) : u,
                    torch::empty({B, H, K, V}, u.options())};
  kernels::DeltaRuleScanParams p{};
  p.w = w.defined() ? w.data_ptr<float>() : nullptr;
  p.u = u.data_ptr<float>();
  p.kt = kt.defined() ? kt.data_ptr<float>() : nullptr;
  p.carry = carry.data_ptr<float>();
  p.addend = addend.defined() ? addend.data_ptr<float>() : nullptr;
  p.resets = resets.defined() ? resets.data_ptr<int32_t>() : nullptr;
  p.reset_states = reset_states.defined() ? reset_states.data_ptr<float>() : nullptr;
  p.initial_state = s0.defined() ? s0.data_ptr<float>() : nullptr;
  p.states = r.states.data_ptr<float>();
  p.v_new = w.defined() ? r.v.data_ptr<float>() : nullptr;
  p.final_state = r.final_state.data_ptr<float>();
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(H), p.chunks = static_cast<int>(N);
  p.chunk_size = static_cast<int>(C), p.head_k = static_cast<int>(K), p.head_v = static_cast<int>(V);
  p.per_channel_carry = carry.size(3) == K && K != 1;
  p.reverse = in.reverse;
  p.tf32 = tf32_products();
  p.value_block = value_block;
  kernels::delta_rule_scan(p, detail::current_stream(u));
  return r;
#else
  detail::no_cuda(op);
#endif
}

ChunkScanResult chunk_state_scan(const ChunkScanInputs& in) {
  const auto [B, H, N, C, K, V] = check_scan_inputs(in, "chunk_state_scan");
  if (decode_options().delta_rule_scan && in.u.is_cuda() && in.u.scalar_type() == torch::kFloat32 &&
      chunk_state_scan_supported(K, V, C, in.u.device()))
    return chunk_state_scan_cuda(in, decode_options().scan_value_block);
  return chunk_state_scan_loop(in);
}

ChunkScanResult chunk_state_scan_differentiable(const Tensor& w, const Tensor& u, const Tensor& kt,
                                                const Tensor& carry, const Tensor& initial_state,
                                                const Tensor& doc_starts, const Tensor& doc_states) {
  if (!needs_grad({&w, &u, &kt, &carry, &initial_state, &doc_states})) {
    Tensor resets;
    if (doc_starts.defined()) resets = document_resets(doc_starts, u.size(2), u.device()).first;
    return chunk_state_scan({w, u, kt, carry, initial_state, Tensor(), false, resets, doc_states});
  }
  auto out = ChunkStateScanFunction::apply(absent_as_empty(w), u, kt, carry, absent_as_empty(initial_state),
                                           absent_as_empty(doc_starts), absent_as_empty(doc_states));
  return {out[0], out[1], out[2]};
}

RecurrenceResult delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& beta, const Tensor& g, double scale,
                                      const Tensor& initial_state) {
  check_inputs(q, k, v, beta, g);
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  auto S = initial_or_zero_state(initial_state, B, H, K, V, dt, v.device());
  auto qc = q.to(dt), kc = k.to(dt), vc = v.to(dt), bc = beta.to(dt);
  std::vector<Tensor> outs;
  outs.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    Tensor decay = g.defined() ? state_decay(g.select(1, t), dt) : Tensor();
    auto [o, S_next] = delta_token(qc.select(1, t), kc.select(1, t), vc.select(1, t),
                                   bc.select(1, t), decay, scale, S);
    outs.push_back(o);
    S = S_next;
  }
  return {torch::stack(outs, 1).to(v.scalar_type()), S};
}

ChunkPrep chunk_reads_and_writes(const Tensor& Q, const Tensor& Kc, const Tensor& G, double scale) {
  auto G_last = G.narrow(-2, Q.size(3) - 1, 1);                  // [B, H, N, 1, 1 or K]
  ChunkPrep prep;
  prep.kt = (Kc * (G_last - G).exp()).transpose(-1, -2);         // [B, H, N, K, C]
  prep.carry = G_last.exp().transpose(-1, -2);                   // [B, H, N, 1 or K, 1]
  prep.q_start = Q * G.exp() * scale;                            // [B, H, N, C, K]
  prep.a_qk = decayed_scores(Q, Kc, G, /*inclusive=*/true) * scale;
  return prep;
}

namespace {

// The preparation in libtorch ops (differentiable) from inputs already in chunks: Q, Kc
// [B, H, N, C, K], Vc [B, H, N, C, V], b (beta) [B, H, N, C, 1], G the chunk-local cumulative
// log-gate [B, H, N, C, 1 or K].
ChunkPrep prepare_chunks(const Tensor& Q, const Tensor& Kc, const Tensor& Vc, const Tensor& b, const Tensor& G,
                         double scale) {
  const int64_t K = Q.size(4), V = Vc.size(4);
  auto prep = chunk_reads_and_writes(Q, Kc, G, scale);
  // UT transform: [U | W] = (I + L)^{-1} [diag(beta) V | diag(beta) (K * exp(G))] per chunk.
  auto L = decayed_scores(b * Kc, Kc, G, /*inclusive=*/false);   // [B, H, N, C, C]
  auto rhs = torch::cat({b * Vc, b * Kc * G.exp()}, -1);         // [B, H, N, C, V + K]
  auto UW = torch::matmul(unit_lower_inverse(L), rhs);           // [B, H, N, C, V + K]
  prep.w = UW.narrow(-1, V, K);
  prep.u = UW.narrow(-1, 0, V);
  return prep;
}

#ifdef LT2_WITH_CUDA
// The kernels' parameters for q, k, v, beta, g (q, k, v token rows of one dtype as aligned_token_rows
// gives them, beta and g packed fp32) and a chunk size C; beta undefined: the additive (gated linear)
// preparation. A per-channel gate comes as `channels`: G and the keys' scores (packed fp32, chunk
// layout), g then undefined.
struct ChannelGate {
  Tensor G, scores_kk;  // [B, H, N, C, K], [B, H, N, C, C] (scores_kk undefined when additive)
};
kernels::DeltaRulePrepareParams prepare_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                                               const Tensor& g, const ChannelGate& channels, double scale,
                                               int64_t C) {
  kernels::DeltaRulePrepareParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.additive = !beta.defined();
  p.beta = beta.defined() ? beta.data_ptr<float>() : nullptr;
  p.g = g.defined() ? g.data_ptr<float>() : nullptr;
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  p.channel_gate = ptr(channels.G), p.scores_kk = ptr(channels.scores_kk);
  p.batch = static_cast<int>(q.size(0)), p.seq = static_cast<int>(q.size(1)), p.heads = static_cast<int>(q.size(2));
  p.head_k = static_cast<int>(q.size(3)), p.head_v = static_cast<int>(v.size(3)), p.chunk_size = static_cast<int>(C);
  p.q_row = q.stride(1), p.k_row = k.stride(1), p.v_row = v.stride(1);
  p.scale = static_cast<float>(scale);
  p.dtype = detail::kernel_dtype(q.scalar_type());
  p.tf32 = tf32_products();
  return p;
}

// The preparation kernel and, under autograd, its backward kernel (kernels/prefill.h). Inputs as
// prepare_params takes them (beta, g and the ChannelGate's tensors empty for none); outputs w (empty
// when additive), u, kt, carry, q_start, a_qk. A per-channel gate's A_qk is not the kernel's: empty here
// (the caller scales its scores_qk) unless scores_inside (a per-channel gate G, q and k token rows the
// score kernels read: score_rows_kernel_serves), where the score kernels write A_qk (scaled) and
// scores_kk here rather than taking them as inputs, and the backward adds their gradients where it wrote
// q's, k's and G's: one gradient each, not two (three for k) for autograd to sum in passes of their own.
struct PrepareChunksFunction : public torch::autograd::Function<PrepareChunksFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const Tensor& beta,
                                                const Tensor& g, const Tensor& G, const Tensor& scores_kk,
                                                double scale, int64_t C, bool scores_inside) {
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3), N = (T + C - 1) / C;
    const auto f32 = q.options().dtype(torch::kFloat32);
    ChannelGate channels{empty_as_absent(G), empty_as_absent(scores_kk)};
    const bool per_channel = channels.G.defined();
    Tensor a_qk = per_channel ? torch::empty({0}, f32) : torch::empty({B, H, N, C, C}, f32);
    const bool score_pairs = scores_inside && beta.numel() > 0 && decode_options().channel_score_pairs;
    if (score_pairs) {
      std::tie(a_qk, channels.scores_kk) = score_row_pair_by_kernel(q, k, G, scale);
    } else if (scores_inside) {
      a_qk = score_rows_by_kernel(q, k, G, /*inclusive=*/true, scale);
      if (beta.numel() > 0) channels.scores_kk = score_rows_by_kernel(k, k, G, /*inclusive=*/false);
    }
    auto p = prepare_params(q, k, v, empty_as_absent(beta), empty_as_absent(g), channels, scale, C);
    const int64_t carry_dim = per_channel ? K : 1;
    std::vector<Tensor> out{p.additive ? torch::empty({0}, f32) : torch::empty({B, H, N, C, K}, f32),
                            torch::empty({B, H, N, C, V}, f32), torch::empty({B, H, N, K, C}, f32),
                            torch::empty({B, H, N, carry_dim, 1}, f32), torch::empty({B, H, N, C, K}, f32),
                            a_qk};
    c10::cuda::CUDAGuard guard(q.device());
    p.w = p.additive ? nullptr : out[0].data_ptr<float>();
    p.u = out[1].data_ptr<float>(), p.kt = out[2].data_ptr<float>();
    p.carry = out[3].data_ptr<float>(), p.q_start = out[4].data_ptr<float>();
    p.a_qk = per_channel ? nullptr : a_qk.data_ptr<float>();
    kernels::delta_rule_prepare(p, detail::current_stream(q));
    ctx->save_for_backward({q, k, v, beta, g, G, absent_as_empty(channels.scores_kk)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["scores_inside"] = scores_inside;
    ctx->saved_data["score_pairs"] = score_pairs;
    ctx->saved_data["shared_slice_gradients"] = decode_options().shared_slice_gradients;
    ctx->saved_data["chunk"] = C;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], beta = empty_as_absent(saved[3]),
                 g = empty_as_absent(saved[4]);
    const ChannelGate channels{empty_as_absent(saved[5]), empty_as_absent(saved[6])};
    const bool additive = !beta.defined(), per_channel = channels.G.defined();
    const int64_t C = ctx->saved_data["chunk"].toInt();
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3), N = (T + C - 1) / C;
    const auto f32 = q.options().dtype(torch::kFloat32);
    const std::vector<std::vector<int64_t>> shapes{{B, H, N, C, K},
                                                   {B, H, N, C, V},
                                                   {B, H, N, K, C},
                                                   {B, H, N, per_channel ? K : 1, 1},
                                                   {B, H, N, C, K},
                                                   {B, H, N, C, C}};
    std::vector<Tensor> d(6);
    for (size_t i = additive ? 1 : 0; i < (per_channel ? 5 : 6); ++i)  // per channel dA_qk is the scores'
      d[i] = grads[i].defined() ? grads[i].to(torch::kFloat32).contiguous() : torch::zeros(shapes[i], f32);
    c10::cuda::CUDAGuard guard(q.device());
    kernels::DeltaRulePrepareBackwardParams bp{};
    bp.forward = prepare_params(q, k, v, beta, g, channels, ctx->saved_data["scale"].toDouble(), C);
    bp.dw = additive ? nullptr : d[0].data_ptr<float>();
    bp.du = d[1].data_ptr<float>(), bp.dkt = d[2].data_ptr<float>();
    bp.dcarry = d[3].data_ptr<float>(), bp.dq_start = d[4].data_ptr<float>();
    bp.da_qk = per_channel ? nullptr : d[5].data_ptr<float>();
    // q's and k's gradients in their dtype and layout (the score kernels add into them), in one buffer with
    // v's where they are slices of the same rows (shared_slice_gradients), else v's packed (a slice's
    // gradient alone in a wide buffer would send the split's concatenation backward to its unvectorized
    // kernel); each written once by the kernel (dk's first share goes to an fp32 scratch, dk itself where
    // that is fp32).
    const auto dtype = q.scalar_type();
    const auto shared = ctx->saved_data["shared_slice_gradients"].toBool() ? shared_gradients({q, k, v}, dtype)
                                                                            : std::vector<Tensor>(3);
    const auto dq = shared[0].defined() ? shared[0] : gradient_like(q, dtype);
    const auto dk = shared[1].defined() ? shared[1] : gradient_like(k, dtype);
    const auto dv = shared[2].defined() ? shared[2] : torch::empty({B, T, H, V}, v.options());
    auto dbeta = additive ? Tensor() : torch::empty({B, T, H}, f32);
    const auto dk_partial = additive || dtype == torch::kFloat32 ? dk : gradient_like(k, torch::kFloat32);
    auto dg = g.defined() ? torch::empty({B, T, H}, f32) : Tensor();
    bp.dq = dq.data_ptr(), bp.dk = dk.data_ptr(), bp.dv = dv.data_ptr(), bp.dv_row = dv.stride(1);
    bp.dk_partial = additive ? nullptr : dk_partial.data_ptr<float>();
    bp.dbeta = additive ? nullptr : dbeta.data_ptr<float>(), bp.dg = dg.defined() ? dg.data_ptr<float>() : nullptr;
    Tensor d_gate, d_scores_kk;
    if (per_channel) {
      d_gate = torch::empty({B, H, N, C, K}, f32);
      if (!additive) d_scores_kk = torch::empty({B, H, N, C, C}, f32);
      bp.d_channel_gate = d_gate.data_ptr<float>();
      bp.d_scores_kk = additive ? nullptr : d_scores_kk.data_ptr<float>();
    }
    kernels::delta_rule_prepare_backward(bp, detail::current_stream(q));
    if (ctx->saved_data["scores_inside"].toBool()) {  // the scores' gradients added where the kernel wrote q's and k's
      const double scale = ctx->saved_data["scale"].toDouble();
      if (grads[5].defined() && ctx->saved_data["score_pairs"].toBool()) {
        add_score_row_pair_backward(q, k, channels.G, grads[5], d_scores_kk, dq, dk, d_gate, scale);
      } else {
        if (grads[5].defined())
          add_score_rows_backward(q, k, channels.G, /*inclusive=*/true, grads[5], dq, dk, d_gate, scale);
        if (!additive) add_score_rows_backward(k, k, channels.G, /*inclusive=*/false, d_scores_kk, dk, dk, d_gate);
      }
      d_scores_kk = Tensor();
    }
    return {dq, dk, dv, dbeta, g.defined() ? dg : Tensor(), d_gate, d_scores_kk, Tensor(), Tensor(), Tensor()};
  }
};

// The kernels' dims of the chunk outputs from q_start [B, H, N, C, K] and v_new [B, H, N, C, V].
kernels::DeltaRuleOutputParams output_params(const Tensor& q_start, const Tensor& v_new, int64_t T,
                                             torch::ScalarType dtype) {
  kernels::DeltaRuleOutputParams p{};
  p.batch = static_cast<int>(q_start.size(0)), p.seq = static_cast<int>(T), p.heads = static_cast<int>(q_start.size(1));
  p.head_k = static_cast<int>(q_start.size(4)), p.head_v = static_cast<int>(v_new.size(4));
  p.chunk_size = static_cast<int>(q_start.size(3));
  p.dtype = detail::kernel_dtype(dtype);
  p.tf32 = tf32_products();
  return p;
}

// O = Q_start S_n + A_qk V_n in the token layout [B, T, H, V] of `dtype` by the kernel
// (kernels/prefill.h: delta_rule_output); the backward by its kernel where it serves the dims
// (delta_rule_output_backward, switch DecodeOptions::delta_rule_output_backward as the forward
// saw it), else the products autograd takes for the libtorch form, on the output gradient in chunks.
struct ChunkOutputsFunction : public torch::autograd::Function<ChunkOutputsFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q_start, const Tensor& states,
                        const Tensor& a_qk, const Tensor& v_new, int64_t T, torch::ScalarType dtype) {
    const auto q = aligned_packed(q_start), s = aligned_packed(states), a = aligned_packed(a_qk),
               v = aligned_packed(v_new);
    auto out = torch::empty({q.size(0), T, q.size(1), v.size(4)}, q.options().dtype(dtype));
    c10::cuda::CUDAGuard guard(q.device());
    auto p = output_params(q, v, T, dtype);
    p.q_start = q.data_ptr<float>(), p.states = s.data_ptr<float>(), p.a_qk = a.data_ptr<float>();
    p.v_new = v.data_ptr<float>(), p.out = out.data_ptr();
    kernels::delta_rule_output(p, detail::current_stream(q));
    ctx->save_for_backward({q, s, a, v});
    ctx->saved_data["T"] = T;
    ctx->saved_data["dtype"] = static_cast<int64_t>(dtype);
    ctx->saved_data["tf32"] = p.tf32;
    ctx->saved_data["kernel_backward"] =
        decode_options().delta_rule_output_backward &&
        kernels::delta_rule_output_backward_supported(p.head_k, p.head_v, p.chunk_size, detail::cuda_index(q.device()));
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &q_start = saved[0], &states = saved[1], &a_qk = saved[2], &v_new = saved[3];
    if (ctx->saved_data["kernel_backward"].toBool()) {
      const int64_t T = ctx->saved_data["T"].toInt();
      const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
      const auto dout = aligned_packed(grads[0].to(dtype));  // the output's dtype and layout
      std::vector<Tensor> d{torch::empty_like(q_start), torch::empty_like(states), torch::empty_like(a_qk),
                            torch::empty_like(v_new)};
      c10::cuda::CUDAGuard guard(q_start.device());
      kernels::DeltaRuleOutputBackwardParams bp{};
      bp.forward = output_params(q_start, v_new, T, dtype);
      bp.forward.tf32 = ctx->saved_data["tf32"].toBool();
      bp.forward.q_start = q_start.data_ptr<float>(), bp.forward.states = states.data_ptr<float>();
      bp.forward.a_qk = a_qk.data_ptr<float>(), bp.forward.v_new = v_new.data_ptr<float>();
      bp.dout = dout.data_ptr();
      bp.dq_start = d[0].data_ptr<float>(), bp.dstates = d[1].data_ptr<float>();
      bp.da_qk = d[2].data_ptr<float>(), bp.dv_new = d[3].data_ptr<float>();
      kernels::delta_rule_output_backward(bp, detail::current_stream(q_start));
      return {d[0], d[1], d[2], d[3], Tensor(), Tensor()};
    }
    const auto dO = to_chunks(grads[0], q_start.size(3), torch::kFloat32);  // [B, H, N, C, V]
    auto t = [](const Tensor& x) { return x.transpose(-1, -2); };
    auto need = [&](size_t i) { return ctx->needs_input_grad(i); };
    return {need(0) ? torch::matmul(dO, t(states)) : Tensor(), need(1) ? torch::matmul(t(q_start), dO) : Tensor(),
            need(2) ? torch::matmul(dO, t(v_new)) : Tensor(), need(3) ? torch::matmul(t(a_qk), dO) : Tensor(),
            Tensor(), Tensor()};
  }
};
#endif

}  // namespace

ChunkPrep prepare_chunks_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                                double scale, int64_t C, const DocumentChunks* docs) {
#ifdef LT2_WITH_CUDA
  const auto dtype = q.scalar_type();
  // The kernels read token rows: packed documents each from a chunk boundary.
  auto rows = [&](const Tensor& t) { return docs && t.defined() ? docs->to_padded_rows(t) : t; };
  auto fp32 = [](const Tensor& t) { return t.defined() ? t.to(torch::kFloat32).contiguous() : torch::empty({0}); };
  const auto q_rows = aligned_token_rows(rows(q)), k_rows = aligned_token_rows(rows(k).to(dtype));
  // One decay per key channel: G in the chunk layout and the scores whose decay sits inside the sum
  // over the channels, by decayed_scores (its own kernels and backward; whole documents read the
  // token rows the preparation reads, packed documents their chunk layout) with A_qk = scale scores_qk
  // here, or, where the score kernels read q's and k's token rows, by those kernels inside the
  // preparation's autograd node (A_qk scaled by them).
  Tensor head_gate = g, G, a_qk, scores_kk;
  bool scores_inside = false;
  if (g.defined() && g.dim() == 4) {
    const auto f32 = torch::kFloat32;
    head_gate = Tensor();
    if (docs) {
      G = docs->cumulative_gate(g, q.size(2), f32);
      const auto Kc = docs->to_chunks(k, f32);
      a_qk = decayed_scores(docs->to_chunks(q, f32), Kc, G, /*inclusive=*/true) * scale;
      if (beta.defined()) scores_kk = decayed_scores(Kc, Kc, G, /*inclusive=*/false);
    } else {
      G = chunk_cumulative_gate(g, q.size(0), q.size(1), q.size(2), C, f32, q.device());
      scores_inside = G.is_contiguous() && score_rows_kernel_serves(q_rows, k_rows, G);
      if (!scores_inside) {
        a_qk = decayed_scores_of_rows(q_rows, k_rows, G, /*inclusive=*/true) * scale;
        if (beta.defined()) scores_kk = decayed_scores_of_rows(k_rows, k_rows, G, /*inclusive=*/false);
      }
    }
  }
  auto out = PrepareChunksFunction::apply(q_rows, k_rows, aligned_token_rows(rows(v).to(dtype)), fp32(rows(beta)),
                                          fp32(rows(head_gate)), fp32(G), fp32(scores_kk), scale, C, scores_inside);
  return {empty_as_absent(out[0]), out[1], out[2], out[3], out[4], a_qk.defined() ? a_qk : out[5]};
#else
  detail::no_cuda("delta_rule_prepare");
#endif
}

bool chunk_prepare_kernel_serves(const Tensor& q, const Tensor& v, const Tensor& g, int64_t chunk_size) {
#ifdef LT2_WITH_CUDA
  const auto dtype = q.scalar_type();
  if (!decode_options().delta_rule_scan || !q.is_cuda() || accum_dtype(v) != torch::kFloat32 ||
      (dtype != torch::kFloat32 && dtype != torch::kBFloat16) ||
      (g.defined() && g.dim() != 3 && !(g.dim() == 4 && decode_options().channel_gate_prepare)))
    return false;
  const int64_t K = q.size(3), V = v.size(3), T = q.size(1);
  if (K > INT32_MAX || V > INT32_MAX || T > INT32_MAX || chunk_size > INT32_MAX) return false;
  return chunk_state_scan_supported(K, V, chunk_size, q.device()) &&
         kernels::delta_rule_prepare_supported(static_cast<int>(K), static_cast<int>(V), static_cast<int>(chunk_size),
                                               detail::cuda_index(q.device()));
#else
  return false;
#endif
}

bool delta_rule_prepare_serves(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                               const Tensor& g, int64_t chunk_size) {
  return decode_options().delta_rule_prepare && chunk_prepare_kernel_serves(q, v, g, chunk_size);
}

RecurrenceResult delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& beta, const Tensor& g, double scale,
                                    const Tensor& initial_state, int64_t chunk_size) {
  check_inputs(q, k, v, beta, g);
  Fp32Scope fp32;
  const auto dt = accum_dtype(v);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  const int64_t C = chunk_size;
  const auto prep = delta_rule_prepare_serves(q, k, v, beta, g, C)
                        ? prepare_chunks_kernel(q, k, v, beta, g, scale, C)
                        : prepare_chunks(to_chunks(q, C, dt), to_chunks(k, C, dt), to_chunks(v, C, dt),
                                         to_chunks(beta.unsqueeze(-1), C, dt),
                                         chunk_cumulative_gate(g, B, T, H, C, dt, v.device()), scale);
  return run_chunked_form(prep, initial_state, T, v.scalar_type());
}

Tensor chunk_outputs_in_tokens(const Tensor& q_start, const Tensor& states, const Tensor& a_qk, const Tensor& v_new,
                               int64_t T, torch::ScalarType dtype) {
#ifdef LT2_WITH_CUDA
  const int64_t K = q_start.size(4), V = v_new.size(4), C = q_start.size(3);
  if (decode_options().delta_rule_output && q_start.is_cuda() && q_start.scalar_type() == torch::kFloat32 &&
      (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && T <= INT32_MAX && K <= INT32_MAX &&
      V <= INT32_MAX && C <= INT32_MAX &&
      kernels::delta_rule_output_supported(static_cast<int>(K), static_cast<int>(V), static_cast<int>(C),
                                           detail::cuda_index(q_start.device())))
    return ChunkOutputsFunction::apply(q_start, states, a_qk, v_new, T, dtype);
#endif
  return from_chunks(chunk_outputs(q_start, states, a_qk, v_new), T, dtype);
}

RecurrenceResult run_chunked_form(const ChunkPrep& prep, const Tensor& initial_state, int64_t T,
                                  torch::ScalarType out_dtype) {
  const auto s0 = initial_state.defined() ? initial_state.to(prep.u.scalar_type()) : Tensor();
  auto scan = chunk_state_scan_differentiable(prep.w, prep.u, prep.kt, prep.carry, s0);
  return {chunk_outputs_in_tokens(prep.q_start, scan.states, prep.a_qk, scan.v, T, out_dtype), scan.final_state};
}

RecurrenceResult chunked_form_varlen(const DocumentChunks& docs, const Tensor& q, const Tensor& v,
                                     const Tensor& initial_states, const std::function<ChunkPrep()>& prepare) {
  const int64_t D = docs.documents(), H = q.size(2), K = q.size(3), V = v.size(3);
  const auto dt = accum_dtype(v);
  if (initial_states.defined())
    LT2_CHECK(initial_states.sizes() == torch::IntArrayRef({D, H, K, V}), docs.op(), ": initial_states must be [", D,
              ", ", H, ", ", K, ", ", V, "], found ", initial_states.sizes());
  Tensor final_states = initial_states.defined() ? initial_states.to(dt).clone()
                                                 : torch::zeros({D, H, K, V}, v.options().dtype(dt));
  if (docs.chunks() == 0) return {torch::zeros({1, 0, H, V}, v.options()), final_states};
  const auto prep = prepare();
  auto doc_states = initial_states.defined() ? initial_states.to(dt).index_select(0, docs.present) : Tensor();
  auto scan = chunk_state_scan_differentiable(prep.w, prep.u, prep.kt, prep.carry, Tensor(), docs.first_chunk,
                                              doc_states);
  // Each document's final state: its last chunk's write onto the state entering that chunk.
  auto at = [&](const Tensor& t) { return t.index_select(2, docs.last_chunk); };
  auto finals = at(prep.carry) * at(scan.states) + torch::matmul(at(prep.kt), at(scan.v));
  final_states = final_states.index_copy(0, docs.present, finals.squeeze(0).transpose(0, 1));
  const int64_t rows = docs.chunks() * prep.q_start.size(3);
  return {docs.from_padded_rows(chunk_outputs_in_tokens(prep.q_start, scan.states, prep.a_qk, scan.v, rows,
                                                        v.scalar_type())),
          final_states};
}

RecurrenceResult delta_rule_chunked_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& beta, const Tensor& g, double scale,
                                           const Tensor& initial_states,
                                           const std::vector<int64_t>& cu_seqlens, int64_t chunk_size) {
  check_inputs(q, k, v, beta, g);
  Fp32Scope fp32;
  const auto dt = accum_dtype(v);
  const DocumentChunks docs(cu_seqlens, q.size(1), chunk_size, v.device(), "delta_rule_chunked_varlen");
  return chunked_form_varlen(docs, q, v, initial_states, [&] {
    if (delta_rule_prepare_serves(q, k, v, beta, g, chunk_size))
      return prepare_chunks_kernel(q, k, v, beta, g, scale, chunk_size, &docs);
    return prepare_chunks(docs.to_chunks(q, dt), docs.to_chunks(k, dt), docs.to_chunks(v, dt),
                          docs.to_chunks(beta.unsqueeze(-1), dt), docs.cumulative_gate(g, q.size(2), dt), scale);
  });
}

Tensor delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                       const Tensor& g, double scale, Tensor& state) {
  const auto dt = state.scalar_type();
  Tensor decay = g.defined() ? state_decay(g, dt) : Tensor();
  auto [o, S] = delta_token(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), decay, scale, state);
  state.copy_(S);
  return o.to(v.scalar_type());
}

}  // namespace lt2::ops
