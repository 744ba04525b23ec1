#include "lt2/eval/progress.h"

#include <cstdio>

namespace lt2::eval {

Progress::Progress(std::string label, int64_t total, bool enabled)
    : label_(std::move(label)), total_(total), enabled_(enabled), start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { finish(); }

void Progress::add(int64_t n) {
  done_ += n;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ >= std::chrono::milliseconds(200)) {
    last_draw_ = now;
    draw(false);
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  draw(true);
}

void Progress::draw(bool final) {
  if (!enabled_) return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = s > 0 ? done_ / s : 0;
  const double left = rate > 0 ? (total_ - done_) / rate : 0;
  std::fprintf(stderr, "\r%s %lld/%lld  %.1f items/s  %s %.0f s   %s", label_.c_str(), (long long)done_,
               (long long)total_, rate, final ? "took" : "left", final ? s : left, final ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace lt2::eval
