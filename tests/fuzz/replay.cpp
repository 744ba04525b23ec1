// Runs a fuzz target over files: every file named, and every file of every folder named. The
// regression test of a target (the seed corpus and every saved crash) and a way to reproduce one
// input without libFuzzer. Exit status 1 when an input makes the target throw anything but
// lt2::Error (a crash or a sanitizer report ends the process itself).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (!fs::exists(argv[i])) continue;  // a target with no saved crash has no regressions folder
    if (fs::is_directory(argv[i])) {
      for (const auto& e : fs::directory_iterator(argv[i]))
        if (e.is_regular_file()) files.push_back(e.path().string());
    } else {
      files.push_back(argv[i]);
    }
  }
  std::sort(files.begin(), files.end());
  int failed = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: escaped with %s\n", f.c_str(), e.what());
      ++failed;
    }
  }
  std::printf("%zu inputs, %d failed\n", files.size(), failed);
  return failed ? 1 : 0;
}
