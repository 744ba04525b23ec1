// SplitMix64: a cheap, well-mixed 64-bit hash, so nearby inputs (seeds, steps, indices) give
// independent outputs. Shared by the batch sampler and the task generators.
#pragma once
#include <cstdint>

namespace lt2 {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace lt2
