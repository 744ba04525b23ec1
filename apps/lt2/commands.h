// The `lt2` command: one file per subcommand. Each file defines an `add_<name>_command` that
// adds its subcommand (flags + callback) to the app; main.cpp calls them all.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "lt2/eval/model.h"
#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"
#include "lt2/util/json.h"

namespace lt2::cli {

// A config read from `--config` (an empty object without one) that the flags given on the command
// line override. A flag is a std::optional: given, its value goes into the config (where the
// config's checks accept or refuse it); not given, the file's value or the default stays.
struct ConfigWithFlags {
  explicit ConfigWithFlags(const std::string& config_path)
      : j(config_path.empty() ? json::object() : load_json_file(config_path)) {
    LT2_CHECK(j.is_object(), "'", config_path, "' must hold a JSON object");
  }
  template <typename T>
  void set(const char* key, const std::optional<T>& v) {
    if (v) j[key] = *v;
  }
  json j;
};

// "section.key=value" into j[section][key], the value parsed as JSON when it parses, else taken as
// a string: `lt2 distill --set` and `lt2 train --mixer-option`. Errors name `flag` and what a
// section may be (`sections`).
inline void set_dotted(json& j, const std::string& kv, const char* flag, const char* sections) {
  const auto eq = kv.find('=');
  const auto dot = kv.substr(0, eq == std::string::npos ? 0 : eq).find('.');
  LT2_CHECK(eq != std::string::npos && dot != std::string::npos && dot > 0 && dot + 1 < eq, flag,
            " expects section.key=value (sections: ", sections, "), found '", kv, "'");
  const std::string section_name = kv.substr(0, dot), key = kv.substr(dot + 1, eq - dot - 1), value = kv.substr(eq + 1);
  json& section = j[section_name];
  LT2_CHECK(section.is_null() || section.is_object(), flag, " '", kv, "': '", section_name, "' is not a section");
  auto parsed = json::parse(value, nullptr, false);
  section[key] = parsed.is_discarded() ? json(value) : parsed;
}

// The kernel switches' names (the DecodeOptions fields of docs/decode.md), for --help texts.
inline std::string decode_option_names() {
  std::string names;
  for (const auto& n : DecodeOptions::names()) names += (names.empty() ? "" : ", ") + n;
  return names;
}

// A CLI11 check that a numeric flag is at least `min`: "--seed: must be >= 0, found -1". It runs
// before the conversion, so an unsigned flag never takes a negative value wrapped around.
inline CLI::Validator at_least(double min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        if (end == value.c_str() || *end != '\0' || v >= min) return "";  // non-numbers fail in the conversion
        return cat("must be >= ", min, ", found ", value);
      },
      cat(">= ", min));
}

// Loop and Ouro exit flags shared by `lt2 eval` and `lt2 generate` (defined in cmd_eval.cpp).
struct LoopFlags {
  std::optional<int64_t> loops, exit_step;
  std::optional<double> exit_threshold;
  std::string exit_rule = "lt2", exits = "final";
  eval::LoopOptions options() const;  // checks --exit-rule and --exits
};
// `with_exits`: also --exits final|all (scoring only; generation takes one exit).
void add_loop_flags(CLI::App* cmd, LoopFlags& f, bool with_exits);

void add_info_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_tokenizer_command(CLI::App& app);
void add_data_command(CLI::App& app);
void add_tasks_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_distill_command(CLI::App& app);

}  // namespace lt2::cli
