// `lt2 tasks sweep`: a grid of curriculum runs (models x loop counts T), each a child process
// `lt2 tasks run` in its own folder, N at a time, then one results table.
//
// Sweep folder (base.out_dir):
//   <label>/T<t>/        one run folder (tasks/runner.h) per cell, plus log.txt (the child's output)
//   sweep.json           every cell: model, T, status, n_max, steps, per-stage results
//   sweep.md             n_max per (model, T), then the steps each stage took per run
//   curves.png           exact match vs step, one panel per model, one line per T
// A finished cell (results.json status "finished") is skipped; a started one resumes.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "lt2/tasks/runner.h"

namespace lt2::tasks {

// One model of the grid: a preset or model-config JSON, optionally with a layer pattern.
struct SweepModel {
  std::string label;    // names its folder and its table row
  std::string model;    // preset name or JSON path
  std::string pattern;  // "" = the config's own
};

// "label=model" or "model" (label = the file name without .json); pattern "" here.
SweepModel parse_sweep_model(const std::string& spec);
// A pattern applied to `base_model`; label = the pattern with characters other than letters,
// digits, '-' and '.' turned into '_'.
SweepModel pattern_sweep_model(const std::string& base_model, const std::string& pattern);

struct SweepConfig {
  std::vector<SweepModel> models;
  std::vector<int64_t> loops;  // T values
  TaskRunConfig base;          // all other settings; base.out_dir is the sweep folder
  int jobs = 1;                // runs at once
  int threads_per_run = 0;     // intra-op CPU threads of each child (0 = libtorch's default)
  double max_seconds = 0;      // wall-time limit of each child (0 = none); a stopped run resumes
  void validate() const;
};

struct SweepCell {
  SweepModel model;
  int64_t n_loops = 0;
  TaskRunConfig run;  // run.out_dir = <sweep>/<label>/T<t>
};

// The grid in table order (models outer, T inner). Throws on duplicate labels.
std::vector<SweepCell> sweep_cells(const SweepConfig& cfg);

// Runs every unfinished cell through `lt2_exe tasks run --config <cell>/run_config.json
// [--resume]`, `jobs` at a time, then writes sweep.json, sweep.md and curves.png and returns the
// sweep.json contents. A failed child is reported in the table, not fatal; a cell folder holding
// a run with another config is an error before anything starts. Progress lines go to `log`.
json run_sweep(const SweepConfig& cfg, const std::string& lt2_exe, std::FILE* log = stdout);

// The table of a sweep from its cells' results.json files (cells not run yet: status "missing").
json sweep_table(const SweepConfig& cfg);
// sweep.md: n_max per (model, T) (a '*' marks runs that have not finished), then one row per run
// with the steps each stage took (solved), or "x" (budget spent) / "…" (in progress) with the
// stage's last exact match and per-answer accuracy.
std::string sweep_markdown(const json& table);

}  // namespace lt2::tasks
