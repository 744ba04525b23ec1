#include "lt2/serve/scheduler.h"

#include <algorithm>
#include <cstdio>

#include "lt2/serve/api.h"
#include "lt2/serve/text_stream.h"
#include "lt2/util/error.h"

namespace lt2::serve {

using Clock = std::chrono::steady_clock;

namespace {
double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

void Channel::push(Event e) {
  {
    std::lock_guard<std::mutex> g(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_one();
}

bool Channel::pop(Event& e, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return !events_.empty(); })) return false;
  e = std::move(events_.front());
  events_.pop_front();
  return true;
}

struct Scheduler::Seq {
  explicit Seq(GenerationRequest r)
      : req(std::move(r)), ch(std::make_shared<Channel>()), sampler(req.sampling, req.seed), text(req.stop) {}
  GenerationRequest req;
  std::shared_ptr<Channel> ch;
  Sampler sampler;
  TextStream text;
  int64_t row = -1;     // staging row while prefilling, decode slot while running
  int64_t filled = 0;   // prompt tokens in the row
  int64_t cached = 0;   // of which restored from the prefix cache
  int64_t branch = 0;   // where the prompt parts from a cached sequence: a snapshot is taken there
  std::vector<int64_t> generated;
  int64_t next_token = -1;  // fed at the next decode step
  Clock::time_point admitted, first_token, last_token;
};

Scheduler::Scheduler(LoopedLM model, const Tokenizer& tokenizer, SchedulerOptions opts, Metrics& metrics)
    : tok_(tokenizer),
      opts_(opts),
      metrics_(metrics),
      cache_(opts.cache_device_bytes, opts.cache_host_bytes, model->parameters().front().device()) {
  if (opts_.step_token_budget <= 0) opts_.step_token_budget = opts_.max_batch + opts_.prefill_chunk;
  LT2_CHECK(opts_.max_batch >= 1 && opts_.max_context >= 2 && opts_.prefill_chunk >= 1 && opts_.prefill_rows >= 1,
            "serve: --max-batch, --prefill-chunk and --prefill-rows must be >= 1 and --max-context >= 2");
  LT2_CHECK(opts_.step_token_budget > opts_.max_batch, "serve: --step-token-budget (", opts_.step_token_budget,
            ") must exceed --max-batch (", opts_.max_batch, "), so prompts prefill while every slot decodes");
  LT2_CHECK(opts_.cache_interval >= 0, "serve: --prefix-cache-interval must be >= 0");
  if (opts_.cache_interval == 0) opts_.cache_interval = opts_.prefill_chunk;
  vocab_ = model->config().vocab_size;
  EngineOptions eo;
  eo.max_batch = opts_.max_batch;
  eo.max_len = opts_.max_context;
  eo.prefill_chunk = opts_.prefill_chunk;
  eo.staging_rows = opts_.prefill_rows;
  eo.cuda_graphs = opts_.cuda_graphs;
  eo.decode = opts_.decode;
  eo.forward = opts_.forward;
  model->eval();
  engine_ = std::make_unique<Engine>(model, eo);
  for (int64_t r = engine_->rows() - 1; r >= opts_.max_batch; --r) free_rows_.push_back(r);
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { stop(); }

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Channel> Scheduler::submit(GenerationRequest req) {
  auto s = std::make_unique<Seq>(std::move(req));
  auto ch = s->ch;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (draining_ || stop_) throw ApiError(503, "the server is shutting down", "server_error", "", "shutting_down");
    if (static_cast<int64_t>(queue_.size()) >= opts_.max_queue)
      throw ApiError(503, cat("the server's queue is full (", opts_.max_queue, " requests); retry later"), "server_error",
                     "", "queue_full");
    queue_.push_back(std::move(s));
  }
  cv_.notify_all();
  return ch;
}

void Scheduler::drain(double timeout_s) {
  std::deque<std::unique_ptr<Seq>> queued;
  {
    std::lock_guard<std::mutex> g(mu_);
    draining_ = true;
    queued.swap(queue_);
  }
  for (auto& s : queued) fail(*s, 503, "server_error", "the server is shutting down");
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (Clock::now() < deadline && (n_running_ > 0 || n_prefilling_ > 0))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

Scheduler::Load Scheduler::load() const {
  Load l;
  l.running = n_running_;
  l.prefilling = n_prefilling_;
  l.steps = steps_;
  std::lock_guard<std::mutex> g(mu_);
  l.queued = queue_.size();
  l.cache = cache_stats_;
  return l;
}

void Scheduler::loop() {
  torch::NoGradGuard no_grad;
  while (true) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !running_.empty() || !prefilling_.empty(); });
      if (stop_) break;
    }
    try {
      step();
    } catch (const std::exception& e) {
      // The engine failed (out of memory, a bug): every sequence in it gets the error; the rows are
      // reset by the next prefill, so the server keeps serving.
      std::fprintf(stderr, "serve: step failed: %s\n", e.what());
      for (auto& s : running_) fail(*s, 500, "server_error", cat("generation failed: ", e.what()));
      for (auto& s : prefilling_) {
        fail(*s, 500, "server_error", cat("generation failed: ", e.what()));
        free_rows_.push_back(s->row);
      }
      running_.clear();
      prefilling_.clear();
    }
    n_running_ = running_.size();
    n_prefilling_ = prefilling_.size();
    for (auto& [ch, ev] : outbox_) ch->push(std::move(ev));
    outbox_.clear();
  }
  std::deque<std::unique_ptr<Seq>> queued;
  {
    std::lock_guard<std::mutex> g(mu_);
    queued.swap(queue_);
  }
  for (auto& s : queued) fail(*s, 503, "server_error", "the server is shutting down");
  for (auto& s : prefilling_) fail(*s, 503, "server_error", "the server is shutting down");
  for (auto& s : running_) fail(*s, 503, "server_error", "the server is shutting down");
  prefilling_.clear();
  running_.clear();
  n_running_ = 0;
  n_prefilling_ = 0;
}

bool Scheduler::expired(const Seq& s) const {
  return opts_.timeout_s > 0 && seconds_between(s.req.arrival, Clock::now()) > opts_.timeout_s;
}

void Scheduler::step() {
  // 1. Clients gone, time out.
  for (size_t i = running_.size(); i-- > 0;) {
    Seq& s = *running_[i];
    if (s.ch->cancelled()) {
      log_line(s, "cancelled (client gone)");
      metrics_.finish_reason("cancelled");
      remove_running(i);
    } else if (expired(s)) {
      fail(s, 408, "timeout", cat("the request took longer than the server's timeout (", opts_.timeout_s, " s)"));
      remove_running(i);
    }
  }
  for (size_t i = prefilling_.size(); i-- > 0;) {
    Seq& s = *prefilling_[i];
    const bool gone = s.ch->cancelled();
    if (!gone && !expired(s)) continue;
    if (gone) {
      log_line(s, "cancelled (client gone)");
      metrics_.finish_reason("cancelled");
    } else {
      fail(s, 408, "timeout", cat("the request took longer than the server's timeout (", opts_.timeout_s, " s)"));
    }
    free_rows_.push_back(s.row);
    prefilling_.erase(prefilling_.begin() + i);
  }
  // 2-4.
  admit();
  prefill_work(opts_.step_token_budget - static_cast<int64_t>(running_.size()));
  decode_step();
  ++steps_;
  if (cache_.enabled()) {
    std::lock_guard<std::mutex> g(mu_);
    cache_stats_ = cache_.stats();
  }
}

void Scheduler::admit() {
  std::vector<std::unique_ptr<Seq>> admitted;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {  // the queue's dead requests
      Seq& s = **it;
      if (s.ch->cancelled()) {
        log_line(s, "cancelled in the queue (client gone)");
        metrics_.finish_reason("cancelled");
        it = queue_.erase(it);
      } else if (expired(s)) {
        fail(s, 408, "timeout", cat("the request waited longer than the server's timeout (", opts_.timeout_s, " s)"));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    while (!queue_.empty() && admitted.size() < free_rows_.size() &&
           static_cast<int64_t>(running_.size() + prefilling_.size() + admitted.size()) < opts_.max_batch) {
      admitted.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
  }
  for (auto& sp : admitted) {
    Seq& s = *sp;
    s.admitted = Clock::now();
    s.row = free_rows_.back();
    free_rows_.pop_back();
    const int64_t T = s.req.prompt.size();
    auto hit = cache_.lookup(s.req.prompt, T);
    if (hit) {
      engine_->restore(s.row, *hit->snapshot);
      s.filled = s.cached = hit->length;
    } else {
      engine_->reset(s.row);
    }
    if (const int64_t shared = cache_.shared_length(s.req.prompt); shared > s.filled && shared < T) s.branch = shared;
    if (hit && hit->length == T) {  // the whole prompt, with its last logits: no prefill at all
      start_decoding(std::move(sp), hit->logits);
      continue;
    }
    prefilling_.push_back(std::move(sp));
  }
}

void Scheduler::prefill_work(int64_t budget) {
  for (size_t i = 0; i < prefilling_.size() && budget > 0;) {
    Seq& s = *prefilling_[i];
    const auto& prompt = s.req.prompt;
    const int64_t T = prompt.size();
    Tensor logits;
    while (budget > 0 && s.filled < T) {
      // Cut at multiples of the prefill chunk (and of the snapshot interval, and at the branch
      // point), so a prompt is split the same way whatever the budget left for it, and snapshots
      // land on their positions.
      int64_t cut = round_up(s.filled + 1, opts_.prefill_chunk);
      if (cache_.enabled()) {
        cut = std::min(cut, round_up(s.filled + 1, opts_.cache_interval));
        if (s.branch > s.filled) cut = std::min(cut, s.branch);
      }
      const int64_t n = std::min({T - s.filled, budget, cut - s.filled});
      auto chunk = torch::from_blob(const_cast<int64_t*>(prompt.data()) + s.filled, {n}, torch::kLong);
      logits = engine_->extend(s.row, chunk);
      s.filled += n;
      budget -= n;
      if (cache_.enabled() && s.filled < T && (s.filled % opts_.cache_interval == 0 || s.filled == s.branch) &&
          !cache_.contains(prompt, s.filled))
        cache_.insert(prompt, engine_->snapshot(s.row));
    }
    if (s.filled < T) break;  // the budget ran out
    const bool keep_prompt = cache_.enabled() && !cache_.contains(prompt, T);
    auto sp = std::move(prefilling_[i]);
    prefilling_.erase(prefilling_.begin() + i);
    start_decoding(std::move(sp), logits, keep_prompt);
  }
}

void Scheduler::start_decoding(std::unique_ptr<Seq> sp, const Tensor& logits, bool keep_prompt) {
  Seq& s = *sp;
  const int64_t staging_row = s.row;
  const bool finished = take_token(s, logits, std::nullopt);
  // The whole prompt's snapshot, taken once its first token is out: the client's time to first
  // token does not wait on the copy.
  if (keep_prompt) cache_.insert(s.req.prompt, engine_->snapshot(staging_row), logits.clone());
  if (!finished) {  // unless its first token ends it
    const int64_t slot = running_.size();
    engine_->copy_row(staging_row, slot);
    s.row = slot;
    running_.push_back(std::move(sp));
  }
  free_rows_.push_back(staging_row);
}

void Scheduler::decode_step() {
  const int64_t n = running_.size();
  if (n == 0) return;
  std::vector<int64_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = running_[i]->next_token;
  auto logits = engine_->decode(torch::tensor(tokens, torch::kLong));  // [n, V]
  // One device-to-host copy for every greedy row.
  auto greedy = logits.argmax(-1).to(torch::kCPU);
  const auto* g = greedy.data_ptr<int64_t>();
  std::vector<size_t> done;
  for (int64_t i = 0; i < n; ++i)
    if (take_token(*running_[i], logits[i], g[i])) done.push_back(i);
  for (size_t k = done.size(); k-- > 0;) remove_running(done[k]);
}

bool Scheduler::take_token(Seq& s, const Tensor& logits, std::optional<int64_t> greedy_id) {
  const int64_t id = s.req.sampling.temperature == 0 && greedy_id ? *greedy_id : s.sampler.sample(logits);
  const auto now = Clock::now();
  if (s.generated.empty()) {
    s.first_token = now;
    metrics_.ttft(seconds_between(s.req.arrival, now));
  } else {
    metrics_.itl(seconds_between(s.last_token, now));
  }
  s.last_token = now;
  s.generated.push_back(id);
  const int64_t T = s.req.prompt.size(), G = s.generated.size();

  Event ev;
  const bool eos = std::find(s.req.stop_tokens.begin(), s.req.stop_tokens.end(), id) != s.req.stop_tokens.end();
  if (eos) {  // the end token itself is not part of the text
    ev.text = s.text.flush();
    if (!ev.text.empty()) s.ch->push(std::move(ev));
    finish(s, "stop");
    return true;
  }
  TokenInfo info;
  info.id = id;
  const std::vector<int32_t> one{static_cast<int32_t>(id)};
  info.bytes = tok_.decode_bytes(one, /*skip_special=*/true);
  if (s.req.logprobs >= 0) {
    info.text = tok_.decode(one);
    auto lp = torch::log_softmax(logits.to(torch::kFloat), -1);
    info.logprob = lp[id].item<double>();
    if (s.req.logprobs > 0) {
      auto [v, idx] = lp.topk(std::min<int64_t>(s.req.logprobs, lp.size(0)));
      v = v.to(torch::kCPU, torch::kDouble);
      idx = idx.to(torch::kCPU);
      for (int64_t k = 0; k < v.size(0); ++k) info.top.emplace_back(idx[k].item<int64_t>(), v[k].item<double>());
    }
  }
  auto u = s.text.push(info.bytes);
  const bool length_done = G >= s.req.max_tokens || T + G >= opts_.max_context;
  ev.text = u.text;
  if (!u.stopped && length_done) ev.text += s.text.flush();
  if (s.req.logprobs >= 0 || s.req.token_ids) ev.tokens.push_back(std::move(info));
  if (!ev.text.empty() || !ev.tokens.empty()) s.ch->push(std::move(ev));
  if (u.stopped || length_done) {
    finish(s, u.stopped ? "stop" : "length");
    return true;
  }
  s.next_token = id;
  return false;
}

void Scheduler::finish(Seq& s, const std::string& reason) {
  const int64_t T = s.req.prompt.size(), G = s.generated.size();
  // The row holds the prompt and every generated token but the last: the prefix of a next turn.
  if (cache_.enabled() && G >= 2) {
    std::vector<int64_t> seq = s.req.prompt;
    seq.insert(seq.end(), s.generated.begin(), s.generated.end() - 1);
    if (engine_->length(s.row) == static_cast<int64_t>(seq.size()) && !cache_.contains(seq, seq.size()))
      cache_.insert(seq, engine_->snapshot(s.row));
  }
  Event ev;
  ev.kind = Event::Done;
  ev.finish_reason = reason;
  ev.prompt_tokens = T;
  ev.completion_tokens = G;
  ev.cached_tokens = s.cached;
  metrics_.tokens(T, s.cached, G);
  metrics_.finish_reason(reason);
  metrics_.e2e(seconds_between(s.req.arrival, Clock::now()));
  log_line(s, "finished: " + reason);
  outbox_.emplace_back(s.ch, std::move(ev));
}

void Scheduler::fail(Seq& s, int status, const std::string& type, const std::string& message) {
  Event ev;
  ev.kind = Event::Error;
  ev.status = status;
  ev.error_type = type;
  ev.message = message;
  s.ch->push(std::move(ev));
  metrics_.finish_reason(type == "timeout" ? "timeout" : "error");
  log_line(s, cat("error ", status, ": ", message));
}

void Scheduler::remove_running(size_t i) {
  const size_t last = running_.size() - 1;
  if (i != last) {
    engine_->copy_row(last, i);
    running_[i] = std::move(running_[last]);
    running_[i]->row = i;
  }
  running_.pop_back();
}

void Scheduler::log_line(const Seq& s, const std::string& outcome) const {
  const auto now = Clock::now();
  const double ttft = s.generated.empty() ? -1 : 1000 * seconds_between(s.req.arrival, s.first_token);
  std::fprintf(stderr, "serve: %s %s; prompt %zu tokens (%lld cached), %zu generated, ttft %.1f ms, total %.1f ms\n",
               s.req.id.c_str(), outcome.c_str(), s.req.prompt.size(), static_cast<long long>(s.cached),
               s.generated.size(), ttft, 1000 * seconds_between(s.req.arrival, now));
}

}  // namespace lt2::serve
