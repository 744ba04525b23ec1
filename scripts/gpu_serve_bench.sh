#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) from the repo root with `.deps` carried: `lt2 serve` under
# bench/serve_load.py, and `lt2 bench decode` at batch 64 in the same call, for the served-vs-engine
# comparison of issue 26. Writes $OUT/serve_<model>.{md,json} (one row per load cell) and
# $OUT/serve_decode.json (the bench's figure).
#   MODELS=lt2-gdn-1.3b[,lt2-gdn-dsa-1.3b,lt-1.3b]   random weights, the byte-level tokenizer
#   PROMPTS="1024 8192"  OUTPUT=256  CONCURRENCY="1 8 64"   the grid (requests per cell: max(2 x concurrency, 8))
#   SHARED="0 0.9"      shared-prefix fractions; 0.9 runs with the prefix cache on and off
#   STEADY="64 7168 1024"  the headline cell: concurrency, prompt, output (8k context): output tok/s
#                        while all streams decode, against `lt2 bench decode -b 64 -c 8k`; "off" skips it
#   SKIP_CELLS="8192x64"  grid cells (PROMPTxCONCURRENCY) not run, e.g. the one the steady cell covers
#   DECODE_BATCHES=64   the batches of `lt2 bench decode` (comma-separated; the frontier of a model whose
#                       state outgrows the device, e.g. "8,16,32,64" for lt-1.3b)
#   When --max-batch rows do not fit, `lt2 serve` decodes fewer together (it says so at start; the
#   table quotes it) and the rest queue.
#   PREFILL_CHUNK=2048  CACHE_GB=16  PREBUILT=build-prebuilt (carried binaries, as scripts/gpu_infer.sh)
#   LT2_COMMIT=<commit>  names the commit in the JSON (the device copy's .git can be stale)
#   Runs anywhere for a smoke test: DEVICE=cpu MODELS=tiny-full-gdn PROMPTS=64 OUTPUT=8 CONCURRENCY="1 4"
#   STEADY="4 64 32" DECODE_CONTEXT=1k scripts/gpu_serve_bench.sh   (L=path/to/lt2 to skip the build)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MODELS=${MODELS:-lt2-gdn-1.3b}
PROMPTS=${PROMPTS:-1024 8192}
OUTPUT=${OUTPUT:-256}
CONCURRENCY=${CONCURRENCY:-1 8 64}
SHARED=${SHARED:-0 0.9}
STEADY=${STEADY:-64 7168 1024}
PREFILL_CHUNK=${PREFILL_CHUNK:-2048}
CACHE_GB=${CACHE_GB:-16}
DEVICE=${DEVICE:-auto}
DECODE_CONTEXT=${DECODE_CONTEXT:-8k}
SKIP_CELLS=${SKIP_CELLS:-}
if [ "$STEADY" = off ]; then STEADY="0 0 0"; fi
ROOT=$PWD/.deps/root/usr
if [ -d "$ROOT" ]; then
  export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
  export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
if [ -z "${L:-}" ]; then
  if [ -n "${PREBUILT:-}" ]; then
    export LD_LIBRARY_PATH="$PWD/$PREBUILT:$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH"
    L=$PREBUILT/lt2
  else
    B=build-gpu
    cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_PREFIX_PATH:+-DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH"} \
      > /tmp/lt2_build.log 2>&1 && cmake --build $B -j "$(nproc)" --target lt2_cli >> /tmp/lt2_build.log 2>&1 ||
      { grep -E "error|Error" -A5 /tmp/lt2_build.log | head -60 | tee "$OUT/build_errors.txt"; exit 1; }
    L=$B/apps/lt2/lt2
  fi
fi
"$L" --version > /dev/null || { echo "cannot run $L"; exit 1; }
read -r STEADY_C STEADY_P STEADY_O <<< "$STEADY"
max_prompt=$STEADY_P
for p in $PROMPTS; do [ "$p" -gt "$max_prompt" ] && max_prompt=$p; done
max_out=$(( OUTPUT > STEADY_O ? OUTPUT : STEADY_O ))
CONTEXT=$(( max_prompt + max_out ))
max_c=$STEADY_C
for c in $CONCURRENCY; do [ "$c" -gt "$max_c" ] && max_c=$c; done
DECODE_BATCHES=${DECODE_BATCHES:-$max_c}

server_pid=
stop_server() {
  if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid" 2> /dev/null
    for _ in $(seq 1 600); do kill -0 "$server_pid" 2> /dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2> /dev/null
    wait "$server_pid" 2> /dev/null
    server_pid=
  fi
}
trap stop_server EXIT
# start_server MODEL CACHE_GB: sets $port
start_server() {
  local log=/tmp/lt2_serve_$1_$2.log
  "$L" serve "$1" --tokenizer bytes --device "$DEVICE" --port 0 --max-batch "$max_c" --max-context "$CONTEXT" \
    --prefill-chunk "$PREFILL_CHUNK" --prefix-cache-gb "$2" --timeout 3600 --quiet > "$log" 2>&1 &
  server_pid=$!
  port=
  for _ in $(seq 1 3000); do  # model build and CUDA-graph capture: up to 300 s
    port=$(grep -oE "listening on http://127\.0\.0\.1:[0-9]+" "$log" | grep -oE "[0-9]+$")
    [ -n "$port" ] && return 0
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 0.1
  done
  echo "lt2 serve did not start:"; tail -20 "$log"; return 1
}
load() {  # load MODEL OUT_JSON args...
  local model=$1 json=$2; shift 2
  python3 bench/serve_load.py --port "$port" --model "$model" --vocab 256 --seed 0 --out-json "$json" "$@"
}

# report: the model's table and JSON from the cells so far (after every cell, so that a call cut
# short by its time limit still returns what it measured)
report() {
  python3 - "$OUT" "$model" "$DECODE_CONTEXT" "$STEADY_C" "${cells[@]}" << 'EOF'
import json, os, sys, subprocess
out, model, ctx, batch, cells = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
dec = json.load(open(f"{out}/serve_decode_{model}.json"))
rows = dec["cells"] if isinstance(dec, dict) else dec
if batch == 0:  # no steady cell: quote the bench's largest batch
    batch = max(r["batch"] for r in rows)
bench_cell = next((r for r in rows if r.get("batch") == batch and r.get("path", "engine") == "engine"), None)
bench = bench_cell["tokens_per_s"] if bench_cell and not bench_cell.get("oom") else None
records, lines = [], []
lines.append(f"# lt2 serve, {model} (random weights)\n")
if bench_cell and bench_cell.get("oom"):
    lines.append(f"`lt2 bench decode` batch {batch} at {ctx}: OOM (plan {bench_cell.get('planned_gb', 0):.1f} GB, same call).\n")
else:
    lines.append(f"`lt2 bench decode` batch {batch} at {ctx}: {bench} tok/s (same call).\n")
decode_rows = [r for r in rows if r.get("path", "engine") == "engine"]
if len(decode_rows) > 1 or any(r.get("oom") for r in decode_rows):
    lines.append("| bench decode batch | tok/s | planned GB |\n|---|---|---|")
    lines += [f"| {r['batch']} | {'OOM' if r.get('oom') else format(r['tokens_per_s'], '.1f')} | {r.get('planned_gb', 0):.1f} |"
              for r in decode_rows]
    lines.append("")
cap = open(f"/tmp/serve_cap_{model}.txt").read().strip()
if cap:
    lines.append("`lt2 serve` at start: " + cap.replace("\n", "; ") + "\n")
lines.append("| cache GB | shared | prompt | output | concurrency | ok | output tok/s | all-decoding tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
lines.append("|---|---|---|---|---|---|---|---|---|---|")
def all_decoding(rate):  # NaN: no moment when every request of the cell was decoding
    return "—" if rate != rate else f"{rate:.1f}"
for cell in cells:
    path, cache = cell.rsplit(":", 1)
    s = json.load(open(path)); s["cache"] = cache; records.append(s)
    lines.append(f"| {cache} | {s['shared_prefix']:.0%} | {s['prompt_len']} | {s['output_len']} | {s['concurrency']} | "
                 f"{s['ok']}/{s['requests']} | {s['output_tokens_per_s']:.1f} | {all_decoding(s['steady_output_tokens_per_s'])} | "
                 f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['itl_p50_ms']:.2f} / {s['itl_p99_ms']:.2f} |")
lines.append("\n—: no moment when every request of the cell was decoding (more requests than streams, or fewer "
             "decode rows fit than streams).")
steady = next((r for r in records if r["cache"] == "steady"), None)
if steady and bench and not cap:
    lines.append(f"\nServed / bench at {batch} streams: {steady['steady_output_tokens_per_s'] / bench:.1%} "
                 f"(issue 26 asks >= 80%).")
commit = os.environ.get("LT2_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"model": model, "commit": commit, "bench_decode_tokens_per_s": bench, "serve_start": cap, "cells": records},
          open(f"{out}/serve_{model}.json", "w"), indent=1)
open(f"{out}/serve_{model}.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

for model in ${MODELS//,/ }; do
  echo "== $model: lt2 bench decode -b $DECODE_BATCHES -c $DECODE_CONTEXT"
  if [ "$DEVICE" = cpu ]; then bench_dev="--device cpu --dtype fp32"; else bench_dev="--device cuda"; fi
  # shellcheck disable=SC2086
  "$L" bench decode -m "$model" -c "$DECODE_CONTEXT" -b "$DECODE_BATCHES" --paths engine $bench_dev \
    --out-json "$OUT/serve_decode_$model.json" 2>&1 | grep -E "^\| |error"
  : > "/tmp/serve_cap_$model.txt"
  cells=()
  for cache in "$CACHE_GB" 0; do
    start_server "$model" "$cache" || continue
    grep -h "do not fit" "/tmp/lt2_serve_${model}_${cache}.log" | sed "s/^/cache $cache GB: /" | tee -a "/tmp/serve_cap_$model.txt"
    load "$model" /tmp/warm.json --requests 2 --concurrency 1 --prompt-len 64 --output-len 4 > /dev/null
    for shared in $SHARED; do
      # Without the cache only the shared-prefix cells (the comparison); with it, the whole grid.
      if [ "$cache" = 0 ] && [ "$shared" = 0 ]; then continue; fi
      for p in $PROMPTS; do
        for c in $CONCURRENCY; do
          if [[ " $SKIP_CELLS " == *" ${p}x${c} "* ]]; then continue; fi
          n=$(( 2 * c > 8 ? 2 * c : 8 ))
          j=/tmp/serve_${model}_${cache}_${shared}_${p}_${c}.json
          echo -n "cache ${cache} GB: "
          rm -f "$j"
          load "$model" "$j" --requests "$n" --concurrency "$c" --prompt-len "$p" --output-len "$OUTPUT" \
            --shared-prefix "$shared"
          [ -f "$j" ] && cells+=("$j:$cache") && report > /dev/null
        done
      done
    done
    if [ "$cache" != 0 ] && [ "$STEADY_C" -gt 0 ]; then
      j=/tmp/serve_${model}_steady.json
      echo -n "steady: "
      rm -f "$j"
      load "$model" "$j" --requests "$STEADY_C" --concurrency "$STEADY_C" --prompt-len "$STEADY_P" --output-len "$STEADY_O"
      [ -f "$j" ] && cells+=("$j:steady") && report > /dev/null
    fi
    stop_server
  done
  report
done
