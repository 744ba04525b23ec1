#!/usr/bin/env bash
# Configures and builds lt2 (Release, Ninja) into BUILD_DIR (default: build).
#   scripts/build.sh [extra cmake configure args...]      e.g. -DLT2_CUDA=OFF
#   TARGETS="lt2_cli" scripts/build.sh                     only these targets (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" > "$BUILD_DIR.configure.log" 2>&1 \
  || { cat "$BUILD_DIR.configure.log"; exit 1; }
cmake --build "$BUILD_DIR" -j "$JOBS" ${TARGETS:+--target $TARGETS}
