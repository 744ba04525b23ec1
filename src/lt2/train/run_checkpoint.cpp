#include "lt2/train/run_checkpoint.h"

#include <algorithm>
#include <filesystem>

#include "lt2/model/checkpoint_io.h"
#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace fs = std::filesystem;

namespace lt2 {

std::string save_rotating_checkpoint(const std::string& out_dir, int64_t step, const LoopedLM& model,
                                     const std::vector<FileWriter>& extra, int keep) {
  LT2_CHECK(keep >= 1, "checkpoints to keep must be >= 1, got ", keep);
  const std::string name = "ckpt-" + std::to_string(step);
  const std::string dir = out_dir + "/" + name, tmp = dir + ".tmp";
  remove_tree(tmp);
  save_checkpoint(tmp, model, extra);
  remove_tree(dir);  // a folder of this step left by a run interrupted before `latest` moved
  fs::rename(tmp, dir);
  write_file_atomic(out_dir + "/latest", name + "\n");
  std::vector<std::pair<int64_t, std::string>> all;
  for (const auto& e : fs::directory_iterator(out_dir)) {
    const std::string f = e.path().filename().string();
    if (e.is_directory() && f.rfind("ckpt-", 0) == 0 && f.find(".tmp") == std::string::npos)
      all.emplace_back(std::stoll(f.substr(5)), e.path().string());
  }
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + keep < all.size(); ++i) remove_tree(all[i].second);
  return dir;
}

}  // namespace lt2
