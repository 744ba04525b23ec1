// The contract every fuzz target checks: a reader given any bytes returns or throws lt2::Error.
// Anything else (another exception, a crash, a sanitizer report) escapes and is a finding.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

#include "lt2/util/error.h"

namespace lt2::fuzz {

// Runs `body`; an lt2::Error is the expected outcome of a malformed input.
template <typename F>
int run(F&& body) {
  try {
    body();
  } catch (const lt2::Error&) {
  }
  return 0;
}

inline std::string_view bytes(const uint8_t* data, size_t size) { return {reinterpret_cast<const char*>(data), size}; }

// The readers of files take a path: `bytes` in this process's scratch file `name`, removed again
// when the object goes.
struct ScratchFile {
  ScratchFile(const std::string& name, std::string_view bytes)
      : path("/tmp/lt2_fuzz_" + std::to_string(::getpid()) + "_" + name) {
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  ~ScratchFile() { ::unlink(path.c_str()); }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  const std::string path;
};

}  // namespace lt2::fuzz

// libFuzzer's entry point, defined by each target.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
