// A progress line on stderr for long evaluations: done / total, items per second and the time
// left, redrawn in place at most five times a second.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace lt2::eval {

class Progress {
 public:
  // `enabled` false prints nothing (tests, --quiet).
  Progress(std::string label, int64_t total, bool enabled = true);
  ~Progress();
  void add(int64_t n);
  // Prints the final line (with a newline); called by the destructor if not before.
  void finish();

 private:
  void draw(bool final);
  std::string label_;
  int64_t total_, done_ = 0;
  bool enabled_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace lt2::eval
