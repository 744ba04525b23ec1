// Switches read from the environment.
#pragma once
#include <cstdlib>
#include <cstring>

namespace lt2 {

// An A/B switch: on unless the variable is "0".
inline bool env_switch_on(const char* name) {
  const char* env = std::getenv(name);
  return !(env && std::strcmp(env, "0") == 0);
}

}  // namespace lt2
