#include "lt2/mixers/window.h"

#include <algorithm>
#include <cmath>

#include "lt2/mixers/builtin.h"
#include "lt2/ops/attention/decode.h"
#include "lt2/ops/sparse_attention/sparse_attention.h"

namespace lt2 {

namespace {

// Absolute positions held by the first n_valid slots of a ring of S slots after `end` tokens were
// written (token p in slot p mod S; n_valid = min(end, S)). [n_valid] int64.
Tensor slot_positions(int64_t end, int64_t n_valid, int64_t S, torch::Device device) {
  auto s = torch::arange(n_valid, torch::TensorOptions().dtype(torch::kLong).device(device));
  return (end - 1) - ((end - 1) - s) % S;
}

Tensor positions(int64_t start, int64_t count, torch::Device device) {
  return torch::arange(start, start + count, torch::TensorOptions().dtype(torch::kLong).device(device));
}

}  // namespace

int64_t RingKVCache::bytes() const { return k.nbytes() + v.nbytes(); }

std::unique_ptr<MixerState> RingKVCache::slice(int64_t begin, int64_t count) const {
  auto s = std::make_unique<RingKVCache>();
  s->k = k.narrow(0, begin, count);
  s->v = v.narrow(0, begin, count);
  s->window = window;
  s->max_len = max_len;
  return s;
}

int64_t RingKVCache::decode_bytes(int64_t length) const {
  return (k.nbytes() + v.nbytes()) / slots() * std::min(length + 1, slots());
}

WindowAttentionImpl::WindowAttentionImpl(const ModelConfig& cfg, int64_t window,
                                         std::vector<int64_t> loop_windows)
    : FullAttentionImpl(cfg), base_window(window), loop_windows_(std::move(loop_windows)) {
  for (int64_t w : loop_windows_)
    LT2_CHECK(w >= 0, "window: window sizes must be >= 0 (0 = full attention), found ", w);
  caps_.per_loop = true;
}

int64_t WindowAttentionImpl::window_at(int64_t loop) const {
  LT2_CHECK(loop >= 0 && loop < static_cast<int64_t>(loop_windows_.size()), "window: loop ", loop,
            " has no window (", loop_windows_.size(), " loops configured)");
  return loop_windows_[loop];
}

int64_t WindowAttentionImpl::window_for(const LoopSettings& s) const {
  switch (s.slot) {
    case SlotDraw::Full: return 0;
    case SlotDraw::Window: return base_window;
    case SlotDraw::Configured: break;
  }
  if (s.loop >= 0) return window_at(s.loop);
  const bool any_full = std::count(loop_windows_.begin(), loop_windows_.end(), 0) > 0;
  return any_full ? 0 : *std::max_element(loop_windows_.begin(), loop_windows_.end());
}

std::unique_ptr<RingKVCache> WindowAttentionImpl::make_ring(int64_t batch, int64_t max_len,
                                                            torch::TensorOptions opts,
                                                            int64_t window) const {
  const int64_t S = window > 0 ? std::min(window, max_len) : max_len;
  auto s = std::make_unique<RingKVCache>();
  s->k = torch::zeros({batch, n_kv_heads, S, head_dim}, opts);
  s->v = torch::zeros({batch, n_kv_heads, S, head_dim}, opts);
  s->window = window;
  s->max_len = max_len;
  return s;
}

std::unique_ptr<MixerState> WindowAttentionImpl::make_state(int64_t batch, int64_t max_len,
                                                            torch::TensorOptions opts,
                                                            const LoopSettings& loop) const {
  return make_ring(batch, max_len, opts, window_for(loop));
}

RingKVCache& WindowAttentionImpl::ring_for(MixerState& state, const Positions& pos) const {
  auto& ring = dynamic_cast<RingKVCache&>(state);
  LT2_CHECK(pos.seq_pos.defined() || ring.length == pos.start, "window state holds ", ring.length,
            " tokens but the call starts at position ", pos.start);
  const int64_t W = window_for(pos.loop_settings());
  LT2_CHECK(ring.slots() >= (W > 0 ? std::min(W, ring.max_len) : ring.max_len),
            "window state has ", ring.slots(), " slots, too few for window ", W, " in loop ",
            pos.loop, " (make the state for this loop)");
  return ring;
}

Tensor WindowAttentionImpl::forward(const Tensor& x, const Positions& pos, MixerState* state) {
  if (state && x.size(1) == 1) return step(x, pos, *state);
  const int64_t T = x.size(1), W = window_for(pos.loop_settings());
  auto [q, k, v, gate] = project(x, pos);
  auto qh = q.transpose(1, 2);  // [B, H, T, D]
  if (!state) return output(window_attention(qh, k.transpose(1, 2), v.transpose(1, 2), W), x, gate);
  auto q_pos = positions(pos.start, T, x.device());
  auto& ring = ring_for(*state, pos);
  const int64_t S = ring.slots(), past = std::min(ring.length, S);
  // Keys: the cached tokens (in slot order) followed by the new ones; the mask reads positions.
  auto k_all = torch::cat({ring.k.narrow(2, 0, past).to(q.scalar_type()), k.transpose(1, 2)}, 2);
  auto v_all = torch::cat({ring.v.narrow(2, 0, past).to(q.scalar_type()), v.transpose(1, 2)}, 2);
  auto k_pos = torch::cat({slot_positions(ring.length, past, S, x.device()), q_pos});
  auto o = masked_attention(qh, k_all, v_all, window_mask(q_pos, k_pos, W));  // [B, T, H, D]
  // Keep the last min(T, S) new tokens.
  const int64_t keep = std::min(T, S);
  auto slots = positions(pos.start + T - keep, keep, x.device()) % S;
  ring.k.index_copy_(2, slots, k.narrow(1, T - keep, keep).transpose(1, 2).to(ring.k.scalar_type()));
  ring.v.index_copy_(2, slots, v.narrow(1, T - keep, keep).transpose(1, 2).to(ring.v.scalar_type()));
  ring.length = pos.start + T;
  return output(o, x, gate);
}

Tensor WindowAttentionImpl::step_at(const Tensor& x, const Positions& pos, RingKVCache& ring) {
  const int64_t W = window_for(pos.loop_settings()), S = ring.slots(), B = x.size(0);
  auto [q, k, v, gate] = project(x, pos);
  const auto& p = pos.seq_pos;  // [B]
  cache_write_at(ring.k, k.transpose(1, 2), p.remainder(S));
  cache_write_at(ring.v, v.transpose(1, 2), p.remainder(S));
  if (W == 0 || S <= W) {
    // Every written slot is inside the window, and the written slots are a prefix of the ring
    // (slots 0..p before it wraps, all S after): attention over the first min(p + 1, S) slots, in
    // slot order (softmax does not depend on the order of the keys), through flash-decoding.
    auto o = ops::attention_decode(q.squeeze(1), ring.k, ring.v, pos.seq_lens.clamp_max(S),
                                   1.0 / std::sqrt(static_cast<double>(head_dim)))
                 .unsqueeze(1);
    return output(o, x, gate);
  }
  auto age = (p.unsqueeze(1) - torch::arange(S, p.options()).unsqueeze(0)).remainder(S);  // [B, S] p - p_j >= 0
  auto visible = age <= p.unsqueeze(1);                                                     // p_j >= 0
  if (W > 0) visible = visible & (age < W);
  auto o = masked_attention(q.transpose(1, 2), ring.k.to(q.scalar_type()), ring.v.to(q.scalar_type()),
                            visible.view({B, 1, 1, S}));
  return output(o, x, gate);
}

Tensor WindowAttentionImpl::step(const Tensor& x, const Positions& pos, MixerState& state) {
  auto& ring = ring_for(state, pos);
  if (pos.seq_pos.defined()) return step_at(x, pos, ring);
  const int64_t W = window_for(pos.loop_settings()), S = ring.slots();
  auto [q, k, v, gate] = project(x, pos);
  // Write the new token first, then attend over the valid slots: no copy of the cache.
  const int64_t slot = pos.start % S;
  ring.k.select(2, slot).copy_(k.select(1, 0));
  ring.v.select(2, slot).copy_(v.select(1, 0));
  ring.length = pos.start + 1;
  const int64_t n_valid = std::min(ring.length, S);
  auto k_pos = slot_positions(ring.length, n_valid, S, x.device());
  auto mask = window_mask(positions(pos.start, 1, x.device()), k_pos, W);  // [1, n_valid]
  auto o = masked_attention(q.transpose(1, 2), ring.k.narrow(2, 0, n_valid).to(q.scalar_type()),
                            ring.v.narrow(2, 0, n_valid).to(q.scalar_type()), mask);
  return output(o, x, gate);
}

MixerInfo window_attention_info() {
  return {"window",
          "sliding-window softmax attention (W keys incl. the current; per-loop windows), "
          "full-attention weights; ring-buffer KV cache of W tokens",
          [](const ModelConfig& cfg, int64_t) -> Mixer {
            const auto opts = cfg.options_for("window");
            json_reject_unknown(opts, {"window", "windows"}, "mixer.window");
            int64_t window = 2048;
            json_get(opts, "window", window, "mixer.window");
            std::vector<int64_t> windows(cfg.n_loops, window);
            json_get(opts, "windows", windows, "mixer.window");
            LT2_CHECK(static_cast<int64_t>(windows.size()) == cfg.n_loops, "mixer.window: 'windows' lists ",
                      windows.size(), " windows but the model has n_loops = ", cfg.n_loops);
            LT2_CHECK(window >= 0, "mixer.window: 'window' must be >= 0 (0 = full), found ", window);
            return std::make_shared<WindowAttentionImpl>(cfg, window, windows);
          }};
}

}  // namespace lt2
