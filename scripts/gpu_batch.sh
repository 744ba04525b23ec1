#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool): several steps in one call, each under its own time limit and
# with its own $OUT folder. After every step the folders are packed into $OUT/results.tar.gz
# (written whole, then renamed), so a call cut short by its limit still returns each step that
# finished, and the device tool's limit of 8 files holds whatever the steps write. Each step's log
# is its folder's log.txt; the last 25 lines of it are printed.
#   scripts/gpu_batch.sh "NAME SECONDS COMMAND..." ...
#   e.g. (LT2_COMMIT written out: the command runs on the device, whose copy of .git can be stale)
#        LT2_COMMIT=1a2b3c4 scripts/gpu_batch.sh \
#          "tests 240 LT2_SERVE=ON STAGES=test BUILD_TARGETS='lt2_cli test_gpu mixer_bench' scripts/gpu_infer.sh" \
#          "window 120 scripts/gpu_window_bench.sh"
# Unpack here with: tar xzf results.tar.gz -C some/folder (steps.txt lists each step's exit code
# and seconds; 124: it reached its limit).
set -uo pipefail
cd "$(dirname "$0")/.."
# Steps that run lt2's binaries directly find the libraries .deps carries.
[ -d "$PWD/.deps/root/usr" ] && export LD_LIBRARY_PATH="$PWD/.deps/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
# Binaries built on the CPU machine (scripts/prebuild_gpu.sh) arrive packed in .deps: unpacked to build-prebuilt/,
# with the libraries they load (theirs, libtorch's, the CUDA runtime) on the path.
if [ -f .deps/build-prebuilt.tar.xz ]; then
  rm -rf build-prebuilt && python3 -c "import tarfile; tarfile.open('.deps/build-prebuilt.tar.xz').extractall()"
  export LD_LIBRARY_PATH="$PWD/build-prebuilt:$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH"
  # The binaries name the presets folder of the tree they were built in; this tree's is the one here.
  export LT2_CONFIG_DIR="$PWD/configs"
  echo "unpacked build-prebuilt/ ($(cat build-prebuilt/COMMIT))"
fi
FINAL=${OUT:-/tmp/lt2_gpu_out}
RESULTS=/tmp/lt2_batch
mkdir -p "$FINAL"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
for step in "$@"; do
  read -r name seconds command <<< "$step"
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ && "$seconds" =~ ^[0-9]+$ && -n "$command" ]] ||
    { echo "gpu_batch: a step is \"NAME SECONDS COMMAND...\", found \"$step\"" >&2; exit 2; }
  mkdir -p "$RESULTS/$name"
  start=$(date +%s)
  echo "== $name (limit ${seconds} s): $command"
  OUT="$RESULTS/$name" timeout --kill-after=10 "$seconds" bash -c "$command" > "$RESULTS/$name/log.txt" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start )) s" | tee -a "$RESULTS/steps.txt"
  tail -n 25 "$RESULTS/$name/log.txt"
  tar czf "$FINAL/results.tar.gz.tmp" -C "$RESULTS" . && mv "$FINAL/results.tar.gz.tmp" "$FINAL/results.tar.gz"
done
