// The contract every fuzz target checks: a reader given any bytes returns or throws lt2::Error.
// Anything else (another exception, a crash, a sanitizer report) escapes and is a finding.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"

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

// A folder of files given as one input, in the layout `head` prints for several files: each file is
// a line "==> NAME <==" and then its bytes, up to the next such line at the start of a line. The
// files are written into this process's scratch folder `name`, removed again when the object goes.
// `ok` is false (and nothing is written) for an input that does not start with a header or names a
// file that is not a plain name: such inputs are not folders and say nothing about the readers.
struct ScratchFolder {
  ScratchFolder(const std::string& name, std::string_view bytes)
      : path("/tmp/lt2_fuzz_" + std::to_string(::getpid()) + "_" + name) {
    static constexpr std::string_view open = "==> ", close = " <==\n";
    std::vector<std::pair<std::string, std::string_view>> files;
    size_t at = 0;
    while (at < bytes.size()) {
      if (bytes.substr(at, open.size()) != open) return;
      const size_t name_end = bytes.find(close, at);
      if (name_end == std::string_view::npos) return;
      const std::string file(bytes.substr(at + open.size(), name_end - at - open.size()));
      if (file.empty() || file == "." || file == ".." || file.find_first_of(std::string("/\n\0", 3)) != std::string::npos)
        return;
      const size_t begin = name_end + close.size();
      size_t end = bytes.find(std::string("\n") + std::string(open), begin);
      end = end == std::string_view::npos ? bytes.size() : end + 1;
      files.emplace_back(file, bytes.substr(begin, end - begin));
      at = end;
    }
    lt2::remove_tree(path);
    lt2::make_dirs(path);
    for (const auto& [file, contents] : files)
      std::ofstream(path + "/" + file, std::ios::binary | std::ios::trunc)
          .write(contents.data(), static_cast<std::streamsize>(contents.size()));
    ok = true;
  }
  ~ScratchFolder() { lt2::remove_tree(path); }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;
  const std::string path;
  bool ok = false;
};

}  // namespace lt2::fuzz

// libFuzzer's entry point, defined by each target.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
