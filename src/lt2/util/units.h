// Quantities for people: byte counts in log lines and error messages.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>

namespace lt2 {

// "3.2 GiB" from 2^30 bytes up, else "12.0 MiB".
inline std::string human_bytes(int64_t bytes) {
  std::ostringstream s;
  s.precision(1);
  if (bytes >= (int64_t{1} << 30)) s << std::fixed << double(bytes) / double(int64_t{1} << 30) << " GiB";
  else s << std::fixed << double(bytes) / double(int64_t{1} << 20) << " MiB";
  return s.str();
}

}  // namespace lt2
