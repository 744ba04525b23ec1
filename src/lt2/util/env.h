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

// A numeric knob: the variable's value, or `fallback` when it is not set.
inline long long env_int(const char* name, long long fallback) {
  const char* env = std::getenv(name);
  return env ? std::atoll(env) : fallback;
}

}  // namespace lt2
