#!/usr/bin/env bash
# The distillation experiment of issue 27 in one call: train a small Ouro-form teacher on WikiText-2,
# distil it three ways with `lt2 distill` (a 25%-full GDN hybrid whose full layers the KL-guided
# selection picks, the same ratio uniformly (every 4th layer), and an all-GDN student), and measure
# each model's WikiText-2 perplexity with `lt2 eval ppl`.
#   scripts/gpu_distill.sh DATA_DIR
# DATA_DIR holds wikitext-2/{train,valid,test}.txt (the tokenized WikiText-2 release) and tokenizer.json.
# Runs ON THE GPU MACHINE from the repo root (device tool), or on the CPU with TINY=1 (tiny settings,
# the same steps end to end, a few minutes).
# Environment:
#   OUT       results folder (default /tmp/lt2_gpu_out): distill_gpu.{md,json}, selection.md, logs/
#   WORK      scratch folder for shards and runs (default /tmp/lt2_distill)
#   LT2       the lt2 binary; default: PREBUILT/lt2 with PREBUILT set (scripts/prebuild_gpu.sh), else
#             build-gpu's, built here first (with .deps carried: docs/gpu.md)
#   RESUME=1  continue a run in the same WORK (a warm machine) where it stopped
#   TINY=1    CPU smoke run: a tiny teacher and a few steps a stage
#   Sizes (defaults in the block below): D LAYERS HEADS FFN LOOPS, TEACHER_STEPS TEACHER_BATCH SEQ,
#   ALIGN_STEPS KD_STEPS KD_SEQ LONG_STEPS LONG_SEQ PROBE_STEPS BATCH, EVAL_LEN (ppl window, tokens),
#   EVAL_LINES (score only the first N lines of test.txt; 0 = all of it), SELECT_METHOD (shared: every
#   layer restored on the aligned student, N + 1 KL evaluations; both: also the exhaustive ranking, one
#   PROBE_STEPS probe per layer, for the comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/gpu_distill.sh DATA_DIR   (wikitext-2/{train,valid,test}.txt and tokenizer.json)" >&2; exit 2; }
DATA=$1
for f in wikitext-2/train.txt wikitext-2/valid.txt wikitext-2/test.txt tokenizer.json; do
  [ -f "$DATA/$f" ] || { echo "gpu_distill: $DATA/$f is missing" >&2; exit 1; }
done
OUT=${OUT:-/tmp/lt2_gpu_out}
WORK=${WORK:-/tmp/lt2_distill}
mkdir -p "$OUT/logs"
# RESUME=1 keeps $WORK and skips every step whose result is already there (a call cut by its time limit).
RESUME=${RESUME:-0}
[ "$RESUME" = 1 ] || rm -rf "$WORK"
mkdir -p "$WORK"

: "${SELECT_METHOD:=shared}"
if [ "${TINY:-0}" = 1 ]; then
  : "${D:=64}" "${LAYERS:=4}" "${HEADS:=4}" "${FFN:=128}" "${LOOPS:=2}" "${TEACHER_STEPS:=30}" "${TEACHER_BATCH:=4}"
  : "${SEQ:=64}" "${ALIGN_STEPS:=6}" "${KD_STEPS:=6}" "${KD_SEQ:=64}" "${LONG_STEPS:=2}" "${LONG_SEQ:=128}"
  : "${PROBE_STEPS:=2}" "${BATCH:=4}" "${EVAL_LEN:=64}" "${EVAL_LINES:=100}" "${DEVICE:=cpu}"
else
  # ~76M parameters (50M of them the 49k-token embeddings and head), T 4, 20M tokens of teacher training.
  : "${D:=512}" "${LAYERS:=8}" "${HEADS:=8}" "${FFN:=1408}" "${LOOPS:=4}" "${TEACHER_STEPS:=1250}" "${TEACHER_BATCH:=32}"
  : "${SEQ:=512}" "${ALIGN_STEPS:=200}" "${KD_STEPS:=300}" "${KD_SEQ:=1024}" "${LONG_STEPS:=60}" "${LONG_SEQ:=2048}"
  : "${PROBE_STEPS:=30}" "${BATCH:=16}" "${EVAL_LEN:=512}" "${EVAL_LINES:=0}" "${DEVICE:=cuda}"
fi

if [ -z "${LT2:-}" ]; then
  if [ -n "${PREBUILT:-}" ]; then
    LT2=$PREBUILT/lt2
    export LD_LIBRARY_PATH="$PWD/$PREBUILT:${LD_LIBRARY_PATH:-}"
  else
    ROOT=$PWD/.deps/root/usr
    export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
    t0=$(date +%s)
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > "$OUT/logs/build.log" 2>&1 &&
      cmake --build build-gpu -j "$(nproc)" --target lt2_cli >> "$OUT/logs/build.log" 2>&1 ||
      { grep -E "error" -A5 "$OUT/logs/build.log" | head -40; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
    LT2=build-gpu/apps/lt2/lt2
  fi
fi

START=$(date +%s)
phase() { echo "== $1 ($(( $(date +%s) - START )) s)"; }
# Runs a command with its output in logs/<name>.log, showing the last lines.
# A step is skipped under RESUME=1 when its output exists: have FILE.
have() { [ "$RESUME" = 1 ] && [ -e "$1" ]; }
logged() { local name=$1; shift; "$@" > "$OUT/logs/$name.log" 2>&1 || { tail -30 "$OUT/logs/$name.log"; exit 1; }; tail -2 "$OUT/logs/$name.log"; }

phase "data: WikiText-2 train and valid tokenized with $DATA/tokenizer.json"
have "$WORK/train/train.bin" || logged prepare_train "$LT2" data prepare --input "$DATA/wikitext-2/train.txt" --tokenizer "$DATA/tokenizer.json" \
  --out "$WORK/train" --val-fraction 0
have "$WORK/valid/train.bin" || logged prepare_valid "$LT2" data prepare --input "$DATA/wikitext-2/valid.txt" --tokenizer "$DATA/tokenizer.json" \
  --out "$WORK/valid" --val-fraction 0
TRAIN=$WORK/train/train.bin
VALID=$WORK/valid/train.bin

phase "teacher: Ouro form, d $D, $LAYERS layers x $LOOPS loops, $TEACHER_STEPS steps x $TEACHER_BATCH x $SEQ tokens"
cat > "$WORK/teacher.json" <<EOF
{"name": "ouro-wikitext", "form": "ouro", "vocab_size": 0, "d_model": $D, "n_layers": $LAYERS, "n_heads": $HEADS,
 "ffn_hidden": $FFN, "n_loops": $LOOPS, "layer_pattern": "full", "max_seq_len": $LONG_SEQ, "rope_style": "half",
 "rope_theta": 1000000.0, "norm_eps": 1e-6, "exit_gate": true, "loop_gate": false, "attn_output_gate": false}
EOF
have "$WORK/teacher/latest" || logged teacher "$LT2" train --model "$WORK/teacher.json" --train-data "$TRAIN" --val-data "$VALID" --objective ouro \
  --steps "$TEACHER_STEPS" --batch-size "$TEACHER_BATCH" --seq-len "$SEQ" --lr 1e-3 --warmup $(( TEACHER_STEPS / 20 + 1 )) \
  --eval-every 0 --log-every 50 --device "$DEVICE" --out "$WORK/teacher"
TEACHER=$WORK/teacher/$(cat "$WORK/teacher/latest")

# One distillation config for the three students; they differ only in which layers stay full attention.
cat > "$WORK/distill.json" <<EOF
{"train": {"train_data": "$TRAIN", "val_data": "$VALID", "device": "$DEVICE", "batch_size": $BATCH, "seed": 1234,
           "log_every": 50, "eval_batches": 4, "eval_every": 0, "save_every": 0},
 "student": {"mixer": "gdn", "keep_fraction": 0.25},
 "align": {"seq_len": $SEQ, "steps": $ALIGN_STEPS, "lr": 1e-3, "warmup": $(( ALIGN_STEPS / 10 + 1 )), "min_lr_ratio": 0.0,
           "weight_decay": 0.0},
 "select": {"method": "$SELECT_METHOD", "probe_steps": $PROBE_STEPS, "shared_probe_steps": 0, "eval_batches": 4},
 "kd": {"seq_len": $KD_SEQ, "steps": $KD_STEPS, "lr": 1e-3, "other_lr": 7e-5, "warmup": $(( KD_STEPS / 10 + 1 ))},
 "long": {"seq_len": $LONG_SEQ, "batch_size": $(( BATCH * SEQ / LONG_SEQ > 0 ? BATCH * SEQ / LONG_SEQ : 1 )),
          "steps": $LONG_STEPS, "lr": 1e-4, "warmup": $(( LONG_STEPS / 10 + 1 ))}}
EOF
distill() { local name=$1; shift; logged "$name" "$LT2" distill --teacher "$TEACHER" --config "$WORK/distill.json" "$@"; }

phase "stage 1 (align), shared by the three students"
have "$WORK/kl/align/latest" || distill align --stage align --out "$WORK/kl"
for s in uniform gdn; do have "$WORK/$s/align" || { mkdir -p "$WORK/$s" && cp -r "$WORK/kl/align" "$WORK/kl/distill_config.json" "$WORK/$s/"; }; done
phase "KL-guided selection"
have "$WORK/kl/select/selection.json" || distill select --stage select --out "$WORK/kl"
cp "$WORK/kl/select/selection.md" "$WORK/kl/select/selection.json" "$OUT/"
UNIFORM=$(seq -s, 3 4 $(( LAYERS - 1 )))
for s in kl uniform gdn; do
  case $s in
    kl) keep=() ;;
    uniform) keep=(--kd-keep "$UNIFORM") ;;
    gdn) keep=(--set 'kd.keep=[]') ;;
  esac
  phase "stage 2 (kd) and stage 3 (long): $s"
  have "$WORK/$s/kd/latest" || distill "kd_$s" --stage kd --out "$WORK/$s" "${keep[@]}"
  have "$WORK/$s/long/latest" || distill "long_$s" --stage long --out "$WORK/$s"
done

phase "WikiText-2 test perplexity (windows of $EVAL_LEN tokens)"
TEST=$DATA/wikitext-2/test.txt
if [ "$EVAL_LINES" -gt 0 ]; then head -n "$EVAL_LINES" "$TEST" > "$WORK/test.txt" && TEST=$WORK/test.txt; fi
ppl() {  # model -> the eval JSON (token and word perplexity per exit)
  "$LT2" eval ppl "$1" --data "$TEST" --max-length "$EVAL_LEN" --device "$DEVICE" --json --quiet
}
{
  echo "{\"teacher\": $(ppl "$TEACHER"),"
  for s in kl uniform gdn; do
    echo "\"$s\": $(ppl "$WORK/$s/long/$(cat "$WORK/$s/long/latest")"),"
    echo "\"${s}_kd\": $(ppl "$WORK/$s/kd/$(cat "$WORK/$s/kd/latest")"),"
  done
  echo "\"selection\": $(cat "$WORK/kl/select/selection.json"), \"uniform_keep\": [$UNIFORM],"
  echo "\"tokens\": {\"teacher\": $(( TEACHER_STEPS * TEACHER_BATCH * SEQ )), \"align\": $(( ALIGN_STEPS * BATCH * SEQ )),"
  echo "  \"select_forward\": $(( (LAYERS + 1) * 4 * BATCH * KD_SEQ )), \"kd\": $(( KD_STEPS * BATCH * KD_SEQ )),"
  echo "  \"long\": $(( LONG_STEPS * (BATCH * SEQ / LONG_SEQ > 0 ? BATCH * SEQ / LONG_SEQ : 1) * LONG_SEQ ))},"
  echo "\"settings\": {\"d\": $D, \"layers\": $LAYERS, \"heads\": $HEADS, \"ffn\": $FFN, \"loops\": $LOOPS, \"eval_len\": $EVAL_LEN,"
  echo "  \"eval_lines\": $EVAL_LINES,"
  echo "  \"device\": \"$DEVICE\"}, \"seconds\": $(( $(date +%s) - START ))}"
} > "$OUT/distill_gpu.json"

python3 - "$OUT/distill_gpu.json" > "$OUT/distill_gpu.md" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
def ppl(x):  # word and token perplexity of the eval JSON's (last) exit
    row = x["exits"][-1]
    return row["word_perplexity"], row["token_perplexity"]
t = r["tokens"]
keep = r["selection"]["keep"]
print("# Distilling an Ouro-form teacher into LT2 hybrids (WikiText-2)\n")
print(f"Teacher: d {r['settings']['d']}, {r['settings']['layers']} layers x {r['settings']['loops']} loops, "
      f"trained on {t['teacher']:,} tokens. Perplexity on WikiText-2 test, windows of {r['settings']['eval_len']} tokens.\n")
print("| model | full-attention layers | word ppl (kd) | word ppl (after long) | token ppl (after long) |")
print("| --- | --- | --- | --- | --- |")
w, tk = ppl(r["teacher"])
print(f"| teacher | all | | {w:.2f} | {tk:.2f} |")
for name, label, layers in [("kl", "KL-selected 25% full", keep), ("uniform", "uniform every 4th", r["uniform_keep"]),
                            ("gdn", "all GDN", [])]:
    wk, _ = ppl(r[name + "_kd"])
    w, tk = ppl(r[name])
    print(f"| {label} | {', '.join(map(str, layers)) or 'none'} | {wk:.2f} | {w:.2f} | {tk:.2f} |")
gap = ppl(r["gdn"])[0] - ppl(r["teacher"])[0]
if gap > 0:
    print(f"\nGap recovered by the KL-selected hybrid: {100 * (ppl(r['gdn'])[0] - ppl(r['kl'])[0]) / gap:.0f}% "
          f"(uniform: {100 * (ppl(r['gdn'])[0] - ppl(r['uniform'])[0]) / gap:.0f}%).")
print(f"\nTokens per stage: align {t['align']:,} (shared by the three), selection {t['select_forward']:,} (forward only), "
      f"kd {t['kd']:,} and long {t['long']:,} per student. Whole call: {r['seconds']} s.")
EOF
cat "$OUT/distill_gpu.md"
phase done
