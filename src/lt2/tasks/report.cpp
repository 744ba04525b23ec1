#include "lt2/tasks/report.h"

#include <algorithm>
#include <sstream>

#include "lt2/util/error.h"
#include "lt2/util/gnuplot.h"

namespace lt2::tasks {

namespace {

// A gnuplot datablock `$name` of (step, exact match, answer accuracy) rows.
std::string datablock(const std::string& name, const std::vector<EvalRecord>& evals) {
  std::ostringstream s;
  s << name << " << EOD\n";
  for (const auto& e : evals) s << e.step << ' ' << e.accuracy << ' ' << e.answer_accuracy << '\n';
  s << "EOD\n";
  return s.str();
}

const char* const kAxes =
    "set termoption noenhanced\nset xlabel 'step'\nset ylabel 'accuracy'\nset xrange [0:*]\nset yrange [0:1.08]\nset grid\nset key below\n";

std::string threshold_line(double threshold) {
  return cat("set arrow from graph 0, first ", threshold, " to graph 1, first ", threshold,
             " nohead dt 3 lc rgb 'red'\n");
}

}  // namespace

bool plot_learning_curve(const std::string& png, const std::vector<EvalRecord>& evals,
                         double threshold, const std::string& title) {
  if (evals.empty()) return false;
  std::ostringstream s;
  s << datablock("$curve", evals) << "set title " << gnuplot_quote(title) << "\n"
    << kAxes << threshold_line(threshold);
  // Stage k starts at the evaluation that solved stage k - 1 (stage 1 at step 0).
  for (size_t i = 0; i < evals.size(); ++i) {
    if (i > 0 && evals[i].stage == evals[i - 1].stage) continue;
    const int64_t start = i == 0 ? 0 : evals[i - 1].step;
    s << "set arrow from " << start << ", graph 0 to " << start
      << ", graph 1 nohead dt 2 lc rgb 'gray40'\n"
      << "set label 'n=" << stage_n(evals[i].stage) << "' at " << start
      << ", graph 0.97 left offset 0.4, 0 tc rgb 'gray30'\n";
  }
  s << "plot $curve using 1:2 with linespoints pt 7 ps 0.5 lw 2 title 'exact match', "
       "$curve using 1:3 with lines dt 2 title 'per-answer accuracy'\n";
  return plot_png(png, s.str());
}

bool plot_learning_curves(const std::string& png, const std::vector<CurvePanel>& panels,
                          double threshold) {
  if (panels.empty()) return false;
  const int cols = std::min<int>(3, static_cast<int>(panels.size()));
  const int rows = static_cast<int>((panels.size() + cols - 1) / cols);
  std::ostringstream s;
  s << kAxes << threshold_line(threshold) << "set multiplot layout " << rows << ","
    << cols << "\n";
  int block = 0;
  for (const auto& p : panels) {
    std::string plot;
    for (size_t r = 0; r < p.evals.size(); ++r) {
      if (p.evals[r].empty()) continue;
      const std::string name = "$run" + std::to_string(block++);
      s << datablock(name, p.evals[r]);
      plot += (plot.empty() ? "plot " : ", ") + name + " using 1:2 with linespoints pt 7 ps 0.4 title " +
              gnuplot_quote(p.labels[r]);
    }
    s << "set title " << gnuplot_quote(p.title) << "\n";
    // An empty panel still takes its place in the layout.
    s << (plot.empty() ? "plot [0:1] NaN notitle" : plot) << "\n";
  }
  s << "unset multiplot\n";
  return plot_png(png, s.str(), 450 * cols, 330 * rows);
}

}  // namespace lt2::tasks
