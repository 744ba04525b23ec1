#!/usr/bin/env bash
# Fuzzes every reader of outside input (tests/fuzz/targets/*.cpp) with libFuzzer, AddressSanitizer
# and UndefinedBehaviorSanitizer on, SECONDS each (default 20), starting from the seed corpus
# (tests/fuzz/corpus/<target>/) and the corpus earlier runs grew (BUILD_DIR/fuzz-corpus/<target>/).
# A crashing input is saved under tests/fuzz/regressions/<target>/, which the CTest fuzz_<target>
# replays from then on. Prints a table: executions, time, corpus size, crashes per target.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# Needs clang-14 with libFuzzer (Debian: clang-14 libclang-rt-14-dev). Builds into build-fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
[ $# -gt 0 ] && shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in tests/fuzz/targets/*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi
BUILD_DIR=${BUILD_DIR:-build-fuzz}
JOBS=${JOBS:-$(nproc)}
# Unity batches as in scripts/test.sh (each translation unit loads the libtorch precompiled header);
# line tables only: reports name files and lines, and full debug information of the libtorch
# templates is most of a -g build's time.
CC=clang-14 CXX=clang++-14 cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLT2_FUZZ=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" -DCMAKE_UNITY_BUILD=ON \
  -DLT2_CUDA=OFF -DLT2_BENCH=OFF -DLT2_GPU_TESTS=OFF > "$BUILD_DIR.configure.log" 2>&1 || { cat "$BUILD_DIR.configure.log"; exit 1; }
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]/#/fuzz_}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
rows=()
status=0
for t in "${targets[@]}"; do
  corpus="$BUILD_DIR/fuzz-corpus/$t"
  saved="tests/fuzz/regressions/$t"
  mkdir -p "$corpus" "$saved"
  before=$(ls "$saved" | wc -l)
  log="$BUILD_DIR/fuzz-$t.log"
  start=$(date +%s)
  # -rss_limit_mb: an input that makes a reader allocate 2 GB is a finding (sizes are checked first).
  if ! "$BUILD_DIR/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
      -dict="tests/fuzz/dict/$t.dict" -artifact_prefix="$saved/" -print_final_stats=1 \
      "$corpus" "tests/fuzz/corpus/$t" > "$log" 2>&1; then
    status=1
    tail -40 "$log"
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  crashes=$(( $(ls "$saved" | wc -l) - before ))
  rows+=("| $t | $execs | $(( $(date +%s) - start )) s | $(ls "$corpus" | wc -l) | $crashes |")
done
echo
echo "| target | executions | time | corpus | new crashes |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit $status
