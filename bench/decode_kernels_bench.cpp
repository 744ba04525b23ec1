// Micro-benchmark of the fused decode kernels (ops/fused_decode.h) at a preset's decode shapes:
//   gdn_decode       GDN's step after its projections (gdn_decode_fused), the preset's GDN heads,
//                    in the form the launcher picks; gdn_decode_registers, gdn_decode_per_head,
//                    gdn_decode_cluster force one form (kernels::GdnDecodeForm)
//   recurrent_step   the generic recurrent step (recurrent_step_fused) on the same heads: delta
//                    rule, one decay per head
//   gdn_layer_step   the whole GDN layer's decode step (projections + kernel + o_proj)
//   attention        flash-decoding (attention_decode), the preset's attention heads, every
//                    sequence holding `context` keys
//   rms_norm         a block's mixer_norm on [B, 1, d] (rms_norm_fused vs the fp32-cast rms_norm)
//   add_rms_norm     its residual add + ffn_norm (add_rms_norm_fused vs x + m, rms_norm)
//   silu_mul         SwiGLU's activation on the packed w1|w3 output (silu_mul_fused vs silu * mul)
//   gemv             the decode projections y = x W^T at the preset's shapes (GDN's packed inputs,
//                    o_proj, FFN w1|w3 and w2, the LM head): gemv_fused vs at::linear (cuBLAS),
//                    both graph-replayed over enough weight copies that none is served from L2
//   gemv_chain       a block's tail (the mixer's output projection with the residual, w1|w3 with
//                    the RMSNorm and SiLU * mul as its epilogue, w2 with the residual) as one
//                    chained kernel (gemv_chain_fused), and as a chain of two with a GEMV for w2,
//                    vs its three gemv_fused launches, rotated like gemv; and each gemv shape
//                    alone through the chain kernel (vs at::linear)
// for each batch size. A kernel is captured `reps` times in one CUDA graph (as the engine runs it:
// no launch gaps) and the replays are timed with CUDA events; the median per call is reported with
// the bytes the call must move, GB/s and the % of a device-to-device copy measured in the same
// run. The libtorch reference of each (fused decode off, eager: what the engine replaces) is timed
// next to it, per call with CUDA events; the elementwise references are graph-replayed like their
// kernels (at a few us per call, eager launch gaps would dominate). A table, then one `RESULT {json}` line per row.
//   decode_kernels_bench [--model lt2-full-gdn-1.3b] [--batches 1,8,32]
//                        [--contexts 4096,8192,16384,32768,65536,131072] [--dtype bf16]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "lt2/config/presets.h"
#include "lt2/infer/bench.h"
#include "lt2/kernels/decode.h"
#include "lt2/mixers/full_attention.h"
#include "lt2/mixers/gdn.h"
#include "lt2/mixers/registry.h"
#include "lt2/ops/projections/projections.h"
#include "lt2/ops/decode_options.h"
#include "lt2/ops/delta_rule/delta_rule.h"
#include "lt2/ops/fused_common.h"
#include "lt2/ops/fused_decode.h"
#include "lt2/util/json.h"

#ifdef LT2_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using torch::Tensor;

struct Settings {
  std::string model = "lt2-full-gdn-1.3b", dtype = "bf16";
  std::vector<int64_t> batches{1, 8, 32};
  std::vector<int64_t> contexts{4096, 8192, 16384, 32768, 65536, 131072};
  std::vector<std::string> kernels{"gdn_decode",          "gdn_decode_registers", "gdn_decode_per_head",
                                   "gdn_decode_cluster",  "recurrent_step",       "gdn_layer_step",
                                   "attention",           "rms_norm",             "add_rms_norm",
                                   "silu_mul",            "gemv",                 "gemv_chain"};
  std::vector<int> gemv_splits{0};  // 0: the K splits gemv picks
  int warmup = 5, iters = 20, reps = 10;
  bool reference = true;
};

struct Row {
  std::string kernel;
  int64_t batch = 0, context = 0;  // context: attention only
  double us = 0, bytes = 0, reference_us = 0;
};

#ifdef LT2_WITH_CUDA

// Median milliseconds of f over `iters` calls timed with CUDA events, after `warmup` calls.
double median_ms(int warmup, int iters, const std::function<void()>& f) {
  for (int i = 0; i < warmup; ++i) f();
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    start.record();
    f();
    stop.record();
    stop.synchronize();
    ms.push_back(start.elapsed_time(stop));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Microseconds per call of f when `reps` calls are captured in one CUDA graph and replayed.
double graph_us(const Settings& s, const std::function<void()>& f) {
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());  // capture needs a side stream
  f();  // eager warm-up: lazy initialisation and kernel attributes happen outside the capture
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  for (int r = 0; r < s.reps; ++r) f();
  graph.capture_end();
  return 1e3 * median_ms(s.warmup, s.iters, [&] { graph.replay(); }) / s.reps;
}

// Microseconds per eager call of f with the fused decode kernels off (the libtorch reference).
double reference_us(const Settings& s, const std::function<void()>& f) {
  lt2::DecodeOptions reference;
  reference.fused = false;
  lt2::DecodeOptionsGuard guard(reference);
  return 1e3 * median_ms(s.warmup, s.iters, f);
}

double bytes_of(const std::vector<Tensor>& ts) {
  double n = 0;
  for (const auto& t : ts)
    if (t.defined()) n += static_cast<double>(t.nbytes());
  return n;
}

std::shared_ptr<lt2::GatedDeltaNetImpl> make_gdn(const lt2::ModelConfig& cfg, torch::ScalarType dt) {
  auto gdn = std::dynamic_pointer_cast<lt2::GatedDeltaNetImpl>(lt2::make_mixer("gdn", cfg, 0));
  LT2_CHECK(gdn, "decode_kernels_bench: preset ", cfg.name, " has no GDN mixer");
  LT2_CHECK(gdn->num_v_heads == gdn->num_heads, "decode_kernels_bench: the fused GDN kernel needs ",
            "num_v_heads == num_heads, preset ", cfg.name, " has ", gdn->num_v_heads, " and ", gdn->num_heads);
  gdn->to(torch::kCUDA, dt);
  gdn->eval();
  return gdn;
}

// gdn_decode: every byte the kernel reads or writes once (state and conv windows both ways).
Row bench_gdn_decode(const Settings& s, lt2::GatedDeltaNetImpl& m, int64_t B, torch::ScalarType dt,
                     lt2::kernels::GdnDecodeForm form, const std::string& kernel) {
  const int64_t H = m.num_heads, K = m.head_k_dim, V = m.head_v_dim, W = m.conv_kernel;
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dt);
  lt2::ops::GdnDecodeArgs a;
  a.q = torch::randn({B, H * K}, opts), a.k = torch::randn({B, H * K}, opts);
  a.v = torch::randn({B, H * V}, opts), a.gate = torch::randn({B, H * V}, opts);
  a.a = torch::randn({B, H}, opts), a.b = torch::randn({B, H}, opts);
  a.q_conv_weight = m.q_conv1d->weight, a.k_conv_weight = m.k_conv1d->weight, a.v_conv_weight = m.v_conv1d->weight;
  a.A_log = m.A_log, a.dt_bias = m.dt_bias, a.norm_weight = m.o_norm->weight;
  a.num_heads = H, a.head_k_dim = K, a.head_v_dim = V;
  a.scale = m.scale(), a.norm_eps = m.norm_eps, a.allow_neg_eigval = m.allow_neg_eigval;
  a.form = form;
  auto state = torch::randn({B, H, K, V}, opts.dtype(torch::kFloat32)) * 0.1;
  auto q_win = torch::randn({B, W - 1, H * K}, opts), k_win = torch::randn({B, W - 1, H * K}, opts);
  auto v_win = torch::randn({B, W - 1, H * V}, opts);
  Row r{kernel, B};
  r.us = graph_us(s, [&] { lt2::ops::gdn_decode_fused(a, state, q_win, k_win, v_win); });
  r.bytes = 2 * bytes_of({state, q_win, k_win, v_win}) +
            bytes_of({a.q, a.k, a.v, a.gate, a.a, a.b, a.q_conv_weight, a.k_conv_weight, a.v_conv_weight,
                      a.A_log, a.dt_bias, a.norm_weight}) +
            static_cast<double>(B * H * V) * a.q.element_size();  // y
  return r;
}

Row bench_recurrent_step(const Settings& s, const lt2::GatedDeltaNetImpl& m, int64_t B, torch::ScalarType dt) {
  const int64_t H = m.num_heads, K = m.head_k_dim, V = m.head_v_dim;
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dt);
  auto f32 = opts.dtype(torch::kFloat32);
  auto k = torch::randn({B, H, K}, f32);
  k = (k / k.norm(2, -1, true)).to(dt);
  auto q = torch::randn({B, H, K}, opts), v = torch::randn({B, H, V}, opts);
  auto beta = torch::sigmoid(torch::randn({B, H}, f32)), g = -torch::rand({B, H}, f32);
  auto state = torch::randn({B, H, K, V}, f32) * 0.1;
  Row r{"recurrent_step", B};
  r.us = graph_us(s, [&] { lt2::ops::recurrent_step_fused(q, k, v, beta, g, m.scale(), state); });
  r.bytes = 2 * bytes_of({state}) + bytes_of({q, k, v, beta, g}) + bytes_of({v});  // + o
  if (s.reference)
    r.reference_us = reference_us(s, [&] { lt2::ops::delta_rule_step(q, k, v, beta, g, m.scale(), state); });
  return r;
}

// The layer's decode step: its parameters are read once, its state read and written once.
Row bench_gdn_layer(const Settings& s, lt2::GatedDeltaNetImpl& m, int64_t B, torch::ScalarType dt) {
  torch::NoGradGuard ng;
  const int64_t d = m.q_proj->weight.size(1);
  auto x = torch::randn({B, 1, d}, torch::TensorOptions().device(torch::kCUDA).dtype(dt));
  auto state = m.make_state(B, 1, x.options());
  for (auto& t : state->tensors()) t.copy_(torch::randn_like(t, torch::kFloat32) * 0.1);
  lt2::Positions pos;
  pos.seq_pos = torch::zeros({B}, x.options().dtype(torch::kInt64));  // no length bookkeeping
  Row r{"gdn_layer_step", B};
  r.us = graph_us(s, [&] { m.step(x, pos, *state); });
  r.bytes = bytes_of(m.parameters()) + 2 * static_cast<double>(state->bytes()) + 2 * bytes_of({x});
  if (s.reference) r.reference_us = reference_us(s, [&] { m.step(x, pos, *state); });
  return r;
}

Row bench_attention(const Settings& s, const lt2::ModelConfig& cfg, int64_t B, int64_t L, torch::ScalarType dt) {
  const int64_t Hq = cfg.n_heads, Hkv = cfg.kv_heads(), D = cfg.dim_head();
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dt);
  auto k = torch::randn({B, Hkv, L, D}, opts), v = torch::randn({B, Hkv, L, D}, opts);
  auto q = torch::randn({B, Hq, D}, opts);
  auto lens = torch::full({B}, L, opts.dtype(torch::kInt64));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Row r{"attention", B, L};
  r.us = graph_us(s, [&] { lt2::ops::attention_decode(q, k, v, lens, scale); });
  const int splits = lt2::kernels::attention_decode_num_splits(static_cast<int>(B), static_cast<int>(Hkv),
                                                               static_cast<int>(L), q.device().index());
  r.bytes = bytes_of({k, v, q, q}) + (splits > 1 ? 2.0 * B * Hq * splits * (D + 1) * sizeof(float) : 0);
  if (s.reference) r.reference_us = reference_us(s, [&] { lt2::decode_attention(q, k, v, lens, scale); });
  return r;
}

// The elementwise kernels of a block at the model width d (FFN width for silu_mul), one decode
// token per sequence: input and output bytes (and the weight) once.
Row bench_elementwise(const Settings& s, const lt2::ModelConfig& cfg, const std::string& kernel, int64_t B,
                      torch::ScalarType dt) {
  torch::NoGradGuard ng;
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dt);
  const int64_t d = cfg.d_model, hidden = cfg.ffn_dim();
  const double eps = cfg.norm_eps;
  auto x = torch::randn({B, 1, d}, opts), m = torch::randn({B, 1, d}, opts);
  auto w = 1 + 0.1 * torch::randn({d}, opts);
  auto gate_up = torch::randn({B, 1, 2 * hidden}, opts);
  Row r{kernel, B};
  std::function<void()> fused, reference;
  if (kernel == "rms_norm") {
    fused = [&] { lt2::ops::rms_norm_fused(x, w, eps); };
    reference = [&] { lt2::rms_norm(x, w, eps); };
    r.bytes = bytes_of({x, w, x});
  } else if (kernel == "add_rms_norm") {
    fused = [&] { lt2::ops::add_rms_norm_fused(x, m, w, eps); };
    reference = [&] { lt2::rms_norm(x + m, w, eps); };
    r.bytes = bytes_of({x, m, w, x, x});  // h and y written
  } else {
    fused = [&] { lt2::ops::silu_mul_fused(gate_up); };
    reference = [&] { torch::silu(gate_up.narrow(-1, 0, hidden)) * gate_up.narrow(-1, hidden, hidden); };
    r.bytes = 1.5 * bytes_of({gate_up});
  }
  r.us = graph_us(s, fused);
  // In a graph too: the engine replays these in its decode graph, so launch gaps are not counted.
  if (s.reference) r.reference_us = graph_us(s, reference);
  return r;
}

// y = x W^T for W [N, K]: the fused GEMV against at::linear. Calls rotate over copies of W that
// add up to well past the 50 MB L2, so every call reads its weight from memory.
Row bench_gemv(const Settings& s, int64_t N, int64_t K, int64_t B, torch::ScalarType dt, int k_splits,
               bool chained) {
  torch::NoGradGuard ng;
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dt);
  const double w_bytes = double(N * K) * torch::elementSize(dt);
  const int copies = static_cast<int>(std::max(1.0, std::ceil(256e6 / w_bytes)));
  std::vector<Tensor> ws;
  for (int i = 0; i < copies; ++i) ws.push_back(torch::randn({N, K}, opts) * 0.02);
  auto x = torch::randn({B, 1, K}, opts);
  Settings rotated = s;
  rotated.reps = std::max(s.reps, copies);
  const int splits = k_splits ? k_splits
                              : lt2::kernels::gemv_k_splits(N, static_cast<int>(K), lt2::ops::detail::kernel_dtype(dt),
                                                            c10::cuda::current_device());
  Row r{chained ? lt2::cat("gemv ", N, "x", K, " (chain kernel)")
                : lt2::cat("gemv ", N, "x", K, " /", splits, k_splits ? "" : " (auto)"),
        B};
  lt2::ops::GemvFusion f;
  f.k_splits = splits;
  int next = 0;
  if (chained) {
    LT2_CHECK(!lt2::ops::gemv_chain_fused(x, {lt2::ops::ChainProduct{ws[0]}}).empty(), "gemv_chain does not take ", N,
              "x", K, " here");
    r.us = graph_us(rotated, [&] { lt2::ops::gemv_chain_fused(x, {lt2::ops::ChainProduct{ws[next++ % copies]}}); });
  } else {
    r.us = graph_us(rotated, [&] { lt2::ops::gemv_fused(x, ws[next++ % copies], f); });
  }
  r.bytes = w_bytes + bytes_of({x}) + double(B * N) * torch::elementSize(dt);
  next = 0;
  if (s.reference) r.reference_us = graph_us(rotated, [&] { at::linear(x, ws[next++ % copies]); });
  return r;
}

// A block's decode tail on y [B, k_mix]: h = residual + y Wo^T, [a | b] = rms(h) W13^T,
// out = h + (silu(a) b) W2^T, as the engine runs it (silu(a) b as w1|w3's epilogue), chained in
// one kernel or (split_down) as a chain of the first two and a gemv_fused launch for w2, against
// three gemv_fused launches (SiLU·mul as w2's prologue). Calls rotate over weight copies like
// bench_gemv.
Row bench_gemv_chain(const Settings& s, int64_t d, int64_t k_mix, int64_t ffn, int64_t B, torch::ScalarType dt,
                     bool split_down) {
  torch::NoGradGuard ng;
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dt);
  const double w_bytes = double(d * k_mix + 3 * ffn * d) * torch::elementSize(dt);
  const int copies = static_cast<int>(std::max(1.0, std::ceil(256e6 / w_bytes)));
  auto y = torch::randn({B, k_mix}, opts), residual = torch::randn({B, d}, opts);
  auto norm_weight = 1 + 0.1 * torch::randn({d}, opts);
  std::vector<std::vector<lt2::ops::ChainProduct>> chains;
  for (int i = 0; i < copies; ++i) {
    lt2::ops::ChainProduct projection{torch::randn({d, k_mix}, opts) * 0.02},
        gate_up{torch::randn({2 * ffn, d}, opts) * 0.02}, down{torch::randn({d, ffn}, opts) * 0.02};
    projection.fusion.residual = residual;
    gate_up.fusion.norm_weight = norm_weight, gate_up.silu_mul_out = true;
    down.residual_of = 0;
    chains.push_back({projection, gate_up, down});
  }
  auto run = [&](const std::vector<lt2::ops::ChainProduct>& c) {
    if (!split_down) return !lt2::ops::gemv_chain_fused(y, c).empty();
    const auto out = lt2::ops::gemv_chain_fused(y, {c[0], c[1]});
    if (out.empty()) return false;
    lt2::ops::GemvFusion add;
    add.residual = out[0];
    lt2::ops::gemv_fused(out[1], c[2].w, add);
    return true;
  };
  LT2_CHECK(run(chains[0]), "gemv_chain: the chain kernel does not take ", B, " rows of d ", d, ", k ", k_mix,
            ", ffn ", ffn, " here");
  Settings rotated = s;
  rotated.reps = std::max(s.reps, copies);
  Row r{split_down ? lt2::cat("gemv_chain ", d, "x", k_mix, "+", 2 * ffn, "x", d, " + gemv ", d, "x", ffn)
                   : lt2::cat("gemv_chain ", d, "x", k_mix, "+", 2 * ffn, "x", d, "+", d, "x", ffn),
        B};
  int next = 0;
  r.us = graph_us(rotated, [&] { run(chains[next++ % copies]); });
  r.bytes = w_bytes + double(B * (k_mix + 4 * d + 2 * ffn)) * torch::elementSize(dt);
  next = 0;
  if (s.reference)
    r.reference_us = graph_us(rotated, [&] {
      const auto& c = chains[next++ % copies];
      auto h = lt2::ops::gemv_fused(y, c[0].w, c[0].fusion);
      auto gu = lt2::ops::gemv_fused(h, c[1].w, c[1].fusion);
      lt2::ops::GemvFusion down;
      down.silu_mul = true, down.residual = h;
      lt2::ops::gemv_fused(gu, c[2].w, down);
    });
  return r;
}

#endif  // LT2_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Time the fused decode kernels against the copy bandwidth and their libtorch references"};
  Settings s;
  app.add_option("--model", s.model, "Preset (or config file) whose GDN and attention heads to use")
      ->capture_default_str();
  app.add_option("--batches", s.batches, "Batch sizes")->delimiter(',')->capture_default_str();
  app.add_option("--contexts", s.contexts, "Keys per sequence for attention")->delimiter(',')->capture_default_str();
  app.add_option("--kernels", s.kernels,
                 "Which rows: gdn_decode, gdn_decode_registers, gdn_decode_per_head, gdn_decode_cluster, recurrent_step, "
                 "gdn_layer_step, attention, rms_norm, add_rms_norm, silu_mul, gemv, gemv_chain")
      ->delimiter(',')->capture_default_str();
  app.add_option("--dtype", s.dtype, "Activation dtype: bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  app.add_option("--warmup", s.warmup, "Untimed calls before timing")->capture_default_str();
  app.add_option("--iters", s.iters, "Timed calls (graph replays); the median is reported")->capture_default_str();
  app.add_option("--reps", s.reps, "Kernel calls captured per graph")->capture_default_str();
  app.add_option("--gemv-splits", s.gemv_splits,
                 "gemv rows: K splits over a thread-block cluster to time (0: the ones gemv picks)")
      ->delimiter(',')->check(CLI::Range(0, lt2::kernels::kGemvMaxKSplits))->capture_default_str();
  app.add_flag("!--no-reference", s.reference, "Skip timing the libtorch references");
  CLI11_PARSE(app, argc, argv);
#ifndef LT2_WITH_CUDA
  std::fprintf(stderr, "decode_kernels_bench: this build has no CUDA kernels\n");
  return 1;
#else
  try {
    LT2_CHECK(torch::cuda::is_available(), "decode_kernels_bench needs a CUDA GPU");
    LT2_CHECK(s.iters >= 1 && s.reps >= 1 && s.warmup >= 0, "--iters and --reps must be >= 1, --warmup >= 0");
    const auto dt = s.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    auto cfg = lt2::load_model_config(s.model);
    const double copy_gbs = lt2::measure_copy_bandwidth_gbs("cuda");
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbs);
    auto wants = [&](const std::string& k) { return std::count(s.kernels.begin(), s.kernels.end(), k) > 0; };
    std::shared_ptr<lt2::GatedDeltaNetImpl> gdn;
    if (wants("gdn_decode") || wants("gdn_decode_registers") || wants("gdn_decode_per_head") ||
        wants("gdn_decode_cluster") || wants("recurrent_step") || wants("gdn_layer_step"))
      gdn = make_gdn(cfg, dt);

    std::printf("\n| kernel | batch | context | us | MB moved | GB/s | %% copy BW | reference us | speed-up |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    std::vector<lt2::json> results;
    auto report = [&](const Row& r) {
      const double gbs = r.bytes / (r.us * 1e-6) / 1e9;
      char context[32] = "-", reference[32] = "-", speedup[32] = "-";
      if (r.context) std::snprintf(context, sizeof context, "%lld", static_cast<long long>(r.context));
      if (r.reference_us > 0) {
        std::snprintf(reference, sizeof reference, "%.1f", r.reference_us);
        std::snprintf(speedup, sizeof speedup, "%.1fx", r.reference_us / r.us);
      }
      std::printf("| %s | %lld | %s | %.1f | %.2f | %.0f | %.1f | %s | %s |\n", r.kernel.c_str(),
                  static_cast<long long>(r.batch), context, r.us, r.bytes / 1e6, gbs, 100 * gbs / copy_gbs,
                  reference, speedup);
      std::fflush(stdout);
      lt2::json j{{"bench", "decode_kernels"}, {"model", cfg.name}, {"kernel", r.kernel}, {"dtype", s.dtype},
                  {"batch", r.batch}, {"us", r.us}, {"bytes", r.bytes}, {"gb_per_s", gbs},
                  {"copy_gb_per_s", copy_gbs}, {"copy_pct", 100 * gbs / copy_gbs}, {"graph_reps", s.reps}};
      if (r.kernel.rfind("gemv_chain", 0) == 0) {
        j["reference"] = "gemv_fused, one launch per product";
      } else if (r.kernel.rfind("gemv", 0) == 0) {
        j["reference"] = "at::linear";
      } else if (r.kernel == "rms_norm" || r.kernel == "add_rms_norm" || r.kernel == "silu_mul") {
        j["d_model"] = cfg.d_model;
        j["ffn_dim"] = cfg.ffn_dim();
      } else if (r.kernel == "attention") {
        j["context"] = r.context;
        j["q_heads"] = cfg.n_heads;
        j["kv_heads"] = cfg.kv_heads();
        j["head_dim"] = cfg.dim_head();
      } else {
        j["heads"] = gdn->num_heads;
        j["head_k"] = gdn->head_k_dim;
        j["head_v"] = gdn->head_v_dim;
      }
      if (r.reference_us > 0) {
        j["reference_us"] = r.reference_us;
        j["speedup"] = r.reference_us / r.us;
      }
      results.push_back(j);
    };
    for (int64_t B : s.batches) {
      using lt2::kernels::GdnDecodeForm;
      if (wants("gdn_decode")) report(bench_gdn_decode(s, *gdn, B, dt, GdnDecodeForm::Auto, "gdn_decode"));
      if (wants("gdn_decode_registers") &&
          lt2::kernels::gdn_decode_registers_supported(static_cast<int>(gdn->head_k_dim),
                                                       static_cast<int>(gdn->head_v_dim)))
        report(bench_gdn_decode(s, *gdn, B, dt, GdnDecodeForm::Registers, "gdn_decode_registers"));
      if (wants("gdn_decode_per_head"))
        report(bench_gdn_decode(s, *gdn, B, dt, GdnDecodeForm::PerHead, "gdn_decode_per_head"));
      if (wants("gdn_decode_cluster") &&
          lt2::kernels::gdn_decode_cluster_supported(static_cast<int>(gdn->head_k_dim),
                                                     static_cast<int>(gdn->head_v_dim),
                                                     c10::cuda::current_device()))
        report(bench_gdn_decode(s, *gdn, B, dt, GdnDecodeForm::Cluster, "gdn_decode_cluster"));
      if (wants("recurrent_step")) report(bench_recurrent_step(s, *gdn, B, dt));
      if (wants("gdn_layer_step")) report(bench_gdn_layer(s, *gdn, B, dt));
    }
    for (int64_t B : s.batches)
      for (const char* k : {"rms_norm", "add_rms_norm", "silu_mul"})
        if (wants(k)) report(bench_elementwise(s, cfg, k, B, dt));
    // (N, K) of the decode projections: GDN's packed inputs and o_proj (when the preset has GDN),
    // the packed FFN w1|w3 and w2, the LM head.
    std::vector<std::pair<int64_t, int64_t>> gemv_shapes;
    if (gdn) {
      int64_t packed = 0;
      for (const auto& l : {gdn->q_proj, gdn->k_proj, gdn->v_proj, gdn->a_proj, gdn->b_proj, gdn->g_proj})
        if (l) packed += l->weight.size(0);
      gemv_shapes.push_back({packed, cfg.d_model});
      gemv_shapes.push_back({cfg.d_model, gdn->o_proj->weight.size(1)});
    }
    gemv_shapes.push_back({2 * cfg.ffn_dim(), cfg.d_model});
    gemv_shapes.push_back({cfg.d_model, cfg.ffn_dim()});
    if (cfg.vocab_size > 0) gemv_shapes.push_back({cfg.vocab_size, cfg.d_model});
    if (wants("gemv")) {
      for (int64_t B : s.batches)
        if (B <= lt2::kernels::kGemvMaxRows)
          for (auto [N, K] : gemv_shapes)
            for (int splits : s.gemv_splits) report(bench_gemv(s, N, K, B, dt, splits, false));
    }
    if (wants("gemv_chain"))
      for (int64_t B : s.batches)
        if (B <= lt2::kernels::kGemvMaxRows) {
          // The tail after GDN (o_proj's K is its value width) and after attention (K = d).
          for (bool split_down : {false, true}) {
            if (gdn)
              report(bench_gemv_chain(s, cfg.d_model, gdn->o_proj->weight.size(1), cfg.ffn_dim(), B, dt, split_down));
            report(bench_gemv_chain(s, cfg.d_model, cfg.d_model, cfg.ffn_dim(), B, dt, split_down));
          }
          for (auto [N, K] : gemv_shapes) report(bench_gemv(s, N, K, B, dt, 0, true));
        }
    if (wants("attention"))
      for (int64_t B : s.batches)
        for (int64_t L : s.contexts) {
          try {
            report(bench_attention(s, cfg, B, L, dt));
          } catch (const c10::OutOfMemoryError&) {
            std::printf("| attention | %lld | %lld | OOM |\n", static_cast<long long>(B), static_cast<long long>(L));
          }
          c10::cuda::CUDACachingAllocator::emptyCache();  // the next cell's caches may be larger
        }
    std::printf("\n");
    for (const auto& j : results) std::printf("RESULT %s\n", j.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_kernels_bench: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}
