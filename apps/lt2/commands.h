// The `lt2` command: one file per subcommand. Each file defines an `add_<name>_command` that
// adds its subcommand (flags + callback) to the app; main.cpp calls them all.
#pragma once
#include <CLI/CLI.hpp>

namespace lt2::cli {

void add_info_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_tokenizer_command(CLI::App& app);
void add_data_command(CLI::App& app);
void add_tasks_command(CLI::App& app);
void add_bench_command(CLI::App& app);

}  // namespace lt2::cli
