// The one place lt2 reads its own environment variables (LT2_*). Everything that changes how a
// computation runs is an options struct passed down (DecodeOptions, TrainConfig, ...); what is
// left here describes the installation and the process:
//   LT2_CONFIG_DIR    the folder of the model presets (default: the source tree's configs/)
//   LT2_PEAK_TFLOPS   the GPU's dense bf16 peak for MFU, where lt2 does not know the device
//   LT2_LAUNCHER_PID  set by `lt2 train --nproc` for the ranks it starts (they end with it)
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace lt2 {

struct Environment {
  std::optional<std::string> config_dir;
  std::optional<double> peak_tflops;
  std::optional<int64_t> launcher_pid;
};

// The variables above, read once per process. A value that does not parse is an lt2::Error naming
// the variable.
const Environment& environment();

// The name of the launcher-pid variable (the launcher sets it for its ranks).
inline constexpr const char* kLauncherPidVariable = "LT2_LAUNCHER_PID";

}  // namespace lt2
