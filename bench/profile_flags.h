// The benchmarks' kernel-profile flags: --profile N (profile N more runs after timing) and
// --profile-ops (each kernel per launching operator), with the size of the table they print.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

struct ProfileFlags {
  int64_t runs = 0;    // --profile (0: off)
  bool by_op = false;  // --profile-ops
  // Rows of the per-kernel table: twice as many where each kernel is split by operator.
  size_t rows(size_t plain) const { return by_op ? 2 * plain : plain; }
  // `runs_help`: what --profile records.
  void add_to(CLI::App& app, const std::string& runs_help) {
    auto* profile = app.add_option("--profile", runs, runs_help)->capture_default_str();
    app.add_flag("--profile-ops", by_op,
                 "With --profile: list each kernel per launching operator and its first input's sizes and dtype")
        ->needs(profile);
  }
};
