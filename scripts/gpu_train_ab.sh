#!/usr/bin/env bash
# Runs ON THE GPU MACHINE inside scripts/gpu_batch.sh (which unpacks the new binaries to build-prebuilt/):
# an A/B of whole training steps, `train_bench` of a baseline build against build-prebuilt, arms
# alternating in one call, per-loop activation checkpointing (the issue's setting).
#   BASE_TARBALL=.deps/build-<commit>.tar.xz (required; scripts/prebuild_gpu.sh with BENCH=train_bench)
#   NEW_TARBALL=.deps/build-<commit>.tar.xz (optional: the new arm; default build-prebuilt/)
#   MODELS="lt-100m lt2-gdn-100m"  SHAPES="2048x16 8192x4" (seq x batch)  ARMS="base new base new"  STEPS=6
#   BASE_DIR=/tmp/train_ab_base (where the baseline is unpacked; later steps of a call may use it)
# Writes $OUT/train_ab.json (every RESULT line with its arm) and $OUT/train_ab.md (medians per arm).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MODELS=${MODELS:-lt-100m lt2-gdn-100m}
SHAPES=${SHAPES:-2048x16 8192x4}
ARMS=${ARMS:-base new base new}
STEPS=${STEPS:-6}
BASE_DIR=${BASE_DIR:-/tmp/train_ab_base}
source scripts/ab_binaries.sh
ab_binaries gpu_train_ab train_bench "$BASE_DIR"
LINES=/tmp/train_ab_lines.jsonl
: > "$LINES"
for model in $MODELS; do
  for shape in $SHAPES; do
    seq=${shape%x*} batch=${shape#*x}
    for arm in $ARMS; do
      bin=$NEW
      [ "$arm" = base ] && bin=$BASE
      echo "== $arm $model seq $seq x $batch"
      "$bin" --model "$model" --seq-len "$seq" --batch-size "$batch" --steps "$STEPS" --warm 2 --checkpoint-loops |
        grep '^RESULT ' | sed 's/^RESULT //' | python3 -c "import json, sys; [print(json.dumps(dict(json.loads(l), arm='$arm'))) for l in sys.stdin]" >> "$LINES"
    done
  done
done
python3 - "$OUT" "$(cat "$BASE_DIR/build-prebuilt/COMMIT")" "$(cat "$NEW_BUILD/COMMIT")" "$LINES" <<'PY'
import json, statistics, sys
out, base, new, lines = sys.argv[1:5]
rows = [json.loads(l) for l in open(lines)]
keys = sorted({(r["model"], r["seq_len"], r["batch_size"]) for r in rows}, key=lambda k: (k[0], k[1]))
summary = []
for model, seq, batch in keys:
    arm = {a: [r for r in rows if (r["model"], r["seq_len"], r["batch_size"], r["arm"]) == (model, seq, batch, a)]
           for a in ("base", "new")}
    if not arm["base"] or not arm["new"]:
        continue
    tps = {a: statistics.median(r["tokens_per_s"] for r in arm[a]) for a in arm}
    mfu = {a: statistics.median(r["mfu"] for r in arm[a]) for a in arm}
    summary.append({"model": model, "seq_len": seq, "batch_size": batch, "base_tokens_per_s": tps["base"],
                    "new_tokens_per_s": tps["new"], "new_over_base": tps["new"] / tps["base"],
                    "base_mfu": mfu["base"], "new_mfu": mfu["new"],
                    "each_arm_tokens_per_s": {a: [round(r["tokens_per_s"]) for r in arm[a]] for a in arm}})
device = rows[0]["device"] if rows else ""
json.dump({"base": base, "new": new, "device": device, "summary": summary, "rows": rows},
          open(f"{out}/train_ab.json", "w"), indent=1)
md = [f"`train_bench --checkpoint-loops` A/B on {device}: base {base}, new {new} (medians per arm)", "",
      "| model | seq x batch | base tok/s | new tok/s | new / base | base MFU | new MFU | each arm, base; new |",
      "|---|---|---:|---:|---:|---:|---:|---|"]
md += [f"| {s['model']} | {s['seq_len']} x {s['batch_size']} | {s['base_tokens_per_s']:.0f} | {s['new_tokens_per_s']:.0f} | "
       f"{s['new_over_base']:.3f} | {100 * s['base_mfu']:.1f}% | {100 * s['new_mfu']:.1f}% | "
       f"{', '.join(map(str, s['each_arm_tokens_per_s']['base']))}; {', '.join(map(str, s['each_arm_tokens_per_s']['new']))} |"
       for s in summary]
open(f"{out}/train_ab.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
