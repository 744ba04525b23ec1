#include "lt2/util/environment.h"

#include <cstdlib>

#include "lt2/util/error.h"

namespace lt2 {

namespace {

template <typename T>
std::optional<T> number(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  try {
    size_t used = 0;
    const std::string s(v);
    T n;
    if constexpr (std::is_floating_point_v<T>) n = std::stod(s, &used);
    else n = std::stoll(s, &used);
    if (used == s.size()) return n;
  } catch (const std::exception&) {
  }
  throw Error(cat("environment variable ", name, ": expected a number, found '", v, "'"));
}

}  // namespace

const Environment& environment() {
  static const Environment env = [] {
    Environment e;
    if (const char* dir = std::getenv("LT2_CONFIG_DIR")) e.config_dir = dir;
    e.peak_tflops = number<double>("LT2_PEAK_TFLOPS");
    e.launcher_pid = number<int64_t>(kLauncherPidVariable);
    return e;
  }();
  return env;
}

}  // namespace lt2
