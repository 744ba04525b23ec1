// lt2 tasks: registered here so that its implementation lands in this one file.
#include "commands.h"
#include "lt2/util/error.h"

namespace lt2::cli {

void add_tasks_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tasks", "(in development)");
  cmd->callback([] { LT2_CHECK(false, "lt2 tasks is not built yet"); });
}

}  // namespace lt2::cli
