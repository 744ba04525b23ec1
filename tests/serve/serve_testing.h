// Driving a real `lt2 serve` server on a loopback port from a test: a tiny fp64 model, the
// byte-level tokenizer with ChatML tokens, and a minimal blocking HTTP/1.1 client over raw sockets
// (so a test can also send malformed, partial or abandoned requests). Every call has a deadline.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "common/testing.h"
#include "lt2/serve/server.h"
#include "lt2/util/json.h"

namespace lt2::testing {

inline Tokenizer chat_tokenizer() { return Tokenizer::byte_level({"<|endoftext|>", "<|im_start|>", "<|im_end|>"}); }

inline ModelConfig serve_config(const std::string& pattern, ModelForm form = ModelForm::LT2) {
  auto cfg = tiny_config(pattern, form);
  cfg.vocab_size = 260;  // 256 bytes + 3 specials, one spare
  cfg.max_seq_len = 512;
  cfg.mixer_options["gdn"] = json{{"chunk_size", 4}};
  cfg.mixer_options["window"] = json{{"window", 5}};
  cfg.mixer_options["dsa"] = json{{"topk", 4}, {"index_heads", 2}, {"index_head_dim", 8}};
  return cfg;
}

inline serve::ServerOptions small_server_options() {
  serve::ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.model_name = "tiny";
  o.log_requests = false;
  o.read_timeout_s = 2;
  o.write_timeout_s = 5;
  o.http_threads = 48;
  auto& s = o.scheduler;
  s.max_batch = 4;
  s.max_context = 256;
  s.prefill_chunk = 8;
  s.step_token_budget = 12;
  s.prefill_rows = 2;
  s.timeout_s = 120;
  s.cache_device_bytes = 0;
  return o;
}

// A server on its own thread; destroyed with the test.
struct TestServer {
  TestServer(LoopedLM model, serve::ServerOptions o, Tokenizer tok = chat_tokenizer())
      : server(model, std::move(tok), o) {
    port = server.start();
  }
  serve::Server server;
  int port = -1;
};

struct HttpResult {
  int status = -1;  // -1: no status line came back (connection closed or timed out)
  std::string headers, body;
  bool timed_out = false;
  json json_body() const { return json::parse(body); }
};

inline int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline bool send_all(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += n;
  }
  return true;
}

// Reads until the peer closes or `timeout_s` passes; `stop_when` (optional) ends the read early.
inline std::string read_until_closed(int fd, double timeout_s, bool* timed_out = nullptr,
                                     const std::function<bool(const std::string&)>& stop_when = nullptr) {
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  char buf[16384];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      if (timed_out) *timed_out = true;
      break;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, n);
    if (stop_when && stop_when(out)) break;
  }
  return out;
}

inline std::string dechunk(const std::string& body) {
  std::string out;
  size_t i = 0;
  while (i < body.size()) {
    const size_t eol = body.find("\r\n", i);
    if (eol == std::string::npos) break;
    const size_t n = std::stoul(body.substr(i, eol - i), nullptr, 16);
    if (n == 0) break;
    out += body.substr(eol + 2, n);
    i = eol + 2 + n + 2;
  }
  return out;
}

inline HttpResult parse_response(const std::string& raw) {
  HttpResult r;
  const size_t end = raw.find("\r\n\r\n");
  if (raw.compare(0, 9, "HTTP/1.1 ") != 0 || end == std::string::npos) return r;
  r.status = std::stoi(raw.substr(9, 3));
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  if (r.headers.find("Transfer-Encoding: chunked") != std::string::npos) r.body = dechunk(r.body);
  return r;
}

// One request on a fresh connection (Connection: close); `raw` replaces the whole request text.
inline HttpResult http(int port, const std::string& method, const std::string& path, const std::string& body = "",
                       double timeout_s = 60, const std::string& raw = "") {
  HttpResult r;
  const int fd = connect_loopback(port);
  if (fd < 0) return r;
  const std::string req = !raw.empty() ? raw
                                       : method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" +
                                             "Content-Type: application/json\r\nContent-Length: " +
                                             std::to_string(body.size()) + "\r\n\r\n" + body;
  send_all(fd, req);
  bool to = false;
  const std::string resp = read_until_closed(fd, timeout_s, &to);
  ::close(fd);
  r = parse_response(resp);
  r.timed_out = to;
  return r;
}

inline HttpResult post(int port, const std::string& path, const json& body, double timeout_s = 60) {
  return http(port, "POST", path, body.dump(), timeout_s);
}

// The data events of a server-sent-event body (without the [DONE] marker); `done` says whether it came.
inline std::vector<json> sse_events(const std::string& body, bool* done = nullptr) {
  std::vector<json> out;
  if (done) *done = false;
  size_t i = 0;
  while (i < body.size()) {
    size_t end = body.find("\n\n", i);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(i, end - i);
    i = end + 2;
    if (ev.rfind("data: ", 0) != 0) continue;  // comments (keep-alives)
    const std::string data = ev.substr(6);
    if (data == "[DONE]") {
      if (done) *done = true;
      continue;
    }
    out.push_back(json::parse(data));
  }
  return out;
}

// The metric's value in /metrics text (the first line starting with `name`), -1 when absent.
inline double metric(int port, const std::string& name) {
  const auto r = http(port, "GET", "/metrics");
  size_t pos = 0;
  while ((pos = r.body.find(name, pos)) != std::string::npos) {
    if ((pos == 0 || r.body[pos - 1] == '\n') && r.body.size() > pos + name.size() && r.body[pos + name.size()] == ' ')
      return std::stod(r.body.substr(pos + name.size() + 1));
    pos += name.size();
  }
  return -1;
}

}  // namespace lt2::testing
