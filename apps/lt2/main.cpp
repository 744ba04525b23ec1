// lt2: train, distill, evaluate and serve looped transformers with linear-time mixers.
#include <cstdio>
#include <exception>

#include <c10/util/Exception.h>

#include "commands.h"
#include "lt2/util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"lt2: looped transformers with linear-time attention (train, distill, generate, evaluate, serve, inspect)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "lt2 0.1.0");
  lt2::cli::add_info_command(app);
  lt2::cli::add_train_command(app);
  lt2::cli::add_generate_command(app);
  lt2::cli::add_tokenizer_command(app);
  lt2::cli::add_data_command(app);
  lt2::cli::add_tasks_command(app);
  lt2::cli::add_bench_command(app);
  lt2::cli::add_eval_command(app);
#ifdef LT2_WITH_SERVE
  lt2::cli::add_serve_command(app);
#endif
  lt2::cli::add_distill_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const lt2::Error& e) {
    std::fprintf(stderr, "lt2: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {  // libtorch's (out of memory among them): its message without the stack trace
    std::fprintf(stderr, "lt2: error from libtorch: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lt2: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
