#include "lt2/infer/engine.h"

#include <algorithm>

#include "lt2/infer/memory_plan.h"
#include "lt2/nn/precision.h"
#include "lt2/util/error.h"
#include "lt2/util/units.h"

#ifdef LT2_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lt2 {

// One bucket's decode step: views of its slots, the plan compiled over them, the static inputs the
// step reads and, on CUDA, the captured graph and its output.
struct Engine::Bucket {
  Bucket(const LoopedLMImpl& model, const ModelState& state, int64_t size, const torch::TensorOptions& long_opts)
      : slots(state.slice(0, size)),
        plan(model.compile_decode_plan(*slots)),
        tokens(torch::zeros({size, 1}, long_opts)),
        positions(torch::zeros({size}, long_opts)) {}
  std::unique_ptr<ModelState> slots;  // views of slots 0..size-1
  DecodePlan plan;
  Tensor tokens;     // [size, 1] int64
  Tensor positions;  // [size] int64
#ifdef LT2_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;  // null where not captured
#endif
  Tensor logits;     // [size, V]: the captured step's output
};

struct Engine::Steps {
  std::vector<Bucket> buckets;  // parallel to Engine::buckets_
};

Engine::Engine(LoopedLM model, EngineOptions opts) : model_(std::move(model)), opts_(opts) {
  DecodeOptionsGuard decode_options(opts_.decode);
  LT2_CHECK(opts_.max_batch > 0 && opts_.max_len > 0 && opts_.prefill_chunk > 0 && opts_.staging_rows >= 0,
            "engine: max_batch, max_len and prefill_chunk must be > 0 and staging_rows >= 0, found ",
            opts_.max_batch, ", ", opts_.max_len, ", ", opts_.prefill_chunk, ", ", opts_.staging_rows);
  const auto missing = model_->first_mixer_without_seq_pos();
  LT2_CHECK(missing.empty(), "engine: mixer '", missing,
            "' cannot decode sequences of different lengths together (no per-sequence positions); "
            "use `lt2 generate` for it");
  LT2_CHECK(!model_->is_training(), "engine: put the model in eval mode first");
  model_->pack_for_inference();
  const auto param = model_->parameters().front();
  // Plan before allocating: a batch that cannot fit gets an error that says what would.
  const int64_t available = device_free_bytes(param.device());
  const auto plan = plan_memory(*model_, rows(), opts_.max_len, param.scalar_type(), opts_.prefill_chunk, opts_.max_len);
  LT2_CHECK(fits_in(plan.state_bytes + plan.workspace_bytes, available), "engine: ", rows(), " rows of ",
            opts_.max_len, " tokens need ", human_bytes(plan.state_bytes), " of state and ",
            human_bytes(plan.workspace_bytes), " of workspace; ", human_bytes(available), " are free on ",
            param.device(), ", where ",
            max_rows_that_fit(*model_, opts_.max_len, param.scalar_type(), opts_.prefill_chunk, available),
            " rows fit: lower the batch or the context");
  state_opts_ = torch::TensorOptions().dtype(param.scalar_type()).device(param.device());
  state_ = model_->make_state(rows(), opts_.max_len, state_opts_);
  for (const auto& m : state_->mixers)
    LT2_CHECK(m->token_axes().size() == m->tensors().size(), "engine: a mixer state gives ",
              m->token_axes().size(), " token axes for ", m->tensors().size(), " tensors");
  lengths_.assign(rows(), 0);
  device_lengths_ = torch::zeros({rows()}, state_opts_.dtype(torch::kLong));
  for (int64_t b = 1; opts_.every_bucket && b < opts_.max_batch; b *= 2) buckets_.push_back(b);
  buckets_.push_back(opts_.max_batch);
  steps_ = std::make_unique<Steps>();
  for (int64_t b : buckets_) steps_->buckets.emplace_back(*model_, *state_, b, state_opts_.dtype(torch::kLong));

#ifdef LT2_WITH_CUDA
  if (!opts_.cuda_graphs || !param.is_cuda()) return;
  torch::NoGradGuard no_grad;
  c10::cuda::CUDAGuard device_guard(param.device());
  // Capture runs on a side stream; all buckets share one memory pool (they replay one at a time).
  auto stream = c10::cuda::getStreamFromPool();
  const auto pool = at::cuda::graph_pool_handle();
  for (auto& g : steps_->buckets) {
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    // Warm-up outside the capture: lazy library initialisation (cuBLAS handles, workspaces).
    for (int i = 0; i < 2; ++i) decode_eager(g);
    stream.synchronize();
    g.graph = std::make_unique<at::cuda::CUDAGraph>();
    g.graph->capture_begin(pool);
    g.logits = decode_eager(g);
    g.graph->capture_end();
  }
  torch::cuda::synchronize();
  state_->reset();  // the warm-up steps wrote into the states
#endif
}

Engine::~Engine() = default;

bool Engine::graphs_captured() const {
#ifdef LT2_WITH_CUDA
  return steps_->buckets.front().graph != nullptr;
#else
  return false;
#endif
}

const DecodePlan& Engine::decode_plan(int64_t n) const {
  LT2_CHECK(n >= 1 && n <= opts_.max_batch, "engine: no bucket decodes ", n, " sequences (max_batch ",
            opts_.max_batch, ")");
  return steps_->buckets[bucket_for(n)].plan;
}

int64_t Engine::bucket_for(int64_t n) const {
  return static_cast<int64_t>(std::lower_bound(buckets_.begin(), buckets_.end(), n) - buckets_.begin());
}

void Engine::check_row(int64_t row) const {
  LT2_CHECK(row >= 0 && row < rows(), "engine: slot ", row, " outside [0, ", rows(), ") (", opts_.max_batch,
            " decode slots + ", opts_.staging_rows, " staging rows)");
}

int64_t Engine::length(int64_t slot) const {
  check_row(slot);
  return lengths_[slot];
}

void Engine::set_length(int64_t row, int64_t length) {
  lengths_[row] = length;
  device_lengths_.narrow(0, row, 1).fill_(length);
}

std::vector<Tensor> Engine::row_parts(int64_t row, int64_t length) const {
  std::vector<Tensor> out;
  for (const auto& m : state_->mixers) {
    const auto ts = m->tensors();
    const auto axes = m->token_axes();
    for (size_t i = 0; i < ts.size(); ++i) {
      auto t = ts[i].narrow(0, row, 1);
      if (axes[i] >= 0) t = t.narrow(axes[i], 0, std::min(length, t.size(axes[i])));
      out.push_back(t);
    }
  }
  return out;
}

void Engine::reset(int64_t row) {
  check_row(row);
  torch::NoGradGuard no_grad;
  state_->slice(row, 1)->reset();
  set_length(row, 0);
}

void Engine::copy_row(int64_t src, int64_t dst) {
  check_row(src);
  check_row(dst);
  if (src == dst) return;
  torch::NoGradGuard no_grad;
  at::_foreach_copy_(row_parts(dst, lengths_[src]), row_parts(src, lengths_[src]));
  set_length(dst, lengths_[src]);
}

int64_t Engine::Snapshot::bytes() const {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.nbytes();
  return n;
}

Engine::Snapshot Engine::Snapshot::to(torch::Device device) const {
  Snapshot s;
  s.length = length;
  for (const auto& t : tensors) s.tensors.push_back(t.to(device, /*non_blocking=*/false, /*copy=*/true));
  return s;
}

Engine::Snapshot Engine::snapshot(int64_t row, std::optional<torch::Device> device) const {
  check_row(row);
  torch::NoGradGuard no_grad;
  Snapshot s;
  s.length = lengths_[row];
  const auto parts = row_parts(row, s.length);
  for (const auto& t : parts) s.tensors.push_back(torch::empty(t.sizes(), t.options().device(device.value_or(t.device()))));
  at::_foreach_copy_(s.tensors, parts);  // one multi-tensor launch where all sit on one device
  return s;
}

void Engine::restore(int64_t row, const Snapshot& snap) {
  check_row(row);
  LT2_CHECK(snap.length >= 0 && snap.length <= opts_.max_len, "engine: a snapshot of ", snap.length,
            " tokens does not fit rows of ", opts_.max_len);
  torch::NoGradGuard no_grad;
  const auto to = row_parts(row, snap.length);
  LT2_CHECK(to.size() == snap.tensors.size(), "engine: the snapshot holds ", snap.tensors.size(),
            " tensors, this engine's rows ", to.size(), " (a snapshot of another model?)");
  for (size_t i = 0; i < to.size(); ++i)
    LT2_CHECK(to[i].sizes() == snap.tensors[i].sizes(), "engine: snapshot tensor ", i, " has shape ",
              snap.tensors[i].sizes(), ", the row's ", to[i].sizes());
  at::_foreach_copy_(to, snap.tensors);
  set_length(row, snap.length);
}

Tensor Engine::decode_eager(const Bucket& bucket) {
  ForwardOptions fo = opts_.forward;
  fo.seq_pos = bucket.positions;
  fo.decode_plan = &bucket.plan;
  return model_->forward(bucket.tokens, bucket.slots.get(), fo).logits.select(1, 0);  // [b, V]
}

Tensor Engine::prefill(int64_t slot, const Tensor& prompt) {
  check_row(slot);
  LT2_CHECK(prompt.dim() == 1 && prompt.numel() >= 1 && prompt.numel() <= opts_.max_len,
            "engine: a prompt is [T] tokens with 1 <= T <= max_len (", opts_.max_len, "), found shape ",
            prompt.sizes());
  reset(slot);
  return extend(slot, prompt);
}

Tensor Engine::extend(int64_t row, const Tensor& tokens_in) {
  DecodeOptionsGuard decode_options(opts_.decode);
  check_row(row);
  const int64_t start = lengths_[row];
  LT2_CHECK(tokens_in.dim() == 1 && tokens_in.numel() >= 1 && start + tokens_in.numel() <= opts_.max_len,
            "engine: extend takes [T] tokens with T >= 1 and at most max_len (", opts_.max_len,
            ") in the row; row ", row, " holds ", start, ", found shape ", tokens_in.sizes());
  torch::NoGradGuard no_grad;
  Tf32Scope tf32(opts_.tf32 && state_opts_.device().is_cuda() && state_opts_.dtype() != torch::kFloat32);
  // A view of the row that continues at its length (slices start empty; every mixer state of the
  // view is told the length, as a forward through it would have left it).
  auto view = state_->slice(row, 1);
  view->length = start;
  for (auto& m : view->mixers) m->length = start;
  const int64_t T = tokens_in.numel();
  auto tokens = tokens_in.to(state_opts_.device(), torch::kLong).view({1, T});
  ForwardOptions fo = opts_.forward;
  fo.last_logits_only = true;
  Tensor logits;
  for (int64_t begin = 0; begin < T; begin += opts_.prefill_chunk) {
    const int64_t n = std::min(opts_.prefill_chunk, T - begin);
    logits = model_->forward(tokens.narrow(1, begin, n), view.get(), fo).logits;  // [1, 1, V]
  }
  set_length(row, start + T);
  return logits.view({-1});
}

Tensor Engine::decode(const Tensor& tokens) {
  DecodeOptionsGuard decode_options(opts_.decode);
  LT2_CHECK(tokens.dim() == 1 && tokens.numel() >= 1 && tokens.numel() <= opts_.max_batch,
            "engine: decode takes [n] tokens with 1 <= n <= max_batch (", opts_.max_batch, "), found shape ",
            tokens.sizes());
  const int64_t n = tokens.numel();
  for (int64_t s = 0; s < n; ++s)
    LT2_CHECK(lengths_[s] < opts_.max_len, "engine: slot ", s, " is full (", opts_.max_len, " tokens)");
  torch::NoGradGuard no_grad;
  auto& bucket = steps_->buckets[bucket_for(n)];
  const int64_t b = buckets_[bucket_for(n)];
  // Positions of the new tokens: each slot's length; padding slots n..b-1 decode at position 0.
  bucket.tokens.narrow(0, 0, n).copy_(tokens.to(state_opts_.device(), torch::kLong).view({n, 1}));
  bucket.positions.narrow(0, 0, n).copy_(device_lengths_.narrow(0, 0, n));
  bucket.positions.narrow(0, n, b - n).zero_();
  Tensor logits;
#ifdef LT2_WITH_CUDA
  if (bucket.graph) {
    bucket.graph->replay();
    logits = bucket.logits;
  }
#endif
  if (!logits.defined()) logits = decode_eager(bucket);
  logits = logits.narrow(0, 0, n);
  device_lengths_.narrow(0, 0, n).add_(1);
  for (int64_t s = 0; s < n; ++s) ++lengths_[s];
  return logits;
}

void Engine::fill_random(int64_t length, uint64_t seed) {
  LT2_CHECK(length >= 0 && length < opts_.max_len, "engine: fill_random length ", length, " must be in [0, ",
            opts_.max_len, ")");
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  // Drawn on the state's device (tens of GB at long contexts); small values keep the model finite.
  for (auto& m : state_->mixers)
    for (auto& t : m->tensors()) t.normal_(0.0, 0.1);
  std::fill(lengths_.begin(), lengths_.end(), length);
  device_lengths_.fill_(length);
}

}  // namespace lt2
