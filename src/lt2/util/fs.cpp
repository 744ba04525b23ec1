#include "lt2/util/fs.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lt2/util/error.h"

namespace lt2 {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LT2_CHECK(in, "cannot open '", path, "': ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

constexpr char kTemporaryInfix[] = ".tmp.";

// Whether `name` is temporary_path() of some file: it ends in ".tmp.<digits>".
bool is_temporary_name(const std::string& name) {
  const size_t at = name.rfind(kTemporaryInfix);
  if (at == std::string::npos || at == 0) return false;
  const size_t digits = at + sizeof(kTemporaryInfix) - 1;
  return digits < name.size() &&
         name.find_first_not_of("0123456789", digits) == std::string::npos;
}

}  // namespace

std::string temporary_path(const std::string& path) { return path + kTemporaryInfix + std::to_string(::getpid()); }

void remove_stale_temporaries(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (is_temporary_name(name)) remove_tree(e.path().string());
  }
}

void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& fill) {
  const std::string tmp = temporary_path(path);
  try {
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      LT2_CHECK(out, "cannot create '", tmp, "': ", std::strerror(errno));
      fill(out);
      out.flush();
      LT2_CHECK(out, "write to '", tmp, "' failed: ", std::strerror(errno));
    }
    int fd = ::open(tmp.c_str(), O_RDONLY);
    if (fd >= 0) {
      ::fsync(fd);
      ::close(fd);
    }
    LT2_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path,
              "': ", std::strerror(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  write_file_atomic(path, [&](std::ostream& out) { out.write(contents.data(), contents.size()); });
}

void make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  LT2_CHECK(!ec, "cannot create folder '", path, "': ", ec.message());
}

// A path that cannot be looked up (a name too long, a parent folder not searchable) is an error
// naming the system's reason, not a "does not exist".
bool path_exists(const std::string& path) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  LT2_CHECK(!ec, "cannot look up '", path, "': ", ec.message());
  return exists;
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  auto remove_entry = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  // FTW_DEPTH: children before their folder; FTW_PHYS: do not follow symbolic links.
  LT2_CHECK(::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0, "cannot remove '", path,
            "': ", std::strerror(errno));
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  LT2_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(cat("cannot stat '", path, "': ", std::strerror(errno)));
  }
  LT2_CHECK(S_ISREG(st.st_mode), "'", path, "' is not a regular file");
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw Error(cat("cannot mmap '", path, "': ", std::strerror(errno)));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace lt2
