// File helpers: whole-file reads and atomic writes (temporary name in the same folder, then rename).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>

namespace lt2 {

std::string read_file(const std::string& path);
// The name a file is written under before it is renamed onto `path`: `path.tmp.<pid>`, so two
// processes never write the same temporary file.
std::string temporary_path(const std::string& path);
// Removes the temporary files (temporary_path) that processes killed mid-write left in folder
// `dir` (not below it). Only for a folder that one process writes at a time: it would also take
// the files another writer is busy with.
void remove_stale_temporaries(const std::string& dir);
// Writes through `fill` into temporary_path(path), flushes, fsyncs and renames onto `path`, so a
// reader never sees a half-written file. Throws lt2::Error on any failure, with the system's
// reason (the temp file is removed).
void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& fill);
void write_file_atomic(const std::string& path, const std::string& contents);
// Creates the folder and its parents; no-op when it exists.
void make_dirs(const std::string& path);
bool path_exists(const std::string& path);
// Removes a file or a folder with everything in it; no-op when absent. Use this, not
// std::filesystem::remove_all: libtorch exports its own copy of that symbol, which crashes on
// some systems (seen on the GPU machine).
void remove_tree(const std::string& path);

// A read-only memory map of a whole file. Empty files map to size 0 and a null data pointer.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace lt2
