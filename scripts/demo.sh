#!/usr/bin/env bash
# The main job on an embedded default, CPU only, a few minutes on 2 cores:
#   1. export Jane Austen's six novels (public domain; Debian package r-cran-janeaustenr),
#   2. train a byte-level BPE tokenizer on them,
#   3. tokenize them into train/validation shards,
#   4. train a small looped model (MODEL, default the LT2 hybrid Full+GDN preset when present),
#   5. generate text from it.
# Nothing is downloaded. Override with env vars: MODEL, STEPS, VOCAB, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
LT2="$BUILD_DIR/apps/lt2/lt2"
OUT=${OUT:-runs/austen}
DATA=${DATA:-data/austen}
VOCAB=${VOCAB:-2048}
STEPS=${STEPS:-200}
if [ -z "${MODEL:-}" ]; then
  MODEL=tiny-full-gdn
  [ -f configs/$MODEL.json ] || MODEL=tiny-full
fi

if [ ! -x "$LT2" ]; then
  echo "== building lt2 (first run only)"
  TARGETS=lt2_cli scripts/build.sh > /dev/null
fi

mkdir -p "$DATA"
if [ ! -s "$DATA/austen.txt" ]; then
  echo "== exporting Jane Austen's novels from r-cran-janeaustenr"
  Rscript -e 'suppressMessages(library(janeaustenr)); b <- austen_books(); writeLines(b$text, commandArgs(TRUE)[1])' "$DATA/austen.txt"
fi
echo "   corpus: $(wc -c < "$DATA/austen.txt") bytes"

echo "== training a $VOCAB-token byte-level BPE tokenizer"
"$LT2" tokenizer train --input "$DATA/austen.txt" --vocab-size "$VOCAB" --special "<|endoftext|>" --out "$DATA/tokenizer.json"

echo "== tokenizing into shards"
"$LT2" data prepare --input "$DATA/austen.txt" --tokenizer "$DATA/tokenizer.json" --out "$DATA/shards" --val-fraction 0.02

echo "== training $MODEL for $STEPS steps on the CPU"
rm -rf "$OUT"
"$LT2" train --model "$MODEL" --train-data "$DATA/shards/train.bin" --val-data "$DATA/shards/val.bin" \
  --out "$OUT" --steps "$STEPS" --seq-len 128 --batch-size 16 --lr 3e-3 --warmup 30 --eval-every 100 \
  --log-every 10 --device cpu

echo "== generating"
"$LT2" generate "$OUT/$(cat "$OUT/latest")" --prompt "It is a truth universally acknowledged" \
  --max-new-tokens 120 --temperature 0.7 --top-p 0.9 --seed 1 --ignore-eos
