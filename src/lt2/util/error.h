// Errors a user can cause (bad config, wrong checkpoint, corrupt file) are lt2::Error with a
// message that says what was expected and what was found. The CLI prints it and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace lt2 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

// LT2_CHECK(cond, parts...) throws lt2::Error(cat(parts...)) when cond is false.
#define LT2_CHECK(cond, ...)                          \
  do {                                                \
    if (!(cond)) throw ::lt2::Error(::lt2::cat(__VA_ARGS__)); \
  } while (0)

}  // namespace lt2
