// Helpers for the io tests: a temporary folder removed at scope exit, raw file writes, and a check
// that an expression throws lt2::Error whose message names every expected part.
#pragma once
#include "lt2/util/fs.h"
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "lt2/util/error.h"

namespace lt2::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lt2_io_test_XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    if (!p) throw std::runtime_error("mkdtemp failed");
    path_ = p;
  }
  ~TempDir() {
    try {
      lt2::remove_tree(path_);
    } catch (...) {  // a destructor must not throw; a left-over temp folder is harmless
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  // Names of the entries of `sub` (a folder under this one, or this one), sorted.
  std::vector<std::string> list(const std::string& sub = "") const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(sub.empty() ? path_ : path_ + "/" + sub))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A safetensors file from a header text and raw data; `header_len` overrides the length field.
inline std::string raw_safetensors(const std::string& header, const std::string& data,
                                   int64_t header_len = -1) {
  uint64_t n = header_len >= 0 ? static_cast<uint64_t>(header_len) : header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header + data;
}

// Runs `f`, which must throw lt2::Error whose message contains every string of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const lt2::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "expected an lt2::Error";
}

}  // namespace lt2::testing
