#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) after a build in build-gpu (scripts/gpu_infer.sh with
# BUILD_TARGETS including lt2_cli and mixer_bench): the A/B of the kernels of a linear mixer layer
# (issues 23, 24). One MIXER layer forward and forward + backward at MODEL's shape, BATCH x SEQ, with
# every kernel on, each of SWITCHES off, all of them off, then a per-kernel profile with all on;
# `lt2 bench prefill` of MODEL at PREFILL_CONTEXTS with all on and all off (PREFILL_CONTEXTS="": none).
# Writes $OUT/layer_ab.txt (the RESULT lines and the profile) and $OUT/prefill_ab.json.
#   SWITCHES="short_conv=0 row_norm=0"   decode options (`lt2 bench decode --help`) to switch off
#   MIXER=gdn  MODEL=lt2-gdn-1.3b  BATCH=8  SEQ=4096  PREFILL_CONTEXTS=4k,32k  ITERS=5
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MIXER=${MIXER:-gdn}
MODEL=${MODEL:-lt2-gdn-1.3b}
BATCH=${BATCH:-8}
SEQ=${SEQ:-4096}
PREFILL_CONTEXTS=${PREFILL_CONTEXTS-4k,32k}
ITERS=${ITERS:-5}
SWITCHES=${SWITCHES:-short_conv=0 row_norm=0}
ROOT=$PWD/.deps/root/usr
[ -d "$ROOT" ] && export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
L=build-gpu/apps/lt2/lt2
M=build-gpu/bench/mixer_bench
all_off=() prefill_off=()
for sw in $SWITCHES; do all_off+=(--option "$sw"); prefill_off+=(--decode-option "$sw"); done
{
  echo "# $M --model $MODEL --mixer $MIXER --batch $BATCH --seq $SEQ --iters $ITERS [options]"
  runs=("")
  for sw in $SWITCHES; do runs+=("--option $sw"); done
  [ "$(echo $SWITCHES | wc -w)" -gt 1 ] && runs+=("${all_off[*]}")
  for options in "${runs[@]}"; do
    # shellcheck disable=SC2086
    "$M" --model "$MODEL" --mixer "$MIXER" --batch "$BATCH" --seq "$SEQ" --iters "$ITERS" $options 2>&1 | grep -E "RESULT|error"
  done
  echo "# per-kernel profile, every kernel on"
  "$M" --model "$MODEL" --mixer "$MIXER" --batch "$BATCH" --seq "$SEQ" --iters 2 --profile 2 2>&1 | grep -v RESULT | head -40
} > "$OUT/layer_ab.txt"
cat "$OUT/layer_ab.txt"
[ -z "$PREFILL_CONTEXTS" ] && exit 0
"$L" bench prefill -m "$MODEL" -c "$PREFILL_CONTEXTS" --out-json /tmp/prefill_on.json 2>&1 | grep -E "^\|"
"$L" bench prefill -m "$MODEL" -c "$PREFILL_CONTEXTS" "${prefill_off[@]}" --out-json /tmp/prefill_off.json 2>&1 \
  | grep -E "^\|"
python3 - "$OUT/prefill_ab.json" "$SWITCHES" << 'PY'
import json, sys
on, off = json.load(open("/tmp/prefill_on.json")), json.load(open("/tmp/prefill_off.json"))
json.dump({"switched_off": sys.argv[2], "kernels_on": on, "kernels_off": off}, open(sys.argv[1], "w"), indent=1)
PY
