// Plots of curriculum runs (gnuplot, util/gnuplot.h).
#pragma once
#include <string>
#include <vector>

#include "lt2/tasks/curriculum.h"

namespace lt2::tasks {

// One run's learning curve: exact-match and per-answer accuracy vs step, the threshold as a
// horizontal line, a dashed vertical line where each stage starts (labelled with its n). Returns
// false, writing nothing, when gnuplot is not installed or `evals` is empty.
bool plot_learning_curve(const std::string& png, const std::vector<EvalRecord>& evals,
                         double threshold, const std::string& title);

// Curves of several runs in one panel each: exact match vs step, one line per run of the panel.
struct CurvePanel {
  std::string title;
  std::vector<std::string> labels;              // one per run
  std::vector<std::vector<EvalRecord>> evals;   // one per run
};
bool plot_learning_curves(const std::string& png, const std::vector<CurvePanel>& panels,
                          double threshold);

}  // namespace lt2::tasks
