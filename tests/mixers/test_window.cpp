// Sliding-window attention (mixers/window.h): W keys including the current one, per-loop windows,
// ring-buffer decode state of W slots; the invariants of docs/architecture.md in float64.
#include <gtest/gtest.h>

#include "lt2/mixers/full_attention.h"
#include "lt2/mixers/window.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"
#include "mixers/sparse_testing.h"

namespace {

using namespace lt2;
using namespace lt2::sparse_testing;

// Windows per loop: 3, 5 and full (0).
ModelConfig window_config() { return attention_config("window", json{{"window", 4}, {"windows", {3, 5, 0}}}); }

TEST(Window, MatchesNaiveBandedSoftmax) {
  auto cfg = window_config();
  auto m = std::dynamic_pointer_cast<WindowAttentionImpl>(make_f64("window", cfg));
  auto x = random_x(2, 10, cfg.d_model);
  torch::NoGradGuard ng;
  for (int64_t loop : {0, 1}) {
    const int64_t W = m->window_at(loop), H = m->n_heads, G = H / m->n_kv_heads;
    [[maybe_unused]] auto [q, k, v, gate] = m->project(x, 0);  // [B, T, H, D], [B, T, H_kv, D]
    auto o = torch::zeros_like(q);
    for (int64_t t = 0; t < 10; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t lo = std::max<int64_t>(0, t - W + 1);
        auto keys = k.slice(1, lo, t + 1).select(2, h / G);  // [B, n, D]
        auto vals = v.slice(1, lo, t + 1).select(2, h / G);
        auto s = torch::einsum("bd,bnd->bn", {q.select(1, t).select(1, h), keys}) / std::sqrt(8.0);
        o.select(1, t).select(1, h).copy_(torch::einsum("bn,bnd->bd", {torch::softmax(s, -1), vals}));
      }
    EXPECT_LT(rel_err(m->forward(x, {0, loop}), m->output(o, x)), 1e-12) << "loop " << loop;
  }
}

TEST(Window, WindowCoveringTheSequenceEqualsFullAttention) {
  auto cfg = attention_config("window", json{{"window", 12}});
  auto w = make_f64("window", cfg);
  auto full = std::make_shared<FullAttentionImpl>(cfg);
  full->to(torch::kFloat64);
  copy_params(*w, *full);
  auto x = random_x(2, 12, cfg.d_model);
  torch::NoGradGuard ng;
  EXPECT_LT(rel_err(w->forward(x, {0, 0}), full->forward(x, {0, 0})), 1e-12);
  // A narrower window differs.
  auto narrow = make_f64("window", attention_config("window", json{{"window", 3}}));
  copy_params(*w, *narrow);
  EXPECT_GT(rel_err(narrow->forward(x, {0, 0}), full->forward(x, {0, 0})), 1e-3);
}

TEST(Window, ForwardEqualsStepsInEveryLoop) {
  auto cfg = window_config();
  auto m = make_f64("window", cfg);
  auto x = random_x(2, 13, cfg.d_model);
  for (int64_t loop = 0; loop < 3; ++loop) expect_forward_equals_steps(*m, x, loop);
}

TEST(Window, SplitPrefillEqualsWhole) {
  auto cfg = window_config();
  auto m = make_f64("window", cfg);
  auto x = random_x(2, 13, cfg.d_model, 2);
  // Splits shorter and longer than the window, chunks that wrap the ring.
  for (int64_t loop = 0; loop < 3; ++loop) expect_split_prefill(*m, x, {1, 2, 4, 7, 12}, loop);
}

TEST(Window, DecodeMemoryStaysAtWindowSlots) {
  auto cfg = window_config();
  auto m = std::dynamic_pointer_cast<WindowAttentionImpl>(make_f64("window", cfg));
  const int64_t B = 2, D = m->head_dim, H_kv = m->n_kv_heads, max_len = 1000;
  for (int64_t loop = 0; loop < 3; ++loop) {
    auto state = m->make_state(B, max_len, f64(), {loop});
    const int64_t slots = loop == 2 ? max_len : m->window_at(loop);
    EXPECT_EQ(state->bytes(), 2 * B * H_kv * slots * D * 8) << "loop " << loop;
    if (loop == 2) continue;
    auto x = random_x(B, 40, cfg.d_model, 3);
    torch::NoGradGuard ng;
    for (int64_t t = 0; t < 40; ++t) m->step(x.narrow(1, t, 1), {t, loop}, *state);
    EXPECT_EQ(state->bytes(), 2 * B * H_kv * slots * D * 8);
    EXPECT_EQ(dynamic_cast<RingKVCache&>(*state).slots(), slots);
  }
  // A state too small for the loop's window is refused.
  auto small = m->make_state(B, max_len, f64(), {0});
  auto x = random_x(B, 1, cfg.d_model);
  EXPECT_THROW(m->step(x, {0, 1}, *small), Error);
}

TEST(Window, GradientsMatchFiniteDifferences) {
  auto cfg = window_config();
  auto m = make_f64("window", cfg);
  auto x = random_x(1, 7, cfg.d_model, 4);
  EXPECT_LT(gradcheck_mixer(*m, x, /*loop=*/0), 1e-6);
}

// ops::window_attention with queries at the last T of L key positions (a continued prefill; NSA's
// window branch): each query attends to its own W-key band, counted back from its position.
TEST(Window, WindowAttentionAtTheLastPositionsMatchesNaiveBands) {
  torch::manual_seed(3);
  const int64_t B = 2, H = 4, H_kv = 2, T = 5, L = 12, D = 8;
  auto q = torch::randn({B, H, T, D}, f64()), k = torch::randn({B, H_kv, L, D}, f64());
  auto v = torch::randn({B, H_kv, L, D}, f64());
  for (int64_t W : {1, 3, 12, 0}) {
    auto want = torch::zeros({B, T, H, D}, f64());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t p = L - T + t, lo = W > 0 ? std::max<int64_t>(0, p - W + 1) : 0;
        auto keys = k.select(1, h / (H / H_kv)).slice(1, lo, p + 1);  // [B, n, D]
        auto vals = v.select(1, h / (H / H_kv)).slice(1, lo, p + 1);
        auto s = torch::einsum("bd,bnd->bn", {q.select(1, h).select(1, t), keys}) / std::sqrt(double(D));
        want.select(1, t).select(1, h).copy_(torch::einsum("bn,bnd->bd", {torch::softmax(s, -1), vals}));
      }
    EXPECT_LT(rel_err(window_attention(q, k, v, W), want), 1e-12) << "W " << W;
  }
  EXPECT_THROW(window_attention(q, k.narrow(2, 0, T - 1), v.narrow(2, 0, T - 1), 3), Error);  // T > L
  EXPECT_THROW(window_attention(q, k, v, -1), Error);
}

TEST(Window, Options) {
  EXPECT_EQ(std::dynamic_pointer_cast<WindowAttentionImpl>(make_mixer("window", lt2::testing::tiny_config(), 0))
                ->window_at(2), 2048);
  EXPECT_THROW(make_mixer("window", attention_config("window", json{{"windw", 3}}), 0), Error);
  EXPECT_THROW(make_mixer("window", attention_config("window", json{{"windows", {3, 5}}}), 0), Error);
  EXPECT_THROW(make_mixer("window", attention_config("window", json{{"window", -1}}), 0), Error);
}

}  // namespace
