#include "lt2/util/json.h"

#include <algorithm>

#include "lt2/util/fs.h"

namespace lt2 {

std::string json_type_name(const json& j) {
  if (j.is_boolean()) return "boolean";
  if (j.is_number_integer()) return "integer";
  if (j.is_number()) return "number";
  return j.type_name();
}

std::string json_describe(const json& j) {
  std::string text = j.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr size_t kShown = 80;
  if (text.size() > kShown) text = text.substr(0, kShown) + "...";
  return json_type_name(j) + " " + text;
}

json parse_json(const std::string& text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
    throw Error(cat(what, " is not valid JSON: ", e.what()));
  }
}

json load_json_file(const std::string& path) { return parse_json(read_file(path), "'" + path + "'"); }

void json_reject_unknown(const json& obj, const std::vector<std::string>& known,
                         const std::string& where) {
  LT2_CHECK(obj.is_object(), where, ": expected a JSON object, found ", json_type_name(obj));
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) == known.end()) {
      std::string allowed;
      for (const auto& k : known) allowed += (allowed.empty() ? "" : ", ") + k;
      throw Error(cat(where, ": unknown field '", it.key(), "' (allowed: ", allowed, ")"));
    }
  }
}

void json_reject_unknown_fields(const json& obj, const json& defaults, const std::string& where) {
  std::vector<std::string> known{"comment"};
  for (auto it = defaults.begin(); it != defaults.end(); ++it) known.push_back(it.key());
  json_reject_unknown(obj, known, where);
}

}  // namespace lt2
