#include "lt2/io/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"
#include "lt2/util/json.h"

namespace lt2 {

namespace {

std::string shape_str(torch::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

std::string dtype_str(torch::ScalarType t) {
  try {
    return safetensors_dtype_name(t);
  } catch (const Error&) {
    return c10::toString(t);
  }
}

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// The key of model tensor `name` in the file.
std::string file_key(const NameMap& name_map, const std::string& name) {
  auto it = name_map.find(name);
  return it == name_map.end() ? name : it->second;
}

// Appends a titled list of problems, at most `limit` lines of it.
void append_list(std::string& msg, const std::vector<std::string>& items, size_t limit = 20) {
  for (size_t i = 0; i < items.size() && i < limit; ++i) msg += "\n  " + items[i];
  if (items.size() > limit) msg += cat("\n  ... and ", items.size() - limit, " more");
}

}  // namespace

FileWriter safetensors_writer(const std::string& name, TensorMap tensors, Metadata metadata) {
  return {name, [tensors = std::move(tensors), metadata = std::move(metadata)](std::ostream& out) {
            write_safetensors(out, tensors, metadata);
          }};
}

FileWriter text_writer(const std::string& name, std::string contents) {
  return {name, [contents = std::move(contents)](std::ostream& out) {
            out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
          }};
}

void write_folder_atomic(const std::string& dir, const std::vector<FileWriter>& files) {
  std::set<std::string> names;
  for (const auto& f : files) {
    LT2_CHECK(!f.name.empty() && f.name.find('/') == std::string::npos, "folder '", dir,
              "': '", f.name, "' is not a plain file name");
    LT2_CHECK(names.insert(f.name).second, "folder '", dir, "': file '", f.name, "' is written twice");
  }
  make_dirs(dir);
  std::vector<std::string> temps;
  auto remove_temps = [&](size_t from) {
    for (size_t i = from; i < temps.size(); ++i) ::unlink(temps[i].c_str());
  };
  try {
    for (const auto& f : files) {
      temps.push_back(temporary_path(dir + "/" + f.name));
      {
        std::ofstream out(temps.back(), std::ios::binary | std::ios::trunc);
        LT2_CHECK(out, "cannot create '", temps.back(), "': ", std::strerror(errno));
        f.write(out);
        out.flush();
        LT2_CHECK(out, "write to '", temps.back(), "' failed: ", std::strerror(errno));
      }
      fsync_path(temps.back(), O_RDONLY);
    }
  } catch (...) {
    remove_temps(0);
    throw;
  }
  // Every file is complete on disk: move them into place.
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string dst = dir + "/" + files[i].name;
    if (::rename(temps[i].c_str(), dst.c_str()) != 0) {
      const std::string why = std::strerror(errno);
      remove_temps(i);
      throw Error(cat("cannot rename '", temps[i], "' to '", dst, "': ", why));
    }
  }
  fsync_path(dir, O_RDONLY | O_DIRECTORY);  // make the renames durable
}

TensorMap module_tensors(const torch::nn::Module& m) {
  TensorMap out;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) out[p.key()] = p.value().detach();
  for (const auto& b : m.named_buffers(/*recurse=*/true)) out[b.key()] = b.value().detach();
  return out;
}

TensorMap load_tensor_map(const std::string& path) {
  SafetensorsFile f(path);
  TensorMap out;
  for (const auto& name : f.names()) out[name] = f.tensor(name).clone();
  return out;
}

namespace {

// Calls fn(file, key) for every weight of a checkpoint folder: each tensor of model.safetensors, or
// each key of model.safetensors.index.json in the shard that holds it (checked against the index).
void for_each_weight(const std::string& dir, std::string* source,
                     const std::function<void(const SafetensorsFile&, const std::string&)>& fn) {
  LT2_CHECK(path_exists(dir), "checkpoint folder '", dir, "' does not exist");
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  if (path_exists(single)) {
    SafetensorsFile f(single);
    for (const auto& name : f.names()) fn(f, name);
    if (source) *source = single;
    return;
  }
  LT2_CHECK(path_exists(index), "checkpoint folder '", dir,
            "' has neither model.safetensors nor model.safetensors.index.json");
  const json j = load_json_file(index);
  const std::string where = "'" + index + "'";
  LT2_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), where,
            ": expected an object with a 'weight_map' object (tensor name -> shard file)");
  std::map<std::string, std::vector<std::string>> shards;  // file -> tensor names
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    LT2_CHECK(it->is_string(), where, ": weight_map entry '", it.key(), "' must be a file name, found ",
              it->dump());
    shards[it->get<std::string>()].push_back(it.key());
  }
  for (const auto& [file, keys] : shards) {
    LT2_CHECK(file.find('/') == std::string::npos, where, ": shard '", file, "' is not a plain file name");
    SafetensorsFile f(dir + "/" + file);
    const std::set<std::string> listed(keys.begin(), keys.end());
    for (const auto& name : f.names())
      LT2_CHECK(listed.count(name), where, ": shard '", file, "' holds tensor '", name,
                "', which the index does not list");
    for (const auto& key : keys) {
      LT2_CHECK(f.contains(key), where, ": tensor '", key, "' is listed in shard '", file,
                "', which does not hold it");
      fn(f, key);
    }
  }
  if (source) *source = index;
}

}  // namespace

TensorMap open_model_weights(const std::string& dir, std::string* source) {
  TensorMap out;
  for_each_weight(dir, source, [&](const SafetensorsFile& f, const std::string& key) { out[key] = f.tensor(key); });
  return out;
}

TensorSpecs read_model_weight_specs(const std::string& dir, std::string* source) {
  TensorSpecs out;
  for_each_weight(dir, source, [&](const SafetensorsFile& f, const std::string& key) { out[key] = f.info(key); });
  return out;
}

void check_weights_match(const torch::nn::Module& m, const TensorSpecs& weights, const std::string& source,
                         const NameMap& name_map, const std::set<std::string>& ignore) {
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> used;
  for (const auto& [name, dst] : module_tensors(m)) {
    const std::string key = file_key(name_map, name);
    const std::string label = key == name ? "'" + key + "'" : "'" + key + "' (model tensor '" + name + "')";
    auto w = weights.find(key);
    if (w == weights.end()) {
      missing.push_back(cat("missing key ", label, ": expected shape ", shape_str(dst.sizes()), " ",
                            dtype_str(dst.scalar_type())));
      continue;
    }
    used.insert(key);
    const TensorSpec& src = w->second;
    if (torch::IntArrayRef(src.shape) != dst.sizes()) {
      mismatched.push_back(cat("shape mismatch for key ", label, ": expected ", shape_str(dst.sizes()),
                               ", found ", shape_str(src.shape)));
      continue;
    }
    const bool dtype_ok = dst.is_floating_point() ? c10::isFloatingType(src.dtype) : src.dtype == dst.scalar_type();
    if (!dtype_ok)
      mismatched.push_back(cat("dtype mismatch for key ", label, ": expected ",
                               dst.is_floating_point() ? "a floating-point dtype (model: " : "",
                               dtype_str(dst.scalar_type()), dst.is_floating_point() ? ")" : "",
                               ", found ", dtype_str(src.dtype)));
  }
  for (const auto& [key, t] : weights)
    if (!used.count(key) && !ignore.count(key))
      unexpected.push_back(cat("unexpected key '", key, "' with shape ", shape_str(t.shape), " ", dtype_str(t.dtype)));
  const size_t problems = missing.size() + unexpected.size() + mismatched.size();
  if (problems == 0) return;
  std::string msg = cat("checkpoint '", source, "' does not match the model (", problems,
                        problems == 1 ? " problem):" : " problems):");
  append_list(msg, mismatched);
  append_list(msg, missing);
  append_list(msg, unexpected);
  throw Error(msg);
}

void load_weights_into(torch::nn::Module& m, const TensorMap& weights, const std::string& source,
                       const NameMap& name_map, const std::set<std::string>& ignore) {
  TensorSpecs specs;
  for (const auto& [key, t] : weights) specs[key] = {t.scalar_type(), t.sizes().vec()};
  check_weights_match(m, specs, source, name_map, ignore);
  torch::NoGradGuard no_grad;
  for (auto& [name, dst] : module_tensors(m)) dst.copy_(weights.at(file_key(name_map, name)));
}

void load_weights_into(torch::nn::Module& m, const SafetensorsFile& file, const NameMap& name_map,
                       const std::set<std::string>& ignore) {
  TensorMap weights;
  for (const auto& name : file.names()) weights[name] = file.tensor(name);
  load_weights_into(m, weights, file.path(), name_map, ignore);
}

torch::ScalarType default_load_dtype(const TensorMap& weights) {
  bool any_float = false;
  for (const auto& kv : weights) {
    if (!kv.second.is_floating_point()) continue;
    any_float = true;
    if (kv.second.scalar_type() != torch::kFloat64) return torch::kFloat32;
  }
  return any_float ? torch::kFloat64 : torch::kFloat32;
}

}  // namespace lt2
