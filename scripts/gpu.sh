#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool), from the repo root, with `.deps` carried (make it here
# first with scripts/gpu_deps.sh). Builds with CUDA, runs every test (GPU-labelled ones included),
# runs the training-throughput benchmarks, copies logs and JSON to $OUT, and prints a short table.
#   STAGE=all|build|test|bench  (default all)   BENCH_STEPS=30
# The test stage writes the GPU test record $OUT/gpu_tests.json (scripts/gpu_status.py --record) from
# test_gpu's JSON report; copy it to bench/results/gpu_tests.json and run scripts/gpu_status.py
# --update-readme. LT2_COMMIT=<commit> names the commit where the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
STAGE=${STAGE:-all}
ROOT=$PWD/.deps/root/usr
export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=build-gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [[ $STAGE == all || $STAGE == build ]]; then
  t0=$(date +%s)
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > "$OUT/configure.log" 2>&1 \
    || { tail -40 "$OUT/configure.log"; exit 1; }
  # What the GPU work needs first; then everything else, keeping going past a broken target.
  cmake --build $B -j "$(nproc)" --target lt2_cli train_bench mixer_bench test_gpu > "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" -A5 "$OUT/build.log" | head -60; exit 1; }
  echo "build (lt2, bench, GPU tests): $(( $(date +%s) - t0 )) s"
  cmake --build $B -j "$(nproc)" -- -k 0 >> "$OUT/build.log" 2>&1 || grep -E "FAILED" "$OUT/build.log" | head
  echo "build (all): $(( $(date +%s) - t0 )) s"
fi

run_tests() {
  (cd $B && ctest --output-on-failure -j 8 --timeout 300 "$@") > "$OUT/ctest.log" 2>&1
  grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | tail -15
}
if [[ $STAGE == all || $STAGE == test ]]; then
  rm -f /tmp/test_gpu.json
  # The GPU-labelled tests first: they are what only this machine can run.
  GTEST_OUTPUT=json:/tmp/test_gpu.json run_tests -L gpu
  cp "$OUT/ctest.log" "$OUT/ctest_gpu.log"
  python3 scripts/gpu_status.py --record --gtest-json /tmp/test_gpu.json --log "$OUT/ctest_gpu.log" \
    --command "STAGE=$STAGE scripts/gpu.sh" ${LT2_COMMIT:+--commit "$LT2_COMMIT"} --out "$OUT/gpu_tests.json"
fi

if [[ $STAGE == all || $STAGE == bench ]]; then
  : > "$OUT/train_bench.jsonl"
  STEPS=${BENCH_STEPS:-30}
  for spec in ${BENCH_MODELS:-lt-100m lt2-gdn-100m lt2-full-gdn-100m}; do
    for ckpt in "" ${BENCH_CKPT:-}; do
      $B/bench/train_bench --model "$spec" --seq-len 2048 --batch-size 16 --steps "$STEPS" $ckpt \
        > "$OUT/train_bench_${spec}${ckpt}.log" 2>&1
      grep '^RESULT' "$OUT/train_bench_${spec}${ckpt}.log" | sed 's/^RESULT //' >> "$OUT/train_bench.jsonl" \
        || tail -5 "$OUT/train_bench_${spec}${ckpt}.log"
    done
  done
  : > "$OUT/mixer_bench.jsonl"
  for mixer in ${BENCH_MIXERS:-full gdn}; do
    $B/bench/mixer_bench --model lt2-full-gdn-100m --mixer "$mixer" --batch 16 --seq 2048 \
      ${TRACE:+--trace $OUT/trace_$mixer.json} 2>&1 | grep '^RESULT' | sed 's/^RESULT //' >> "$OUT/mixer_bench.jsonl"
  done
  cat "$OUT/mixer_bench.jsonl"
  python3 - "$OUT/train_bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'model':<22}{'params':>10}{'seq':>6}{'batch':>6}{'ckpt':>6}{'ms/step':>10}{'tok/s':>12}{'MFU':>8}")
for r in rows:
    print(f"{r['model']:<22}{r['parameters']/1e6:>9.1f}M{r['seq_len']:>6}{r['batch_size']:>6}{str(r['checkpoint_loops'])[0]:>6}"
          f"{r['median_step_ms']:>10.1f}{r['tokens_per_s']:>12.0f}{100*r['mfu']:>7.1f}%")
PY
fi

if [[ $STAGE == all || $STAGE == test ]]; then
  run_tests -LE gpu  # then the CPU suite on this machine's cores
fi
