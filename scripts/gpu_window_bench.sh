#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) after a build in build-gpu (scripts/gpu_infer.sh with
# BUILD_TARGETS including test_gpu and mixer_bench): sliding-window attention through
# FlashAttention-2 (issue 24). First the GPU tests of the op (WindowAttentionGpu.*); then, at each
# BATCHxSEQ and window, forward and forward + backward of ops::window_attention with the switch
# `window_flash` on and off (boolean-mask SDPA) and of causal SDPA (its upper bound), at HEADS x
# HEAD_DIM; then the window mixer layer at MODEL's shape with the switch on and off.
# Writes $OUT/window_bench.json (every RESULT line, with the commit) and $OUT/window_bench.md.
#   SHAPES="8x4096 1x32768"  WINDOWS="512 2048"  HEADS=16  HEAD_DIM=128  MODEL=lt2-gdn-1.3b  ITERS=5
#   LT2_COMMIT=<commit>  names the commit (the device copy's .git can be stale)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
SHAPES=${SHAPES:-8x4096 1x32768}
WINDOWS=${WINDOWS:-512 2048}
HEADS=${HEADS:-16}
HEAD_DIM=${HEAD_DIM:-128}
MODEL=${MODEL:-lt2-gdn-1.3b}
ITERS=${ITERS:-5}
ROOT=$PWD/.deps/root/usr
[ -d "$ROOT" ] && export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
M=build-gpu/bench/mixer_bench
build-gpu/tests/test_gpu --gtest_filter='WindowAttentionGpu.*' 2>&1 | grep -v '^\[ RUN' > "$OUT/window_tests.txt"
tail -15 "$OUT/window_tests.txt"
results=/tmp/window_bench_results.txt
: > "$results"
bench() {  # bench LABEL args...: one RESULT line, labelled
  local label=$1; shift
  "$M" --iters "$ITERS" "$@" 2>&1 | grep -E "RESULT|error" | sed "s/^RESULT /$label\t/" | tee -a "$results"
}
for shape in $SHAPES; do
  b=${shape%x*} t=${shape#*x}
  core=(--core --batch "$b" --seq "$t" --heads "$HEADS" --head-k "$HEAD_DIM")
  bench "causal SDPA" "${core[@]}" --mixer full
  for w in $WINDOWS; do
    bench "window $w flash" "${core[@]}" --mixer window --window "$w" --option window_flash=1
    bench "window $w mask" "${core[@]}" --mixer window --window "$w" --option window_flash=0
  done
  for w in $WINDOWS; do
    layer=(--model "$MODEL" --mixer window --mixer-option "window=$w" --batch "$b" --seq "$t")
    bench "layer window $w flash" "${layer[@]}" --option window_flash=1
    bench "layer window $w mask" "${layer[@]}" --option window_flash=0
  done
done
python3 - "$OUT" "$results" << 'PY'
import json, os, subprocess, sys, datetime
out, results = sys.argv[1], sys.argv[2]
rows = []
for line in open(results):
    if "\t" not in line:
        continue
    label, payload = line.rstrip("\n").split("\t", 1)
    r = json.loads(payload); r["label"] = label; rows.append(r)
commit = os.environ.get("LT2_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
tests = open(f"{out}/window_tests.txt").read()
json.dump({"commit": commit, "date": datetime.date.today().isoformat(), "tests": tests, "rows": rows},
          open(f"{out}/window_bench.json", "w"), indent=1)
lines = [f"# Sliding-window attention, commit {commit}\n", "```", tests.strip(), "```\n",
         "| what | batch | seq | forward ms | forward + backward ms | Mtokens/s fwd+bwd |", "|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['label']} | {r['batch']} | {r['seq']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | "
                 f"{r['tokens_per_s_fwd_bwd'] / 1e6:.2f} |")
open(f"{out}/window_bench.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
