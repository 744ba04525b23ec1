// Continuous batching for `lt2 serve` (docs/serve.md): one thread owns the Engine; HTTP handler
// threads submit requests and read their results from per-request channels.
//
// Each step of the scheduler thread:
//   1. drops requests whose client went away or whose time ran out (their slots free at once);
//   2. admits queued requests in arrival order while a decode slot would be free for each, into a
//      staging row (Engine::staging_rows), restoring the longest cached prefix of the prompt;
//   3. prefills the admitted prompts in chunks, oldest first, within the step's token budget
//      (budget minus one token per running sequence); a prompt that is done samples its first
//      token and moves into the next decode slot;
//   4. runs one decode step over every running sequence and samples their next tokens.
// Running sequences occupy decode slots 0..n-1 (the engine's contract); one that finishes is
// replaced by the last (Engine::copy_row). Sampling follows lt2::Sampler with the request's seed,
// so a request's tokens do not depend on what else runs beside it (up to the round-off of batched
// versus single-sequence kernels).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lt2/infer/engine.h"
#include "lt2/infer/sampling.h"
#include "lt2/serve/metrics.h"
#include "lt2/serve/prefix_cache.h"
#include "lt2/tokenizer/tokenizer.h"

namespace lt2::serve {

struct SchedulerOptions {
  int64_t max_batch = 8;          // sequences decoding together (engine slots)
  int64_t max_context = 4096;     // prompt + generated tokens per sequence
  int64_t prefill_chunk = 512;    // tokens per prefill forward
  int64_t step_token_budget = 0;  // tokens per step, decode and prefill together; 0 = max_batch + prefill_chunk
  int64_t prefill_rows = 2;       // prompts prefilling at once (the engine's staging rows)
  int64_t max_queue = 1024;       // queued requests beyond which new ones get 503
  double timeout_s = 600;         // per request, from arrival; 0 = none
  int64_t cache_device_bytes = 0; // prefix cache on the model's device; 0 = off
  int64_t cache_host_bytes = 0;   // and its spill to host memory
  int64_t cache_interval = 0;     // snapshot every this many prompt tokens; 0 = prefill_chunk (also at
                                  // branch points and prompt ends)
  bool cuda_graphs = true;
  DecodeOptions decode;
  ForwardOptions forward;         // loops, Ouro exits
};

// One generated token as the client sees it.
struct TokenInfo {
  int64_t id = 0;
  std::string text;   // decoded alone (U+FFFD for a partial character)
  std::string bytes;  // its raw bytes
  double logprob = 0;
  std::vector<std::pair<int64_t, double>> top;  // the top-n alternatives
};

// What a request's channel carries from the scheduler to its HTTP handler.
struct Event {
  enum Kind { Delta, Done, Error } kind = Delta;
  std::string text;               // Delta: new text
  std::vector<TokenInfo> tokens;  // Delta: the tokens behind it (with logprobs when asked)
  std::string finish_reason;      // Done: "stop" | "length"
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;  // Done
  int status = 0;                 // Error: HTTP status
  std::string error_type, message;
};

class Channel {
 public:
  void push(Event e);
  // Waits up to `timeout` for an event; false on timeout.
  bool pop(Event& e, std::chrono::milliseconds timeout);
  // The client is gone: the scheduler frees the request's slot at its next step.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::atomic<bool> cancelled_{false};
};

// A request ready to run: tokenized and checked against the server's limits.
struct GenerationRequest {
  std::string id;  // for the log line
  std::vector<int64_t> prompt;
  int64_t max_tokens = 16;
  SamplingOptions sampling;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<int64_t> stop_tokens;  // end tokens (EOS); empty with ignore_eos
  int64_t logprobs = -1;             // top-n with each token; -1 = none
  bool token_ids = false;            // send each token's id with its text
  std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();
};

class Scheduler {
 public:
  // Starts the scheduler thread. The model must be in eval mode on its device and dtype.
  Scheduler(LoopedLM model, const Tokenizer& tokenizer, SchedulerOptions opts, Metrics& metrics);
  ~Scheduler();  // stop()
  // Stops the thread; requests still queued or running get an error event (503). Idempotent.
  void stop();

  // Queues a request. Throws ApiError 503 while draining or when the queue is full.
  std::shared_ptr<Channel> submit(GenerationRequest req);
  // Stops admitting: queued requests get 503, new ones are refused; returns once every running
  // request has finished (or `timeout_s` passed).
  void drain(double timeout_s);

  struct Load {
    int64_t running = 0, prefilling = 0, queued = 0, steps = 0;
    PrefixCache::Stats cache;
  };
  Load load() const;
  const SchedulerOptions& options() const { return opts_; }
  int64_t vocab_size() const { return vocab_; }

 private:
  struct Seq;
  void loop();
  void step();
  void admit();
  void prefill_work(int64_t budget);
  // A prefilled sequence (in a staging row, `logits` its prompt's last) takes its first token and,
  // unless that ends it, moves into the next decode slot; the staging row is freed either way.
  // keep_prompt: the prefix cache takes the whole prompt's state (after the first token is out).
  void start_decoding(std::unique_ptr<Seq> sp, const Tensor& logits, bool keep_prompt = false);
  void decode_step();
  // Samples the next token of `s` from `logits` ([V], its row of the step's logits; `greedy_id`
  // when already known), emits it; returns true when the sequence is finished.
  bool take_token(Seq& s, const Tensor& logits, std::optional<int64_t> greedy_id);
  void finish(Seq& s, const std::string& reason);
  void fail(Seq& s, int status, const std::string& type, const std::string& message);
  bool expired(const Seq& s) const;
  void remove_running(size_t i);
  void log_line(const Seq& s, const std::string& outcome) const;

  const Tokenizer& tok_;
  SchedulerOptions opts_;
  Metrics& metrics_;
  int64_t vocab_ = 0;
  std::unique_ptr<Engine> engine_;
  PrefixCache cache_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> queue_;  // guarded by mu_
  bool draining_ = false, stop_ = false;    // guarded by mu_
  // Scheduler thread only:
  std::vector<std::unique_ptr<Seq>> prefilling_;  // in admission order
  std::vector<std::unique_ptr<Seq>> running_;     // running_[i] decodes in slot i
  std::vector<int64_t> free_rows_;                // staging rows not in use
  std::atomic<int64_t> n_running_{0}, n_prefilling_{0}, steps_{0};
  // Done events of this step, sent after the counters are updated: a client that has its answer
  // sees it counted in /metrics.
  std::vector<std::pair<std::shared_ptr<Channel>, Event>> outbox_;
  PrefixCache::Stats cache_stats_;  // guarded by mu_ (a copy for /metrics)
  std::thread thread_;
};

}  // namespace lt2::serve
