#include "lt2/train/run_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "lt2/model/checkpoint_io.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace fs = std::filesystem;

namespace lt2 {

namespace {

constexpr char kPrefix[] = "ckpt-";
constexpr char kTemporarySuffix[] = ".tmp";  // a checkpoint folder being written

}  // namespace

std::string read_checkpoint_pointer(const std::string& path) {
  if (!path_exists(path)) return "";
  std::string name = read_file(path);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

void remove_checkpoint_temporaries(const std::string& out_dir) {
  if (!fs::is_directory(out_dir)) return;
  remove_stale_temporaries(out_dir);
  for (const auto& e : fs::directory_iterator(out_dir)) {
    const std::string f = e.path().filename().string();
    const size_t n = sizeof(kTemporarySuffix) - 1;
    if (e.is_directory() && f.rfind(kPrefix, 0) == 0 && f.size() > n && f.compare(f.size() - n, n, kTemporarySuffix) == 0)
      remove_tree(e.path().string());
  }
}

std::string save_rotating_checkpoint(const std::string& out_dir, int64_t step, const LoopedLM& model,
                                     const std::vector<FileWriter>& extra, int keep, bool best) {
  LT2_CHECK(keep >= 1, "checkpoints to keep must be >= 1, got ", keep);
  const std::string name = kPrefix + std::to_string(step);
  const std::string dir = out_dir + "/" + name, tmp = dir + kTemporarySuffix;
  remove_tree(tmp);
  try {
    save_checkpoint(tmp, model, extra);
  } catch (...) {
    ::rmdir(tmp.c_str());  // save_checkpoint removed its files; the folder goes too
    throw;
  }
  remove_tree(dir);  // a folder of this step left by a run interrupted before `latest` moved
  fs::rename(tmp, dir);
  const std::string best_pointer = out_dir + "/best";
  if (best) write_file_atomic(best_pointer, name + "\n");
  write_file_atomic(out_dir + "/latest", name + "\n");
  const std::string best_name = read_checkpoint_pointer(best_pointer);
  std::vector<std::pair<int64_t, std::string>> all;
  for (const auto& e : fs::directory_iterator(out_dir)) {
    const std::string f = e.path().filename().string();
    if (e.is_directory() && f.rfind(kPrefix, 0) == 0 && f.find(kTemporarySuffix) == std::string::npos)
      all.emplace_back(std::stoll(f.substr(sizeof(kPrefix) - 1)), e.path().string());
  }
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + keep < all.size(); ++i)
    if (fs::path(all[i].second).filename() != best_name) remove_tree(all[i].second);
  return dir;
}

}  // namespace lt2
