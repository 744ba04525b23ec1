#include "lt2/eval/records.h"

#include <filesystem>
#include <fstream>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2::eval {

std::vector<std::string> read_lines(const std::string& path) {
  std::error_code ec;
  LT2_CHECK(path_exists(path) && std::filesystem::is_regular_file(path, ec), "'", path, "' does not exist or is not a file");
  std::ifstream in(path, std::ios::binary);
  LT2_CHECK(in, "cannot open '", path, "'");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
  }
  return lines;
}

std::vector<Record> read_jsonl(const std::string& path) {
  const auto lines = read_lines(path);
  std::vector<Record> out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = cat("'", path, "', line ", i + 1);
    json j = json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    LT2_CHECK(!j.is_discarded(), where, ": expected a JSON object, found text that is not JSON");
    LT2_CHECK(j.is_object(), where, ": expected a JSON object, found ", json_type_name(j));
    out.push_back({std::move(j), where});
  }
  LT2_CHECK(!out.empty(), "'", path, "' holds no JSON object (expected one per line)");
  return out;
}

std::vector<Record> read_json_array(const std::string& path) {
  const json j = load_json_file(path);
  LT2_CHECK(j.is_array(), "'", path, "': expected a JSON array of objects, found ", json_type_name(j));
  LT2_CHECK(!j.empty(), "'", path, "': the array is empty");
  std::vector<Record> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = cat("'", path, "', item ", i + 1);
    LT2_CHECK(j[i].is_object(), where, ": expected a JSON object, found ", json_type_name(j[i]));
    out.push_back({j[i], where});
  }
  return out;
}

const json& field(const Record& r, const char* name) {
  auto it = r.doc.find(name);
  LT2_CHECK(it != r.doc.end() && !it->is_null(), r.where, ": missing field '", name, "'");
  return *it;
}

std::string str_field(const Record& r, const char* name) {
  const json& v = field(r, name);
  LT2_CHECK(v.is_string(), r.where, ": field '", name, "' must be a string, found ", json_describe(v));
  return v.get<std::string>();
}

int64_t int_field(const Record& r, const char* name) {
  const json& v = field(r, name);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    if (!s.empty() && s.size() < 18 && s.find_first_not_of("0123456789") == std::string::npos) return std::stoll(s);
  }
  throw Error(cat(r.where, ": field '", name, "' must be an integer, found ", json_describe(v)));
}

bool bool_field(const Record& r, const char* name) {
  const json& v = field(r, name);
  if (v.is_boolean()) return v.get<bool>();
  if (v == "true" || v == 1) return true;
  if (v == "false" || v == 0) return false;
  throw Error(cat(r.where, ": field '", name, "' must be true or false, found ", json_describe(v)));
}

}  // namespace lt2::eval
