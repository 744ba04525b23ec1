// The benchmarks' --option flag: kernel switches (the DecodeOptions fields of docs/decode.md) as
// name=value, repeatable, so one binary can be A/B'd against itself with a switch off.
#pragma once
#include <CLI/CLI.hpp>

#include <string>
#include <utility>
#include <vector>

#include "lt2/ops/decode_options.h"
#include "lt2/util/error.h"

// "name=value" of a repeatable flag -> {name, value}; `flag` names it in the error.
inline std::pair<std::string, std::string> split_assignment(const std::string& a, const char* flag) {
  const auto eq = a.find('=');
  LT2_CHECK(eq != std::string::npos, flag, " takes name=value, found '", a, "'");
  return {a.substr(0, eq), a.substr(eq + 1)};
}

struct KernelSwitchFlags {
  std::vector<std::string> assignments;  // as given, for the benchmark's JSON
  void add_to(CLI::App& app) {
    app.add_option("--option", assignments,
                   "A kernel switch as name=value (the DecodeOptions fields of docs/decode.md, e.g. short_conv=0); "
                   "repeatable");
  }
  // The defaults with the switches set, installed for its lifetime (a malformed or unknown switch
  // throws). It owns the options its DecodeOptionsGuard points at.
  class Scope {
   public:
    explicit Scope(const std::vector<std::string>& assignments) : options_(parse(assignments)), guard_(options_) {}

   private:
    static lt2::DecodeOptions parse(const std::vector<std::string>& assignments) {
      lt2::DecodeOptions o;
      for (const auto& a : assignments) {
        const auto [name, value] = split_assignment(a, "--option");
        o.set(name, value);
      }
      return o;
    }
    lt2::DecodeOptions options_;
    lt2::DecodeOptionsGuard guard_;
  };
};
