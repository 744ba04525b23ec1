// The `lt2` command: one file per subcommand. Each file defines an `add_<name>_command` that
// adds its subcommand (flags + callback) to the app; main.cpp calls them all.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "lt2/eval/model.h"
#include "lt2/util/error.h"
#include "lt2/util/json.h"

namespace lt2::cli {

// A config read from `--config` (an empty object without one) that the flags given on the command
// line override; a flag left unset (empty string, negative number) keeps the file's value.
struct ConfigWithFlags {
  explicit ConfigWithFlags(const std::string& config_path)
      : j(config_path.empty() ? json::object() : load_json_file(config_path)) {
    LT2_CHECK(j.is_object(), "'", config_path, "' must hold a JSON object");
  }
  void set_str(const char* key, const std::string& v) { if (!v.empty()) j[key] = v; }
  void set_int(const char* key, int64_t v) { if (v >= 0) j[key] = v; }
  void set_real(const char* key, double v) { if (v >= 0) j[key] = v; }
  json j;
};

// Loop and Ouro exit flags shared by `lt2 eval` and `lt2 generate` (defined in cmd_eval.cpp).
struct LoopFlags {
  int64_t loops = -1, exit_step = -1;
  double exit_threshold = -1;
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

}  // namespace lt2::cli
