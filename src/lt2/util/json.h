// Typed access to JSON objects with errors that name the field, what was expected and what was found.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "lt2/util/error.h"

namespace lt2 {

using json = nlohmann::json;

std::string json_type_name(const json& j);
json parse_json(const std::string& text, const std::string& what);
json load_json_file(const std::string& path);

// Reads `obj[key]` into `out` when present (leaves `out` unchanged otherwise). `where` prefixes
// error messages, e.g. "config.json".
template <typename T>
void json_get(const json& obj, const char* key, T& out, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return;
  try {
    out = it->get<T>();
  } catch (const json::exception&) {
    throw Error(cat(where, ": field '", key, "' has the wrong type (found ", json_type_name(*it),
                    ": ", it->dump(), ")"));
  }
}

// Throws when `obj` has a key not in `known`, naming it and listing the allowed keys.
void json_reject_unknown(const json& obj, const std::vector<std::string>& known,
                         const std::string& where);
// The same with the known keys taken from a config's defaults (its to_json()), plus "comment".
void json_reject_unknown_fields(const json& obj, const json& defaults, const std::string& where);

}  // namespace lt2
