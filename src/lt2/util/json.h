// Typed access to JSON objects with errors that name the field, what was expected and what was found.
#pragma once
#include <nlohmann/json.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "lt2/util/error.h"

namespace lt2 {

using json = nlohmann::json;

std::string json_type_name(const json& j);
// "integer: 3", "string: \"abc\"", ... for error messages; long values are cut short.
std::string json_describe(const json& j);
json parse_json(const std::string& text, const std::string& what);
json load_json_file(const std::string& path);

namespace detail {
template <typename T>
struct is_vector : std::false_type {};
template <typename T, typename A>
struct is_vector<std::vector<T, A>> : std::true_type {};
}  // namespace detail

// `j` as a T, strictly: a bool takes only true/false, an integer type only a JSON integer within
// its range (nlohmann's own get<int>() would truncate 2.5 to 2 and wrap -1 into an unsigned), a
// floating-point type any number, a vector an array whose every element converts. `what` names
// the value in errors, e.g. "'config.json': field 'n_loops'".
template <typename T>
T json_as(const json& j, const std::string& what) {
  if constexpr (std::is_same_v<T, bool>) {
    LT2_CHECK(j.is_boolean(), what, " must be true or false, found ", json_describe(j));
    return j.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    LT2_CHECK(j.is_number_integer(), what, " must be an integer, found ", json_describe(j));
    constexpr auto lo = std::numeric_limits<T>::min();
    constexpr auto hi = std::numeric_limits<T>::max();
    const bool fits = j.is_number_unsigned()
                          ? j.get<uint64_t>() <= static_cast<uint64_t>(hi)
                          : j.get<int64_t>() >= static_cast<int64_t>(lo) &&
                                (j.get<int64_t>() < 0 || static_cast<uint64_t>(j.get<int64_t>()) <= static_cast<uint64_t>(hi));
    LT2_CHECK(fits, what, " must be an integer in [", +lo, ", ", +hi, "], found ", j.dump());
    return j.is_number_unsigned() ? static_cast<T>(j.get<uint64_t>()) : static_cast<T>(j.get<int64_t>());
  } else if constexpr (std::is_floating_point_v<T>) {
    LT2_CHECK(j.is_number(), what, " must be a number, found ", json_describe(j));
    return j.get<T>();
  } else if constexpr (detail::is_vector<T>::value) {
    LT2_CHECK(j.is_array(), what, " must be an array, found ", json_describe(j));
    T out;
    for (size_t i = 0; i < j.size(); ++i) out.push_back(json_as<typename T::value_type>(j[i], cat(what, "[", i, "]")));
    return out;
  } else {
    try {
      return j.get<T>();
    } catch (const json::exception&) {
      throw Error(cat(what, " has the wrong type (found ", json_describe(j), ")"));
    }
  }
}

// Reads `obj[key]` into `out` (json_as) when present and not null; leaves `out` unchanged
// otherwise. `where` prefixes error messages, e.g. "config.json".
template <typename T>
void json_get(const json& obj, const char* key, T& out, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return;
  out = json_as<T>(*it, cat(where, ": field '", key, "'"));
}

// `obj[key]` as a T (json_as); throws naming the field when `obj` is not an object or lacks it.
template <typename T>
T json_require(const json& obj, const char* key, const std::string& where) {
  LT2_CHECK(obj.is_object(), where, ": expected a JSON object, found ", json_describe(obj));
  auto it = obj.find(key);
  LT2_CHECK(it != obj.end() && !it->is_null(), where, ": required field '", key, "' is missing");
  return json_as<T>(*it, cat(where, ": field '", key, "'"));
}

// Throws when `obj` has a key not in `known`, naming it and listing the allowed keys.
void json_reject_unknown(const json& obj, const std::vector<std::string>& known,
                         const std::string& where);
// The same with the known keys taken from a config's defaults (its to_json()), plus "comment".
void json_reject_unknown_fields(const json& obj, const json& defaults, const std::string& where);

}  // namespace lt2
