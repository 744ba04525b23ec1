#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) after a build in build-gpu with train_bench (scripts/gpu_infer.sh,
# BUILD_TARGETS including train_bench): issue 24's training table. lt2 train's loop (bench/train_bench, random
# tokens, bf16 autocast) on MODEL (lt-100m) with its layer pattern replaced by each row's: every mixer
# family and the LT2 paper's hybrids, at each of SHAPES (seq x batch, the same tokens a step), tokens/s
# and MFU, and each row's tokens/s over the full-attention row's at that shape; with CHECKPOINT=auto,
# what the policy measured (a step's need storing activations, and the free memory) beside its
# choice. Every run has a time limit (RUN_S); one that fails or runs out says so in its row. The
# table and JSON are rewritten after every run, so a call cut short keeps what finished.
#   ROWS="full gdn ..."    row names of the list below (default: all)
#   SHAPES="2048x16 8192x4"  STEPS=10 WARM=4 RUN_S=90  CHECKPOINT=auto (on | off: per-loop checkpointing)
#   LT2_COMMIT=<commit>    names the commit (the device copy's .git can be stale)
#   T=path/to/train_bench  (default build-gpu/bench/train_bench; a CPU build runs a smoke test:
#   T=build/bench/train_bench MODEL=tiny-full SHAPES=64x2 STEPS=3 WARM=1 DEVICE=cpu scripts/gpu_train_table.sh)
# Writes $OUT/train_table.json and $OUT/train_table.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MODEL=${MODEL:-lt-100m}
SHAPES=${SHAPES:-2048x16 8192x4}
STEPS=${STEPS:-10}
WARM=${WARM:-4}
RUN_S=${RUN_S:-90}
CHECKPOINT=${CHECKPOINT:-auto}
DEVICE=${DEVICE:-cuda}
T=${T:-build-gpu/bench/train_bench}
ROOT=$PWD/.deps/root/usr
[ -d "$ROOT" ] && export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"

# name | layer pattern | mixer options (JSON). GDN at the LT2 presets' 6 heads (key head dim 96 at d 768).
TABLE='full|full|{}
gdn|gdn|{"gdn":{"num_heads":6}}
kda|kda|{}
deltanet|deltanet|{}
mamba2|mamba2|{}
gla|gla|{}
retnet|retnet|{}
hgrn2|hgrn2|{}
linear|linear|{}
window|window|{"window":{"window":512}}
dsa|dsa|{}
nsa|nsa|{}
gdn+full|interleaved:4:1:gdn:full|{"gdn":{"num_heads":6}}
gdn+dsa|interleaved:4:1:gdn:dsa|{"gdn":{"num_heads":6}}
gdn+window|interleaved:4:1:gdn:window|{"gdn":{"num_heads":6},"window":{"window":512}}
gdn+nsa|interleaved:4:1:gdn:nsa|{"gdn":{"num_heads":6}}
window+full|interleaved:4:1:window:full|{"window":{"window":512}}'
ROWS=${ROWS:-$(echo "$TABLE" | cut -d'|' -f1 | tr '\n' ' ')}
lines=$OUT/train_table_rows.txt
: > "$lines"

write_table() {
  python3 - "$OUT" "$lines" "$MODEL" "$SHAPES" << 'PY'
import datetime, json, os, subprocess, sys
out, lines_path, model, shapes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
rows = []
for line in open(lines_path):  # name, pattern, seq, batch, then train_bench's last line
    name, pattern, seq, batch, text = line.rstrip("\n").split("\t", 4)
    r = json.loads(text[len("RESULT "):]) if text.startswith("RESULT ") else {"failed": text}
    r.update(name=name, pattern=pattern, seq=int(seq), batch=int(batch))
    rows.append(r)
commit = os.environ.get("LT2_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
json.dump({"commit": commit, "date": datetime.date.today().isoformat(), "model": model, "rows": rows},
          open(f"{out}/train_table.json", "w"), indent=1)
full = {(r["seq"], r["batch"]): r["tokens_per_s"] for r in rows if r["name"] == "full" and "tokens_per_s" in r}


def checkpointed(r):  # the policy's choice, and with `auto` what it measured
    said = "yes" if r["checkpoint_loops"] else "no"
    need = r.get("checkpoint_need")
    if need:
        stored = need["stored_bytes"]  # null: storing every loop ran out of memory in its measurement
        stored = "more than free" if stored is None else f"{stored / 1e9:.1f} GB"
        said += f" ({stored} stored, {need['available_bytes'] / 1e9:.0f} free)"
    return said


md = [f"# Training throughput by mixer: {model}'s shape with each layer pattern, commit {commit}\n",
      "bench/train_bench (lt2 train's loop, random tokens); ratio = tokens/s over the full-attention row's "
      "at the same shape.\n"]
for shape in shapes:
    seq, batch = (int(x) for x in shape.split("x"))
    md += [f"\n## seq {seq} x batch {batch}\n",
           "| row | pattern | parameters | step ms | tokens/s | MFU | / full | checkpointed loops |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if (r["seq"], r["batch"]) != (seq, batch):
            continue
        if "failed" in r:
            md.append(f"| {r['name']} | `{r['pattern']}` | | {r['failed']} | | | | |")
            continue
        base = full.get((seq, batch))
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else ""
        md.append(f"| {r['name']} | `{r['pattern']}` | {r['parameters'] / 1e6:.1f}M | {r['median_step_ms']:.0f} | "
                  f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {ratio} | {checkpointed(r)} |")
open(f"{out}/train_table.md", "w").write("\n".join(md) + "\n")
PY
}

for shape in $SHAPES; do
  seq=${shape%x*} batch=${shape#*x}
  for name in $ROWS; do
    entry=$(echo "$TABLE" | grep "^$name|" || true)
    [ -z "$entry" ] && { echo "unknown row '$name'"; continue; }
    pattern=$(echo "$entry" | cut -d'|' -f2) options=$(echo "$entry" | cut -d'|' -f3)
    echo "== $name ($pattern) seq $seq x $batch"
    line=$(timeout "$RUN_S" "$T" --model "$MODEL" --pattern "$pattern" --mixer-options "$options" \
             --seq-len "$seq" --batch-size "$batch" --steps "$STEPS" --warm "$WARM" --device "$DEVICE" \
             --checkpoint-loops="$CHECKPOINT" --out "/tmp/lt2_train_table" 2>&1 |
           grep -E "^RESULT|^train_bench:" | head -1)
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$pattern" "$seq" "$batch" "${line:-no result within $RUN_S s}" |
      tee -a "$lines"
    write_table
  done
done
cat "$OUT/train_table.md"
