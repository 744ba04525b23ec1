#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool), from the repo root with `.deps` carried: builds a baseline
# commit's benchmarks from a source archive, for an A/B against this tree in the same call without
# baseline binaries built on the CPU machine. Make the archive here first:
#   git archive <commit> | gzip > .deps/<name>-src.tar.gz
# It is unpacked into /tmp/baseline, configured as scripts/gpu.sh configures (with this tree's .deps)
# and BUILD_TARGETS (default: train_bench mixer_bench) built into /tmp/baseline/build; the log is
# /tmp/baseline/build.log. Runs beside a build of this tree or the GPU tests (16 cores).
#   SOURCE=.deps/main-7c4efaf-src.tar.gz scripts/gpu_build_baseline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${SOURCE:?SOURCE: a source archive of the baseline commit (git archive | gzip) under .deps}"
ROOT=$PWD/.deps/root/usr
export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
rm -rf /tmp/baseline && mkdir -p /tmp/baseline
tar xzf "$SOURCE" -C /tmp/baseline
t0=$(date +%s)
{ cmake -S /tmp/baseline -B /tmp/baseline/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=OFF &&
  cmake --build /tmp/baseline/build -j "$(nproc)" --target ${BUILD_TARGETS:-train_bench mixer_bench}; } \
  > /tmp/baseline/build.log 2>&1 || { grep -E "error|Error" -A5 /tmp/baseline/build.log | head -40; exit 1; }
echo "baseline $(basename "$SOURCE"): built in $(( $(date +%s) - t0 )) s"
