// `lt2 serve`'s HTTP side (docs/serve.md), on cpp-httplib: the OpenAI-compatible endpoints
//   POST /v1/completions, POST /v1/chat/completions (JSON or server-sent events),
//   GET /v1/models, GET /health, GET /metrics (Prometheus text),
// over the continuous-batching Scheduler. Every error is OpenAI's JSON error object.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "lt2/serve/metrics.h"
#include "lt2/serve/scheduler.h"
#include "lt2/tokenizer/tokenizer.h"

namespace httplib {
class Server;
}

namespace lt2::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (Server::port() says which)
  std::string model_name = "lt2";   // the `model` requests name and /v1/models lists
  int64_t max_body_bytes = 8 << 20; // larger bodies get 413
  int read_timeout_s = 10;          // a client silent this long while sending its request is dropped
  int write_timeout_s = 30;         // a client not reading this long is dropped (its slot freed)
  int http_threads = 0;             // connections served at once; 0 = max(64, 4 * max_batch)
  bool log_requests = true;         // one line per HTTP request on stderr (the scheduler logs generations)
  SchedulerOptions scheduler;
};

class Server {
 public:
  Server(LoopedLM model, Tokenizer tokenizer, ServerOptions opts);
  ~Server();  // stops everything (no drain)

  // Binds the listening socket; returns the port (the chosen one when opts.port is 0).
  // Throws lt2::Error when the address cannot be bound.
  int bind();
  // Serves until stop() or shutdown(); call bind() first.
  void listen();
  // bind() + listen() on a thread of its own (tests).
  int start();
  // Graceful stop: new requests get 503, queued ones 503, running ones finish (up to
  // drain_timeout_s), their responses are written, then the listener closes.
  void shutdown(double drain_timeout_s);
  int port() const { return port_; }
  Metrics& metrics() { return metrics_; }

 private:
  void routes();

  Tokenizer tok_;
  ServerOptions opts_;
  Metrics metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<httplib::Server> http_;
  std::vector<int64_t> end_tokens_;
  std::atomic<int64_t> in_flight_{0};  // generation responses not yet fully written
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> next_id_{1};
  int port_ = -1;
  std::thread thread_;
};

}  // namespace lt2::serve
