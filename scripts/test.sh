#!/usr/bin/env bash
# Builds lt2 from scratch in a fresh folder and runs the whole CPU test suite (CTest). Where no GPU
# is present, the GPU-labelled test program and the benchmarks are not built (the GPU tests would
# only skip). Then fuzzes every reader of outside input for FUZZ_SECONDS each (default 10; scripts/fuzz.sh, in build-fuzz) when clang-14's libFuzzer is
# installed (scripts/setup.sh installs it); a crash found fails the run.
#   scripts/test.sh [cmake args...]
#   scripts/test.sh --sanitize [cmake args...]   the same suite built with AddressSanitizer and
#       UndefinedBehaviorSanitizer (CPU only, -O2 -g, in build-sanitize): any report fails its test
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_seconds=${FUZZ_SECONDS:-10}
if [ "${1:-}" = "--sanitize" ]; then
  shift
  fuzz_seconds=0  # the sanitizer run is the suite alone
  export BUILD_DIR=${BUILD_DIR:-build-sanitize}
  set -- -DLT2_SANITIZE=ON -DLT2_CUDA=OFF -DLT2_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
fi
# Without a GPU the GPU-labelled test program would only skip, and the benchmarks are no tests:
# neither is built there (arguments given later win: -DLT2_GPU_TESTS=ON -DLT2_BENCH=ON builds them).
if ! nvidia-smi -L > /dev/null 2>&1; then
  set -- -DLT2_GPU_TESTS=OFF -DLT2_BENCH=OFF "$@"
  echo "no GPU: test_gpu and the benchmarks are not built"
fi
# Unity batches (8 sources a translation unit): every translation unit loads libtorch's ~700 MB
# precompiled header, ~12 s on a CI core before its own code; batches pay it once per 8 sources
# (docs/testing.md has the times). Development builds (scripts/build.sh) stay one source a unit.
set -- -DCMAKE_UNITY_BUILD=ON "$@"
export BUILD_DIR=${BUILD_DIR:-build-test}
rm -rf "$BUILD_DIR"
start=$(date +%s)
scripts/build.sh "$@"
echo "build: $(( $(date +%s) - start )) s"
start=$(date +%s)
(cd "$BUILD_DIR" && ctest --output-on-failure --timeout 900 -j "${JOBS:-$(nproc)}")
echo "tests: $(( $(date +%s) - start )) s"
if [ "$fuzz_seconds" -gt 0 ]; then
  if command -v clang++-14 > /dev/null && [ -n "$(find /usr/lib/llvm-14/lib/clang -name 'libclang_rt.fuzzer*.a' 2>/dev/null)" ]; then
    start=$(date +%s)
    BUILD_DIR=build-fuzz scripts/fuzz.sh "$fuzz_seconds"  # its own clang build, not the suite's
    echo "fuzz: $(( $(date +%s) - start )) s (build and $fuzz_seconds s per target)"
  else
    echo "fuzz: skipped (no clang-14 with libFuzzer: scripts/setup.sh installs clang-14 libclang-rt-14-dev)"
  fi
fi
