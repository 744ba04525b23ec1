#include "lt2/serve/metrics.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace lt2::serve {

void Histogram::observe(double v) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  ++counts_[i];
  sum_ += v;
  ++count_;
}

std::string Histogram::text(const std::string& name, const std::string& help) const {
  std::ostringstream os;
  os << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    os << name << "_bucket{le=\"" << bounds_[i] << "\"} " << cum << "\n";
  }
  os << name << "_bucket{le=\"+Inf\"} " << count_ << "\n";
  os << name << "_sum " << sum_ << "\n" << name << "_count " << count_ << "\n";
  return os.str();
}

namespace {
std::vector<double> latency_bounds(double lo, int n) {
  std::vector<double> b;
  for (int i = 0; i < n; ++i) {  // 1, 2.5, 5 per decade
    const double d = lo * std::pow(10.0, i / 3);
    b.push_back(d * (i % 3 == 0 ? 1 : i % 3 == 1 ? 2.5 : 5));
  }
  return b;
}

void bump(std::vector<std::pair<std::string, uint64_t>>& v, const std::string& key) {
  for (auto& [k, n] : v)
    if (k == key) {
      ++n;
      return;
    }
  v.emplace_back(key, 1);
}
}  // namespace

Metrics::Metrics() : ttft_(latency_bounds(0.001, 16)), itl_(latency_bounds(0.0001, 16)), e2e_(latency_bounds(0.01, 14)) {}

void Metrics::request_finished(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> g(mu_);
  bump(requests_, endpoint + "\t" + std::to_string(status));
}

void Metrics::tokens(int64_t prompt, int64_t cached, int64_t completion) {
  std::lock_guard<std::mutex> g(mu_);
  prompt_tokens_ += prompt;
  cached_tokens_ += cached;
  completion_tokens_ += completion;
}

void Metrics::ttft(double s) {
  std::lock_guard<std::mutex> g(mu_);
  ttft_.observe(s);
}
void Metrics::itl(double s) {
  std::lock_guard<std::mutex> g(mu_);
  itl_.observe(s);
}
void Metrics::e2e(double s) {
  std::lock_guard<std::mutex> g(mu_);
  e2e_.observe(s);
}
void Metrics::finish_reason(const std::string& reason) {
  std::lock_guard<std::mutex> g(mu_);
  bump(finishes_, reason);
}

std::string Metrics::text(const std::vector<std::pair<std::string, double>>& gauges) const {
  std::lock_guard<std::mutex> g(mu_);
  std::ostringstream os;
  os << "# HELP lt2_requests_total HTTP requests answered, by endpoint and status\n"
     << "# TYPE lt2_requests_total counter\n";
  for (const auto& [k, n] : requests_) {
    const auto tab = k.find('\t');
    os << "lt2_requests_total{endpoint=\"" << k.substr(0, tab) << "\",status=\"" << k.substr(tab + 1) << "\"} " << n << "\n";
  }
  os << "# HELP lt2_finished_total Generations finished, by finish reason\n# TYPE lt2_finished_total counter\n";
  for (const auto& [k, n] : finishes_) os << "lt2_finished_total{reason=\"" << k << "\"} " << n << "\n";
  os << "# HELP lt2_prompt_tokens_total Prompt tokens of finished generations\n# TYPE lt2_prompt_tokens_total counter\n"
     << "lt2_prompt_tokens_total " << prompt_tokens_ << "\n"
     << "# HELP lt2_prompt_tokens_cached_total Prompt tokens restored from the prefix cache instead of prefilled\n"
     << "# TYPE lt2_prompt_tokens_cached_total counter\nlt2_prompt_tokens_cached_total " << cached_tokens_ << "\n"
     << "# HELP lt2_generation_tokens_total Tokens generated\n# TYPE lt2_generation_tokens_total counter\n"
     << "lt2_generation_tokens_total " << completion_tokens_ << "\n";
  os << ttft_.text("lt2_time_to_first_token_seconds", "Time from arrival to the first generated token");
  os << itl_.text("lt2_inter_token_latency_seconds", "Time between consecutive generated tokens of a request");
  os << e2e_.text("lt2_request_latency_seconds", "Time from arrival to the last token");
  for (const auto& [name, v] : gauges) os << "# TYPE " << name << (name.size() > 6 && name.compare(name.size() - 6, 6, "_total") == 0 ? " counter\n" : " gauge\n") << name << " " << v << "\n";
  return os.str();
}

}  // namespace lt2::serve
