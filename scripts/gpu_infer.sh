#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) from the repo root with `.deps` carried: builds the CUDA
# targets of the inference engine, runs the GPU-labelled tests, the fused-kernel micro-benchmark
# and `lt2 bench decode|prefill`, and leaves at most 8 files in $OUT (the device tool's limit).
#   STAGES="test kernels decode reference prefill"   which parts run (default: all)
#   The test stage writes the GPU test record $OUT/gpu_tests.json (scripts/gpu_status.py --record: commit,
#   kernels/ops hash, pass/fail per test, totals, date, device); test_gpu's console log stays in /tmp/test_gpu.log.
#   Copy the record to bench/results/gpu_tests.json and run scripts/gpu_status.py --update-readme.
#   LT2_COMMIT=<commit> names the commit where the tree has no .git (with PREBUILT, build-prebuilt/COMMIT does)
#   BUILD_TARGETS="lt2_cli test_gpu"   what to build (default: those two, decode_kernels_bench and tma_stream_probe)
#   PREBUILT=build-prebuilt   carried lt2 and test_gpu (scripts/prebuild_gpu.sh) instead of the build: stages test and decode-like
#   MODELS=lt-1.3b,...  CONTEXTS=4k,...  BATCHES=1,8,32  STEPS=10  GTEST_FILTER=*
#   REF_CONTEXTS=4k,32k  REF_BATCHES=1,8  (the libtorch reference path: a subset, it is slow)
#   PREFILL_CONTEXTS=4k,8k,16k,32k  PREFILL_MODELS (default MODELS)  PROFILE_PREFILL=N (per-kernel table of N prefills)
#   PROFILE=N          engine cells: also record N steps with the CUDA profiler (per-kernel table)
#   KERNEL_ARGS="--kernels gemv --batches 1,8"   arguments of the micro-benchmark
#   STAGES may include "cublas": decode cells (CUBLAS_MODELS, CUBLAS_CONTEXTS=4k) with fused_gemv=0 (projections through
#   cuBLAS instead of the fused GEMV), for the A/B of that kernel
#   "probe": bench/tma_stream_probe (HBM -> shared memory by TMA bulk copies vs register loads);
#   "ncu": Nsight Compute on the micro-benchmark (NCU_KERNELS regex of kernel names, NCU_COUNT launches,
#   NCU_BENCH_ARGS its arguments, NCU_SECTIONS the report sections): speed of light, warp stalls, memory;
#   and "nochain": decode cells (NOCHAIN_MODELS, NOCHAIN_CONTEXTS=8k) with gemv_chain=0 (each block's tail as
#   three GEMV launches instead of one chained kernel), for the A/B of the chain;
#   "tail8": decode cells (TAIL_MODELS, TAIL_CONTEXTS=4k) with chained_tail_max_rows=8 (the whole block tail
#   chained at 5-8 rows too), for the A/B of that threshold;
#   "nopdl": decode cells (NOPDL_MODELS, NOPDL_CONTEXTS=4k) with pdl=0 (every kernel launched after the one
#   before it has ended, instead of as a programmatic dependent), for the A/B of that launch;
#   "ab": decode cells (AB_MODELS, AB_CONTEXTS=4k) with AB_SWITCH (a decode option name=value) set, described by
#   AB_WHAT;
#   "abs": the same for each of AB_SWITCHES (space-separated name=value words) into decode_abs.{md,json}
#   (the decode options: `lt2 bench decode --help`, docs/decode.md)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
STAGES=${STAGES:-test kernels decode reference prefill}
CALL="STAGES=\"$STAGES\"${PREBUILT:+ PREBUILT=$PREBUILT}${GTEST_FILTER:+ GTEST_FILTER=$GTEST_FILTER} scripts/gpu_infer.sh"
MODELS=${MODELS:-lt-1.3b,lt2-gdn-1.3b,lt2-full-gdn-1.3b,lt2-gdn-dsa-1.3b,ouro-1.4b}
ROOT=$PWD/.deps/root/usr
export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=build-gpu
L=$B/apps/lt2/lt2
TEST_GPU=$B/tests/test_gpu
prebuilt=0
log=/tmp/lt2_build.log
t0=$(date +%s)
# PREBUILT=dir: binaries built and stripped on the CPU machine (scripts/prebuild_gpu.sh), carried instead of
# building here (~110 s a call). Used only if they start; otherwise this builds as usual.
if [ -n "${PREBUILT:-}" ]; then
  export LD_LIBRARY_PATH="$PWD/$PREBUILT:$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH"
  if "$PREBUILT/lt2" --help > /tmp/prebuilt.log 2>&1 && "$PREBUILT/test_gpu" --gtest_list_tests > /dev/null 2>> /tmp/prebuilt.log; then
    L=$PREBUILT/lt2 TEST_GPU=$PREBUILT/test_gpu prebuilt=1
    kept=
    for stage in $STAGES; do  # the bench/ binaries are not carried
      case $stage in
        kernels | probe | ncu) echo "stage $stage needs bench/ binaries, which PREBUILT does not carry: skipped" ;;
        *) kept="$kept $stage" ;;
      esac
    done
    STAGES=$kept
    echo "prebuilt binaries of $(cat "$PREBUILT/COMMIT" 2> /dev/null) on $(nvidia-smi --query-gpu=name --format=csv,noheader)"
  else
    echo "prebuilt binaries do not start here (building instead):"; tail -3 /tmp/prebuilt.log
  fi
fi
if [ $prebuilt = 0 ]; then
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > $log 2>&1 &&
    cmake --build $B -j "$(nproc)" --target ${BUILD_TARGETS:-lt2_cli test_gpu decode_kernels_bench tma_stream_probe} >> $log 2>&1 ||
    { grep -E "error|Error" -A5 $log | head -80 | tee "$OUT/build_errors.txt"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s on $(nvidia-smi --query-gpu=name --format=csv,noheader)"
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has test; then
  rm -f /tmp/test_gpu.json
  # Stopped by a caller's time limit (gpu_batch.sh's `timeout`), it says which test was running.
  trap 'echo "test_gpu stopped by a signal; the last lines of its log:"; tail -n 4 /tmp/test_gpu.log; exit 143' TERM
  $TEST_GPU --gtest_filter="${GTEST_FILTER:-*}" --gtest_output=json:/tmp/test_gpu.json > /tmp/test_gpu.log 2>&1
  rc=$?
  trap - TERM
  grep -E "^\[  (PASSED|FAILED) |FAILED TEST|tests ran" /tmp/test_gpu.log | head -30
  # Each failed assertion with its message (from "file:line: Failure" to the test's FAILED line), kept
  # in $OUT and its first lines printed: the record says only which tests failed.
  awk '/: Failure$/ {p = 1} p {print} /^\[  FAILED  \]/ {p = 0}' /tmp/test_gpu.log > "$OUT/test_failures.txt"
  [ -s "$OUT/test_failures.txt" ] && { echo "failures (all in test_failures.txt):"; head -60 "$OUT/test_failures.txt"; }
  # The record: the binaries' commit and source hash when they were carried, else this tree's.
  record=()
  [ -n "${LT2_COMMIT:-}" ] && record=(--commit "$LT2_COMMIT")
  if [ $prebuilt = 1 ]; then
    [ -s "$PREBUILT/COMMIT" ] && record=(--commit "$(cat "$PREBUILT/COMMIT")")
    [ -s "$PREBUILT/SOURCE_HASH" ] && record+=(--source-hash "$(cat "$PREBUILT/SOURCE_HASH")")
  fi
  python3 scripts/gpu_status.py --record --gtest-json /tmp/test_gpu.json --log /tmp/test_gpu.log --rc $rc \
    --filter="${GTEST_FILTER:-*}" --command "$CALL" "${record[@]}" --out "$OUT/gpu_tests.json"
fi
if has kernels; then
  $B/bench/decode_kernels_bench ${KERNEL_ARGS:-} > "$OUT/decode_kernels.txt" 2>&1 || tail -20 "$OUT/decode_kernels.txt"
  grep -v '^RESULT' "$OUT/decode_kernels.txt" | tail -60
fi
if has probe; then
  $B/bench/tma_stream_probe > "$OUT/tma_stream_probe.txt" 2>&1 || tail -5 "$OUT/tma_stream_probe.txt"
  cat "$OUT/tma_stream_probe.txt"
fi
if has ncu; then
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2> /dev/null)
  if [ -n "$NCU" ]; then
    SECTIONS=()
    for sec in ${NCU_SECTIONS:-SpeedOfLight WarpStateStats MemoryWorkloadAnalysis LaunchStats}; do SECTIONS+=(--section "$sec"); done
    "$NCU" --graph-profiling node -k "regex:${NCU_KERNELS:-.}" -c "${NCU_COUNT:-4}" "${SECTIONS[@]}" --print-details all \
      $B/bench/decode_kernels_bench ${NCU_BENCH_ARGS:-} > "$OUT/ncu.txt" 2>&1 || tail -5 "$OUT/ncu.txt"
    grep -E "^  [a-z_:]+.*\(|Duration|DRAM Throughput|Stall|Executed Instructions|Issued Instructions|Warp Cycles Per Issued" \
      "$OUT/ncu.txt" | head -60
  else
    echo "ncu: not on this machine"
  fi
fi
PROFILE_ARGS=()
[ "${PROFILE:-0}" -gt 0 ] && PROFILE_ARGS=(--profile "$PROFILE" --profile-md "$OUT/decode_profile.md")
if has decode; then
  $L bench decode -m "$MODELS" -c "${CONTEXTS:-4k,8k,16k,32k,64k,128k}" -b "${BATCHES:-1,8,32}" --paths engine \
    --steps "${STEPS:-10}" --warmup 2 --out-json "$OUT/decode_engine.json" --out-md "$OUT/decode_engine.md" \
    "${PROFILE_ARGS[@]}" 2> /tmp/decode.err || tail -20 /tmp/decode.err
  cat "$OUT/decode_engine.md"
fi
# An A/B stage: engine decode cells with decode options set.
#   ab_decode NAME SWITCH MODELS CONTEXTS "what the switch does" [DIR]   -> DIR/decode_NAME.{json,md} (DIR: $OUT)
# SWITCH is name=value (a DecodeOptions field), or several joined by '+'.
ab_decode() {
  local dir=${6:-$OUT} options=()
  for setting in ${2//+/ }; do options+=(--decode-option "$setting"); done
  $L bench decode "${options[@]}" -m "$3" -c "$4" -b "${BATCHES:-1,8,32}" --paths engine --steps "${STEPS:-10}" \
    --warmup 2 --out-json "$dir/decode_$1.json" --out-md "$dir/decode_$1.md" 2> "/tmp/$1.err" || tail -20 "/tmp/$1.err"
  echo "with $2 ($5):"
  cat "$dir/decode_$1.md"
}
has cublas && ab_decode cublas fused_gemv=0 "${CUBLAS_MODELS:-$MODELS}" "${CUBLAS_CONTEXTS:-4k}" \
  "projections through cuBLAS"
has nochain && ab_decode nochain gemv_chain=0 "${NOCHAIN_MODELS:-$MODELS}" "${NOCHAIN_CONTEXTS:-8k}" \
  "block tails as three GEMV launches"
has tail8 && ab_decode tail8 chained_tail_max_rows=8 "${TAIL_MODELS:-$MODELS}" "${TAIL_CONTEXTS:-4k}" \
  "the whole block tail chained at 5-8 rows"
has nopdl && ab_decode nopdl pdl=0 "${NOPDL_MODELS:-$MODELS}" "${NOPDL_CONTEXTS:-4k}" \
  "no programmatic dependent launches"
has ab && ab_decode ab "$AB_SWITCH" "${AB_MODELS:-$MODELS}" "${AB_CONTEXTS:-4k}" "${AB_WHAT:-the A/B switch}"
# "abs": one decode A/B per switch of AB_SWITCHES (space-separated name=value[,value...] words, several
# options of one arm joined by '+'), all into
# $OUT/decode_abs.md and $OUT/decode_abs.json ({"arm i: switch": that run's JSON}; a switch may repeat,
# e.g. the control arm first and last, to see the call's drift).
if has abs; then
  i=0
  for sw in ${AB_SWITCHES:-}; do
    i=$((i + 1))
    { ab_decode "abs_$i" "$sw" "${AB_MODELS:-$MODELS}" "${AB_CONTEXTS:-4k}" "arm $i" /tmp; echo; } | tee -a "$OUT/decode_abs.md"
  done
  python3 - "$OUT/decode_abs.json" ${AB_SWITCHES:-} << 'PY'
import json, sys
out, switches = sys.argv[1], sys.argv[2:]
runs = {}
for i, sw in enumerate(switches, 1):
    try:
        runs[f"arm {i}: {sw}"] = json.load(open(f"/tmp/decode_abs_{i}.json"))
    except (OSError, ValueError) as e:
        runs[f"arm {i}: {sw}"] = {"error": str(e)}
json.dump(runs, open(out, "w"), indent=1)
PY
fi
if has reference; then
  $L bench decode -m "$MODELS" -c "${REF_CONTEXTS:-4k,32k}" -b "${REF_BATCHES:-1,8}" --paths reference \
    --steps "${STEPS:-10}" --warmup 2 --out-json "$OUT/decode_reference.json" --out-md "$OUT/decode_reference.md" \
    2> /tmp/reference.err || tail -20 /tmp/reference.err
  cat "$OUT/decode_reference.md"
fi
if has prefill; then
  PREFILL_PROFILE=()
  [ "${PROFILE_PREFILL:-0}" -gt 0 ] && PREFILL_PROFILE=(--profile "$PROFILE_PREFILL" --profile-md "$OUT/prefill_profile.md")
  $L bench prefill -m "${PREFILL_MODELS:-$MODELS}" -c "${PREFILL_CONTEXTS:-4k,8k,16k,32k}" --out-json "$OUT/prefill.json" \
    --out-md "$OUT/prefill.md" "${PREFILL_PROFILE[@]}" 2> /tmp/prefill.err || tail -20 /tmp/prefill.err
  cat "$OUT/prefill.md"
fi
