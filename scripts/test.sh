#!/usr/bin/env bash
# Builds lt2 from scratch in a fresh folder and runs the whole CPU test suite (CTest). GPU-labelled
# tests skip themselves where no GPU is present.
#   scripts/test.sh [cmake args...]
#   scripts/test.sh --sanitize [cmake args...]   the same suite built with AddressSanitizer and
#       UndefinedBehaviorSanitizer (CPU only, -O2 -g, in build-sanitize): any report fails its test
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--sanitize" ]; then
  shift
  export BUILD_DIR=${BUILD_DIR:-build-sanitize}
  set -- -DLT2_SANITIZE=ON -DLT2_CUDA=OFF -DLT2_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
fi
export BUILD_DIR=${BUILD_DIR:-build-test}
rm -rf "$BUILD_DIR"
start=$(date +%s)
scripts/build.sh "$@"
echo "build: $(( $(date +%s) - start )) s"
cd "$BUILD_DIR"
start=$(date +%s)
ctest --output-on-failure --timeout 900 -j "${JOBS:-$(nproc)}"
echo "tests: $(( $(date +%s) - start )) s"
