#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool), as a step of scripts/gpu_batch.sh (which unpacks this tree's
# build-prebuilt/): `lt2 bench prefill` of this tree's binary against a baseline's in the same call, in
# alternating arms (the machine drifts between runs), then a per-kernel profile of the new binary. The
# baseline is another tarball of scripts/prebuild_gpu.sh, built at the baseline commit and renamed, carried
# in .deps.
#   BASE_TARBALL=.deps/build-<commit>.tar.xz (required)  NEW_TARBALL=... (optional; default build-prebuilt/)
#   MODEL=lt2-gdn-1.3b  CONTEXTS=820,8192,32768  ARMS="base new base new"  PROFILE_CONTEXTS=820,8192 (empty: none)
#   BENCH_ARGS="..."  more `lt2 bench prefill` flags for every arm (a CPU smoke test, with the libraries on
#   LD_LIBRARY_PATH as gpu_batch.sh sets them: MODEL=lt2-gdn-100m CONTEXTS=64 PROFILE_CONTEXTS=
#   BENCH_ARGS="--device cpu --dtype fp32" BASE_TARBALL=... scripts/gpu_prefill_ab.sh)
# Writes $OUT/prefill_ab.json (every arm's cells, and per context each arm's median ms and new/base) and
# $OUT/prefill_ab.md; with a profile, $OUT/prefill_profile.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MODEL=${MODEL:-lt2-gdn-1.3b}
CONTEXTS=${CONTEXTS:-820,8192,32768}
ARMS=${ARMS:-base new base new}
PROFILE_CONTEXTS=${PROFILE_CONTEXTS-820,8192}
BASE_DIR=/tmp/prefill_ab_base
source scripts/ab_binaries.sh
ab_binaries gpu_prefill_ab lt2 "$BASE_DIR"
i=0
for arm in $ARMS; do
  bin=$NEW
  [ "$arm" = base ] && bin=$BASE
  "$bin" bench prefill -m "$MODEL" -c "$CONTEXTS" ${BENCH_ARGS:-} --out-json "/tmp/prefill_ab_$i.json"
  i=$((i + 1))
done
base_commit=$(cat "$BASE_DIR/build-prebuilt/COMMIT")
new_commit=$(cat "$NEW_BUILD/COMMIT")
python3 - "$OUT" "$base_commit" "$new_commit" $ARMS <<'PY'
import json, statistics, sys
out, base_commit, new_commit, arms = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
runs = [json.load(open(f"/tmp/prefill_ab_{i}.json")) for i in range(len(arms))]
cells = [dict(c, arm=arm, run=i) for i, (arm, r) in enumerate(zip(arms, runs)) for c in r["cells"]]
contexts = sorted({c["context"] for c in cells})
summary = []
for ctx in contexts:
    ms = {a: statistics.median(c["ms"] for c in cells if c["context"] == ctx and c["arm"] == a) for a in ("base", "new")}
    each = {a: [round(c["ms"], 1) for c in cells if c["context"] == ctx and c["arm"] == a] for a in ("base", "new")}
    summary.append({"context": ctx, "base_ms": ms["base"], "new_ms": ms["new"], "new_over_base": ms["new"] / ms["base"],
                    "base_tokens_per_s": ctx / ms["base"] * 1e3, "new_tokens_per_s": ctx / ms["new"] * 1e3,
                    "base_arms_ms": each["base"], "new_arms_ms": each["new"],
                    "new_over_base_best": min(each["new"]) / min(each["base"])})
rec = {"model": runs[0]["cells"][0]["model"], "base": base_commit, "new": new_commit, "arms": arms,
       "device": runs[0]["device"], "date": runs[0]["date"], "summary": summary, "cells": cells}
json.dump(rec, open(f"{out}/prefill_ab.json", "w"), indent=1)
lines = [f"`lt2 bench prefill -m {rec['model']}`, batch 1, arms {' '.join(arms)} (medians per arm): "
         f"base {base_commit}, new {new_commit}, {rec['date']}", "",
         "| context | base ms | new ms | base tok/s | new tok/s | new / base time | each arm, base; new (ms) | best new / best base |",
         "|---:|---:|---:|---:|---:|---:|---|---:|"]
lines += [f"| {s['context']} | {s['base_ms']:.1f} | {s['new_ms']:.1f} | {s['base_tokens_per_s']:.0f} | "
          f"{s['new_tokens_per_s']:.0f} | {s['new_over_base']:.3f} | {', '.join(map(str, s['base_arms_ms']))}; "
          f"{', '.join(map(str, s['new_arms_ms']))} | {s['new_over_base_best']:.3f} |" for s in summary]
open(f"{out}/prefill_ab.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
if [ -n "$PROFILE_CONTEXTS" ]; then
  "$NEW" bench prefill -m "$MODEL" -c "$PROFILE_CONTEXTS" ${BENCH_ARGS:-} --profile 2 --profile-md "$OUT/prefill_profile.md" > /dev/null
  grep -A12 "^### " "$OUT/prefill_profile.md" | head -40
fi
