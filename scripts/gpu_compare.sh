#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) from the repo root, after gpu_infer.sh built this tree
# (build-gpu/): the engine decode grid of this tree against a baseline tree in the same call, in
# alternating arms (base, new, base, new, ...), so a change of the code shows against the
# machine's drift. The baseline is a source tree carried as an ignored folder, e.g.
#   git archive <commit> CMakeLists.txt src apps tests bench configs scripts | tar -x -C .baseline
# and is built here (lt2_cli only). Writes $OUT/decode_compare.{json,md}: per cell, each arm's
# ms/step, and new/base as the ratio of the arms' medians; each arm's own JSON is $OUT/compare_arm<i>.json.
#   BASE=.baseline  BASE_COMMIT / NEW_COMMIT=<names for the record>  ARMS="base new base new"
#   MODELS=...  CONTEXTS=4k,32k  BATCHES=1,8  STEPS=10
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
BASE=${BASE:-.baseline}
ROOT=$PWD/.deps/root/usr
export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
MODELS=${MODELS:-lt-1.3b,lt2-gdn-1.3b,lt2-full-gdn-1.3b,lt2-gdn-dsa-1.3b,ouro-1.4b}
NEW=build-gpu/apps/lt2/lt2
OLD=$BASE/build-gpu/apps/lt2/lt2
[ -x "$NEW" ] || { echo "gpu_compare: $NEW is missing: run scripts/gpu_infer.sh first"; exit 1; }
if [ ! -x "$OLD" ]; then
  t0=$(date +%s)
  (cd "$BASE" && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=OFF -DLT2_TESTS=OFF -DLT2_BENCH=OFF \
     -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > /tmp/base_build.log 2>&1 &&
   cmake --build build-gpu -j "$(nproc)" --target lt2_cli >> /tmp/base_build.log 2>&1) ||
    { grep -E "error" -A5 /tmp/base_build.log | head -40; exit 1; }
  echo "baseline build: $(( $(date +%s) - t0 )) s"
fi
i=0
for arm in ${ARMS:-base new base new}; do
  i=$((i + 1))
  bin=$NEW; [ "$arm" = base ] && bin=$OLD
  "$bin" bench decode -m "$MODELS" -c "${CONTEXTS:-4k,32k}" -b "${BATCHES:-1,8}" --paths engine \
    --steps "${STEPS:-10}" --warmup 2 --out-json "$OUT/compare_arm$i.json" 2> "/tmp/compare_$i.err" > /dev/null ||
    tail -5 "/tmp/compare_$i.err"
  echo "arm $i ($arm) done"
done
python3 - "$OUT" "${BASE_COMMIT:-base}" "${NEW_COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo new)}" ${ARMS:-base new base new} << 'PY'
import json, statistics, sys
out, base_name, new_name, arms = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
runs = [json.load(open(f"{out}/compare_arm{i}.json")) for i in range(1, len(arms) + 1)]
cells = {}
for arm, run in zip(arms, runs):
    for c in run["cells"]:
        key = (c["model"], c["context"], c["batch"])
        cells.setdefault(key, {"base": [], "new": []})[arm].append(None if c.get("oom") else c["ms"])
rows = []
for (model, ctx, batch), arm in cells.items():
    b = [x for x in arm["base"] if x is not None]
    n = [x for x in arm["new"] if x is not None]
    ratio = statistics.median(n) / statistics.median(b) if b and n else None
    rows.append({"model": model, "context": ctx, "batch": batch, "base_ms": arm["base"], "new_ms": arm["new"],
                 "new_over_base": ratio})
record = {"what": "engine decode, this tree against a baseline tree, alternating arms in one call",
          "base": base_name, "new": new_name, "arms": arms, "date": runs[0].get("date"),
          "device": runs[0].get("device"), "copy_bandwidth_gbs": [r.get("copy_bandwidth_gbs") for r in runs],
          "command": runs[-1].get("command"), "cells": rows}
json.dump(record, open(f"{out}/decode_compare.json", "w"), indent=1)
fmt = lambda xs: " / ".join("OOM" if x is None else f"{x:.2f}" for x in xs)
lines = [f"Engine decode, {base_name} (base) against {new_name} (new), arms {' '.join(arms)}, on {record['device']}, "
         f"{record['date']}", "", "| model | context | batch | base ms/step | new ms/step | new / base |",
         "| --- | ---: | ---: | ---: | ---: | ---: |"]
for r in rows:
    ratio = "" if r["new_over_base"] is None else f"{r['new_over_base']:.3f}"
    lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {fmt(r['base_ms'])} | {fmt(r['new_ms'])} | {ratio} |")
open(f"{out}/decode_compare.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
