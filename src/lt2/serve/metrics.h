// Counters and latency histograms of `lt2 serve`, written as Prometheus text (GET /metrics).
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace lt2::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // Prometheus lines of `name` (_bucket with le labels, _sum, _count).
  std::string text(const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Everything /metrics reports. Thread-safe.
class Metrics {
 public:
  Metrics();
  void request_finished(const std::string& endpoint, int status);  // one per HTTP request answered
  void tokens(int64_t prompt, int64_t cached, int64_t completion);
  void ttft(double seconds);
  void itl(double seconds);
  void e2e(double seconds);
  void finish_reason(const std::string& reason);
  // Prometheus text; `gauges` are extra "name value" lines written as gauges (running, queued, ...).
  std::string text(const std::vector<std::pair<std::string, double>>& gauges) const;

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, uint64_t>> requests_;  // "endpoint\tstatus" -> count
  std::vector<std::pair<std::string, uint64_t>> finishes_;
  uint64_t prompt_tokens_ = 0, cached_tokens_ = 0, completion_tokens_ = 0;
  Histogram ttft_, itl_, e2e_;
};

}  // namespace lt2::serve
