// The benchmarks' --option flag: kernel switches (the DecodeOptions fields of docs/decode.md) as
// name=value, repeatable, so one binary can be A/B'd against itself with a switch off.
#pragma once
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"

struct KernelSwitchFlags {
  std::vector<std::string> assignments;  // as given, for the benchmark's JSON
  void add_to(CLI::App& app) {
    app.add_option("--option", assignments,
                   "A kernel switch as name=value (the DecodeOptions fields of docs/decode.md, e.g. short_conv=0); "
                   "repeatable");
  }
  // The defaults with the switches set (a malformed or unknown one throws). DecodeOptionsGuard keeps
  // a pointer to the options it installs: hold the result in a variable that outlives the guard.
  lt2::DecodeOptions options() const {
    lt2::DecodeOptions o;
    for (const auto& a : assignments) {
      const auto eq = a.find('=');
      LT2_CHECK(eq != std::string::npos, "--option takes name=value, found '", a, "'");
      o.set(a.substr(0, eq), a.substr(eq + 1));
    }
    return o;
  }
};
