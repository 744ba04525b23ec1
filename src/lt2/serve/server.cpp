#include "lt2/serve/server.h"

#include <httplib.h>

#include <csignal>
#include <cstdio>
#include <ctime>
#include <random>

#include "lt2/serve/api.h"
#include "lt2/util/error.h"

namespace lt2::serve {

namespace {

using Clock = std::chrono::steady_clock;

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(json_text(body), "application/json");
}

json bytes_json(const std::string& s) {
  json a = json::array();
  for (unsigned char c : s) a.push_back(static_cast<int>(c));
  return a;
}

// The logprobs of `tokens` in the shape of each endpoint (`offset`: where the first token's text
// begins in the completion, for text_offset).
json completion_logprobs(const std::vector<TokenInfo>& tokens, const Tokenizer& tok, size_t offset) {
  json j{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
         {"text_offset", json::array()}};
  for (const auto& t : tokens) {
    j["tokens"].push_back(t.text);
    j["token_logprobs"].push_back(t.logprob);
    json top = json::object();
    for (const auto& [id, lp] : t.top) top[tok.decode({static_cast<int32_t>(id)})] = lp;
    j["top_logprobs"].push_back(top);
    j["text_offset"].push_back(offset);
    offset += t.bytes.size();
  }
  return j;
}

json chat_logprobs(const std::vector<TokenInfo>& tokens, const Tokenizer& tok) {
  json content = json::array();
  for (const auto& t : tokens) {
    json top = json::array();
    for (const auto& [id, lp] : t.top) {
      const std::vector<int32_t> one{static_cast<int32_t>(id)};
      top.push_back({{"token", tok.decode(one)}, {"logprob", lp}, {"bytes", bytes_json(tok.decode_bytes(one))}});
    }
    content.push_back({{"token", t.text}, {"logprob", t.logprob}, {"bytes", bytes_json(t.bytes)}, {"top_logprobs", top}});
  }
  return json{{"content", content}};
}

json usage_json(const Event& done) {
  return json{{"prompt_tokens", done.prompt_tokens},
              {"completion_tokens", done.completion_tokens},
              {"total_tokens", done.prompt_tokens + done.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", done.cached_tokens}}}};
}

// What a response needs besides the events.
struct ResponseInfo {
  Endpoint endpoint;
  std::string id, model;
  int64_t created = 0;
  int64_t logprobs = -1;
  bool include_usage = false, token_ids = false;
  bool chat() const { return endpoint == Endpoint::Chat; }
};

json token_ids_json(const std::vector<TokenInfo>& tokens) {
  json a = json::array();
  for (const auto& t : tokens) a.push_back(t.id);
  return a;
}

json chunk_json(const ResponseInfo& r, const json& choice) {
  return json{{"id", r.id},
              {"object", r.chat() ? "chat.completion.chunk" : "text_completion"},
              {"created", r.created},
              {"model", r.model},
              {"choices", json::array({choice})}};
}

std::string sse(const json& j) { return "data: " + json_text(j) + "\n\n"; }

const std::vector<std::string> kEndTokens{"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>"};

}  // namespace

Server::Server(LoopedLM model, Tokenizer tokenizer, ServerOptions opts)
    : tok_(std::move(tokenizer)), opts_(std::move(opts)) {
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a dead server
  LT2_CHECK(tok_.vocab_size() <= model->config().vocab_size, "serve: the tokenizer has ", tok_.vocab_size(),
            " tokens but the model's vocab_size is ", model->config().vocab_size);
  for (const auto& name : kEndTokens)
    if (auto id = tok_.token_to_id(name)) end_tokens_.push_back(*id);
  scheduler_ = std::make_unique<Scheduler>(model, tok_, opts_.scheduler, metrics_);
  http_ = std::make_unique<httplib::Server>();
  const size_t threads = opts_.http_threads > 0 ? opts_.http_threads
                                                : std::max<int64_t>(64, 4 * opts_.scheduler.max_batch);
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(opts_.max_body_bytes);
  http_->set_read_timeout(opts_.read_timeout_s, 0);
  http_->set_write_timeout(opts_.write_timeout_s, 0);
  http_->set_keep_alive_timeout(5);
  http_->set_tcp_nodelay(true);
  routes();
}

Server::~Server() {
  scheduler_->stop();  // every waiting handler gets its answer, so the HTTP threads can end
  http_->stop();
  if (thread_.joinable()) thread_.join();
}

int Server::bind() {
  if (opts_.port == 0) {
    port_ = http_->bind_to_any_port(opts_.host);
    LT2_CHECK(port_ > 0, "serve: cannot bind a port on ", opts_.host);
  } else {
    LT2_CHECK(http_->bind_to_port(opts_.host, opts_.port), "serve: cannot bind ", opts_.host, ":", opts_.port,
              " (in use, or not an address of this machine)");
    port_ = opts_.port;
  }
  return port_;
}

void Server::listen() { http_->listen_after_bind(); }

int Server::start() {
  const int p = bind();
  thread_ = std::thread([this] { listen(); });
  return p;
}

void Server::shutdown(double drain_timeout_s) {
  draining_ = true;
  scheduler_->drain(drain_timeout_s);
  // The drained requests' last events are in their channels: let the handlers write them.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (in_flight_ > 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  scheduler_->stop();
  http_->stop();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Server::routes() {
  http_->set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg;
    switch (res.status) {
      case 404: msg = cat("no route for ", req.method, " ", req.path); break;
      case 413: msg = cat("the request body is larger than ", opts_.max_body_bytes, " bytes"); break;
      case 414: msg = "the request URI is too long"; break;
      case 400: msg = "malformed HTTP request"; break;
      default: msg = cat("HTTP error ", res.status); break;
    }
    res.set_content(json_text(error_body(msg, "invalid_request_error", "", res.status == 404 ? "not_found" : "")),
                    "application/json");
    if (opts_.log_requests) std::fprintf(stderr, "serve: %s %s -> %d (%s)\n", req.method.c_str(), req.path.c_str(), res.status, msg.c_str());
    metrics_.request_finished(res.status == 404 ? "other" : req.path, res.status);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http_->set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string msg = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
    }
    send_json(res, 500, error_body(msg, "server_error"));
    std::fprintf(stderr, "serve: %s %s -> 500 (%s)\n", req.method.c_str(), req.path.c_str(), msg.c_str());
  });

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_) send_json(res, 503, json{{"status", "draining"}});
    else send_json(res, 200, json{{"status", "ok"}});
  });
  http_->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200,
              json{{"object", "list"},
                   {"data", json::array({json{{"id", opts_.model_name},
                                              {"object", "model"},
                                              {"created", 0},
                                              {"owned_by", "lt2"},
                                              {"max_model_len", opts_.scheduler.max_context}}})}});
    metrics_.request_finished("/v1/models", 200);
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    const auto l = scheduler_->load();
    const std::vector<std::pair<std::string, double>> gauges{
        {"lt2_requests_running", double(l.running)},
        {"lt2_requests_prefilling", double(l.prefilling)},
        {"lt2_requests_queued", double(l.queued)},
        {"lt2_scheduler_steps_total", double(l.steps)},
        {"lt2_prefix_cache_hits_total", double(l.cache.hits)},
        {"lt2_prefix_cache_misses_total", double(l.cache.misses)},
        {"lt2_prefix_cache_hit_tokens_total", double(l.cache.hit_tokens)},
        {"lt2_prefix_cache_inserts_total", double(l.cache.inserts)},
        {"lt2_prefix_cache_evictions_total", double(l.cache.evictions)},
        {"lt2_prefix_cache_spills_total", double(l.cache.spills)},
        {"lt2_prefix_cache_entries", double(l.cache.entries)},
        {"lt2_prefix_cache_device_bytes", double(l.cache.device_bytes)},
        {"lt2_prefix_cache_host_bytes", double(l.cache.host_bytes)},
    };
    res.set_content(metrics_.text(gauges), "text/plain; version=0.0.4");
  });

  auto generate = [this](Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    const std::string path = endpoint == Endpoint::Chat ? "/v1/chat/completions" : "/v1/completions";
    ResponseInfo info;
    info.endpoint = endpoint;
    info.model = opts_.model_name;
    info.created = std::time(nullptr);
    info.id = cat(endpoint == Endpoint::Chat ? "chatcmpl-" : "cmpl-", info.created, "-", next_id_++);
    std::shared_ptr<Channel> ch;
    bool stream = false;
    try {
      if (draining_) throw ApiError(503, "the server is shutting down", "server_error", "", "shutting_down");
      const ApiRequest a = parse_request(endpoint, req.body);
      if (a.model.empty()) throw ApiError(400, "'model' is required", "invalid_request_error", "model");
      if (a.model != opts_.model_name)
        throw ApiError(404, cat("the model '", a.model, "' does not exist; this server serves '", opts_.model_name, "'"),
                       "invalid_request_error", "model", "model_not_found");
      GenerationRequest g;
      g.id = info.id;
      TokenizedRequest t = tokenize_request(a, tok_, scheduler_->vocab_size(), opts_.scheduler.max_context);
      g.prompt = std::move(t.prompt);
      g.max_tokens = t.max_tokens;
      g.sampling.temperature = a.temperature;
      g.sampling.top_p = a.top_p;
      g.sampling.top_k = a.top_k;
      g.seed = a.seed ? *a.seed : std::random_device{}();
      g.stop = a.stop;
      if (!a.ignore_eos) g.stop_tokens = end_tokens_;
      g.logprobs = a.logprobs;
      g.token_ids = a.return_token_ids;
      info.logprobs = a.logprobs;
      info.token_ids = a.return_token_ids;
      info.include_usage = a.include_usage;
      stream = a.stream;
      ch = scheduler_->submit(std::move(g));
    } catch (const ApiError& e) {
      send_json(res, e.status, e.body());
      metrics_.request_finished(path, e.status);
      if (opts_.log_requests) std::fprintf(stderr, "serve: %s %s -> %d (%s)\n", info.id.c_str(), path.c_str(), e.status, e.what());
      return;
    }

    if (!stream) {
      std::string text;
      std::vector<TokenInfo> tokens;
      Event ev;
      while (true) {
        if (!ch->pop(ev, std::chrono::milliseconds(1000))) continue;  // the scheduler answers every request
        if (ev.kind == Event::Delta) {
          text += ev.text;
          for (auto& t : ev.tokens) tokens.push_back(std::move(t));
          continue;
        }
        break;
      }
      if (ev.kind == Event::Error) {
        send_json(res, ev.status, error_body(ev.message, ev.error_type));
        metrics_.request_finished(path, ev.status);
        return;
      }
      json choice{{"index", 0}, {"finish_reason", ev.finish_reason}, {"logprobs", nullptr}};
      if (info.chat()) {
        choice["message"] = {{"role", "assistant"}, {"content", text}};
        if (info.logprobs >= 0) choice["logprobs"] = chat_logprobs(tokens, tok_);
      } else {
        choice["text"] = text;
        if (info.logprobs >= 0) choice["logprobs"] = completion_logprobs(tokens, tok_, 0);
      }
      if (info.token_ids) choice["token_ids"] = token_ids_json(tokens);
      send_json(res, 200,
                json{{"id", info.id},
                     {"object", info.chat() ? "chat.completion" : "text_completion"},
                     {"created", info.created},
                     {"model", info.model},
                     {"choices", json::array({choice})},
                     {"usage", usage_json(ev)}});
      metrics_.request_finished(path, 200);
      return;
    }

    // Server-sent events: one chunk per piece of text, then the finish, the usage, [DONE].
    struct StreamState {
      std::shared_ptr<Channel> ch;
      ResponseInfo info;
      bool started = false, ended = false;
      size_t offset = 0;  // bytes of completion text sent
    };
    auto st = std::make_shared<StreamState>();
    st->ch = ch;
    st->info = info;
    ++in_flight_;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, st](size_t, httplib::DataSink& sink) -> bool {
          auto send = [&](const std::string& s) {
            if (sink.write(s.data(), s.size())) return true;
            st->ch->cancel();  // the client is gone: free its slot
            return false;
          };
          const ResponseInfo& r = st->info;
          if (!st->started) {
            st->started = true;
            if (r.chat())
              return send(sse(chunk_json(r, {{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                                             {"logprobs", nullptr}, {"finish_reason", nullptr}})));
          }
          Event ev;
          // Silence for a second: an SSE comment, which also finds a client that went away.
          if (!st->ch->pop(ev, std::chrono::milliseconds(1000))) return send(": keep-alive\n\n");
          if (ev.kind == Event::Delta) {
            json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
            if (r.chat()) {
              choice["delta"] = {{"content", ev.text}};
              if (r.logprobs >= 0) choice["logprobs"] = chat_logprobs(ev.tokens, tok_);
            } else {
              choice["text"] = ev.text;
              if (r.logprobs >= 0) choice["logprobs"] = completion_logprobs(ev.tokens, tok_, st->offset);
            }
            if (r.token_ids) choice["token_ids"] = token_ids_json(ev.tokens);
            st->offset += ev.text.size();
            return send(sse(chunk_json(r, choice)));
          }
          if (ev.kind == Event::Error) {
            const bool ok = send(sse(error_body(ev.message, ev.error_type)));
            st->ended = true;
            sink.done();
            return ok;
          }
          json choice{{"index", 0}, {"logprobs", nullptr}, {"finish_reason", ev.finish_reason}};
          if (r.chat()) choice["delta"] = json::object();
          else choice["text"] = "";
          if (!send(sse(chunk_json(r, choice)))) return false;
          if (r.include_usage) {
            json u = chunk_json(r, choice);
            u["choices"] = json::array();
            u["usage"] = usage_json(ev);
            if (!send(sse(u))) return false;
          }
          if (!send("data: [DONE]\n\n")) return false;
          st->ended = true;
          sink.done();
          return true;
        },
        [this, st, path](bool success) {
          if (!success || !st->ended) st->ch->cancel();
          metrics_.request_finished(path, 200);
          --in_flight_;
        });
  };
  http_->Post("/v1/completions", [generate](const httplib::Request& req, httplib::Response& res) {
    generate(Endpoint::Completions, req, res);
  });
  http_->Post("/v1/chat/completions", [generate](const httplib::Request& req, httplib::Response& res) {
    generate(Endpoint::Chat, req, res);
  });
}

}  // namespace lt2::serve
