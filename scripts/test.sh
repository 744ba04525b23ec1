#!/usr/bin/env bash
# Builds lt2 from scratch in a fresh folder and runs the whole CPU test suite (CTest). GPU-labelled
# tests skip themselves where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILD_DIR=${BUILD_DIR:-build-test}
rm -rf "$BUILD_DIR"
start=$(date +%s)
scripts/build.sh "$@"
echo "build: $(( $(date +%s) - start )) s"
cd "$BUILD_DIR"
ctest --output-on-failure --timeout 900 -j "${JOBS:-$(nproc)}"
