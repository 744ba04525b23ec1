#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) after a build in build-gpu with mixer_bench (scripts/gpu_infer.sh,
# BUILD_TARGETS including mixer_bench): the layer table of issue 24. One mixer layer, forward and
# forward + backward under bf16 autocast, at MODEL's shape for each of MIXERS at each of SHAPES; then
# flash-linear-attention's layers for FLA_MIXERS at the same dims in the same call (.deps/py carried,
# scripts/gpu_deps.sh). Each run has a time limit (RUN_S); one that fails or runs out says so in its
# row. Writes $OUT/mixer_layers.json (every row, with the commit) and $OUT/mixer_layers.md.
#   MIXERS="full window gdn kda deltanet mamba2 gla retnet hgrn2 linear dsa nsa"
#   SHAPES="8x4096 1x32768"  MODEL=lt2-gdn-1.3b  ITERS=5  RUN_S=120
#   OPTIONS="--option window_flash=1"   kernel switches for every lt2 run (docs/decode.md)
#   FLA_MIXERS="gla retnet hgrn2 linear gdn"   empty: no peer. Their parameter counts equal lt2's at
#                        d 2048 (checked on the CPU). fla_peer builds KDA and DeltaNet at GDN's head
#                        dims (96 / 192), not at lt2's defaults for them (d / H): those two are compared
#                        at GDN's dims by the delta-rule benchmarks. Triton autotunes each new shape on
#                        first use (over a minute a shape): budget the call for it.
#   LT2_COMMIT=<commit>  names the commit (the device copy's .git can be stale)
#   M=path/to/mixer_bench  (default build-gpu/bench/mixer_bench; a CPU build runs a smoke test:
#   M=build/bench/mixer_bench MODEL=tiny-full-gdn SHAPES=2x64 FLA_MIXERS= scripts/gpu_mixer_table.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MIXERS=${MIXERS:-full window gdn kda deltanet mamba2 gla retnet hgrn2 linear dsa nsa}
SHAPES=${SHAPES:-8x4096 1x32768}
MODEL=${MODEL:-lt2-gdn-1.3b}
ITERS=${ITERS:-5}
RUN_S=${RUN_S:-120}
OPTIONS=${OPTIONS:-}
FLA_MIXERS=${FLA_MIXERS-gla retnet hgrn2 linear gdn}
ROOT=$PWD/.deps/root/usr
[ -d "$ROOT" ] && export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
M=${M:-build-gpu/bench/mixer_bench}
rows=/tmp/mixer_table_rows.txt
: > "$rows"
for shape in $SHAPES; do
  b=${shape%x*} t=${shape#*x}
  for mixer in $MIXERS; do
    echo "== lt2 $mixer $shape"
    # shellcheck disable=SC2086
    line=$(timeout "$RUN_S" "$M" --model "$MODEL" --mixer "$mixer" --batch "$b" --seq "$t" --iters "$ITERS" $OPTIONS 2>&1 |
           grep -E "^RESULT|mixer_bench:|error" | tail -1)
    printf 'lt2\t%s\t%s\t%s\t%s\n' "$mixer" "$b" "$t" "${line:-no result within $RUN_S s}" | tee -a "$rows"
  done
done
if [ -n "$FLA_MIXERS" ]; then
  echo "== fla layers: $FLA_MIXERS"
  # One process for every peer row: Triton's autotuning of a shape is paid once.
  PYTHONPATH=$PWD/.deps/py timeout $(( RUN_S * 4 )) python3 bench/fla_peer.py --what layer \
    --mixer "$(echo $FLA_MIXERS | tr ' ' ,)" --shape "$(echo $SHAPES | tr ' ' ,)" --iters "$ITERS" 2>&1 |
    grep -E "^RESULT|Error" | sed "s/^/fla\t-\t-\t-\t/" | tee -a "$rows"
fi
python3 - "$OUT" "$rows" "$MODEL" << 'PY'
import datetime, json, os, subprocess, sys
out, rows_path, model = sys.argv[1], sys.argv[2], sys.argv[3]
rows = []
for line in open(rows_path):  # who, mixer, batch, seq, then mixer_bench's or fla_peer's output line
    who, mixer, batch, seq, text = line.rstrip("\n").split("\t", 4)
    if text.startswith("RESULT "):
        r = json.loads(text[len("RESULT "):])
    elif who == "lt2":
        r = {"mixer": mixer, "batch": int(batch), "seq": int(seq), "failed": text}
    else:
        print("fla:", text); continue
    r["who"] = who; rows.append(r)
commit = os.environ.get("LT2_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
json.dump({"commit": commit, "date": datetime.date.today().isoformat(), "model": model, "rows": rows},
          open(f"{out}/mixer_layers.json", "w"), indent=1)
fla = {(r["mixer"], r["batch"], r["seq"]): r for r in rows if r["who"] == "fla"}
lines = [f"# One mixer layer at {model}'s shape, commit {commit}\n",
         "| mixer | batch x seq | lt2 params | lt2 fwd ms | lt2 fwd+bwd ms | fla fwd ms | fla fwd+bwd ms | fwd+bwd lt2 / fla |",
         "|---|---|---|---|---|---|---|---|"]
for r in rows:
    if r["who"] != "lt2":
        continue
    shape = f"{r['batch']} x {r['seq']}"
    if "failed" in r:
        lines.append(f"| {r['mixer']} | {shape} | | {r['failed']} | | | | |")
        continue
    p = fla.get((r["mixer"], r["batch"], r["seq"]))
    peer = (f"{p['forward_ms']:.2f} | {p['forward_backward_ms']:.2f} | {r['forward_backward_ms'] / p['forward_backward_ms']:.2f}"
            if p else " | | ")
    lines.append(f"| {r['mixer']} | {shape} | {r.get('params', 0) / 1e6:.1f}M | {r['forward_ms']:.2f} | "
                 f"{r['forward_backward_ms']:.2f} | {peer} |")
if fla:
    params = {m: r["params"] for (m, b, s), r in fla.items() if r.get("params")}
    lines.append("\nfla's layers at the same dims (bench/fla_peer.py; parameters: "
                 + ", ".join(f"{m} {n / 1e6:.1f}M" for m, n in params.items()) + ").")
open(f"{out}/mixer_layers.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
