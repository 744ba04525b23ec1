// lt2 bench: registered here so that its implementation lands in this one file.
#include "commands.h"
#include "lt2/util/error.h"

namespace lt2::cli {

void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "(in development)");
  cmd->callback([] { LT2_CHECK(false, "lt2 bench is not built yet"); });
}

}  // namespace lt2::cli
