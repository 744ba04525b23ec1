#include "lt2/util/gnuplot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "lt2/util/error.h"
#include "lt2/util/fs.h"

namespace lt2 {

std::string find_gnuplot() {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string exe = (dir.empty() ? "." : dir) + "/gnuplot";
    if (::access(exe.c_str(), X_OK) == 0) return exe;
  }
  return "";
}

namespace {
// `text` as one word for /bin/sh.
std::string shell_quote(const std::string& text) {
  std::string q = "'";
  for (char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}
}  // namespace

std::string gnuplot_quote(const std::string& text) {
  std::string q = "'";
  for (char c : text) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

bool plot_png(const std::string& png_path, const std::string& script, int width, int height) {
  const std::string exe = find_gnuplot();
  if (exe.empty()) return false;
  // The script goes through a file (not a pipe, which gnuplot may close early on an error) and
  // gnuplot's messages to another, so a failure can report them. All three are temporary names
  // (temporary_path), so what a killed process leaves is removed as stale by the next one.
  const std::string tmp = temporary_path(png_path);
  const std::string script_path = temporary_path(png_path + ".gp"), errors = temporary_path(png_path + ".err");
  write_file_atomic(script_path, cat("set terminal pngcairo size ", width, ",", height,
                                     " font 'sans,10'\nset output ", gnuplot_quote(tmp), "\n",
                                     script, "\nset output\n"));
  const int status = std::system(
      (shell_quote(exe) + " " + shell_quote(script_path) + " 2> " + shell_quote(errors)).c_str());
  const std::string messages = path_exists(errors) ? read_file(errors) : "";
  ::unlink(script_path.c_str());
  ::unlink(errors.c_str());
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || !path_exists(tmp)) {
    ::unlink(tmp.c_str());
    throw Error(cat("gnuplot failed while writing '", png_path, "': ", messages));
  }
  LT2_CHECK(::rename(tmp.c_str(), png_path.c_str()) == 0, "cannot rename '", tmp, "' to '", png_path,
            "': ", std::strerror(errno));
  return true;
}

}  // namespace lt2
