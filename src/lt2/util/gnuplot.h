// PNG plots through the `gnuplot` program (pngcairo terminal; Debian's gnuplot-nox has it).
#pragma once
#include <string>

namespace lt2 {

// Path of the gnuplot executable found on $PATH, or "" when there is none.
std::string find_gnuplot();

// Renders `script` (gnuplot commands, without terminal/output settings) to `png_path`, written
// atomically (a temporary name, then renamed). Returns false, writing nothing, when gnuplot is not
// installed; throws lt2::Error when gnuplot fails (the message carries its error output).
bool plot_png(const std::string& png_path, const std::string& script, int width = 900, int height = 500);

// `text` quoted for a gnuplot string literal ('...', embedded quotes doubled).
std::string gnuplot_quote(const std::string& text);

}  // namespace lt2
