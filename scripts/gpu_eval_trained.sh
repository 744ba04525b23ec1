#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) from the repo root with `.deps` and the evaluation data carried:
# trains each of MODELS on the same token shard for STEPS steps through `lt2 train`, then scores it with
# every mode of `lt2 eval` (WikiText-2 perplexity, also with fewer loops; the zero-shot tasks; S-NIAH-1).
#   EVAL_DATA=.evaldata   a folder with
#     shards/train.bin, shards/val.bin, shards/tokenizer.json   (`lt2 data prepare` of the training text)
#     wikitext-2/test.txt                                      (the perplexity text, WikiText format)
#     zeroshot/<task files>                                    (`lt2 eval mc --help` lists the paths)
#   (scripts/eval_table.py --help: the files it merges)
#   MODELS=lt2-gdn-100m,lt-100m  STEPS=80  SEQ=2048  BATCH=16  LR=1e-3  MC_LIMIT=500
#   NIAH_LENGTHS="1024 2048"  LOOPS="1 2 3" (perplexity with only the first T' loops as well)
# Writes $OUT/eval_trained.json (every eval's JSON and each run's last training line) and
# $OUT/eval_trained.md; the trained checkpoints stay on the GPU machine (too large to bring back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
D=${EVAL_DATA:-.evaldata}
mkdir -p "$OUT"
ROOT=$PWD/.deps/root/usr
export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
B=build-gpu
L=$B/apps/lt2/lt2
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  t0=$(date +%s)
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > /tmp/ev_build.log 2>&1 &&
    cmake --build $B -j "$(nproc)" --target lt2_cli >> /tmp/ev_build.log 2>&1 ||
    { grep -E "error|Error" -A5 /tmp/ev_build.log | head -60; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
TOK=$D/shards/tokenizer.json
RESULTS=/tmp/eval_trained
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
MODELS=${MODELS:-lt2-gdn-100m,lt-100m}
for model in ${MODELS//,/ }; do
  run=/tmp/runs/$model
  rm -rf "$run"
  echo "== train $model"
  $L train --model "$model" --train-data "$D/shards/train.bin" --val-data "$D/shards/val.bin" --out "$run" \
    --steps "${STEPS:-80}" --seq-len "${SEQ:-2048}" --batch-size "${BATCH:-16}" --lr "${LR:-1e-3}" --warmup 10 \
    --eval-every 0 --log-every 10 --checkpoint-loops > "$RESULTS/$model.train.log" 2>&1 ||
    { tail -20 "$RESULTS/$model.train.log"; continue; }
  cp "$run/metrics.jsonl" "$RESULTS/$model.train.jsonl"
  ckpt=$run/$(cat "$run/latest")
  echo "== eval $model"
  $L eval ppl "$ckpt" --tokenizer "$TOK" --wikitext --data "$D/wikitext-2/test.txt" --json --quiet \
    > "$RESULTS/$model.ppl.json" 2> "$RESULTS/$model.ppl.err" || tail -5 "$RESULTS/$model.ppl.err"
  for loops in ${LOOPS:-1 2 3}; do
    $L eval ppl "$ckpt" --tokenizer "$TOK" --wikitext --data "$D/wikitext-2/test.txt" --loops "$loops" --json --quiet \
      > "$RESULTS/$model.ppl_loops$loops.json" 2> "$RESULTS/$model.ppl.err" || tail -5 "$RESULTS/$model.ppl.err"
  done
  $L eval mc "$ckpt" --tokenizer "$TOK" --tasks all --data-dir "$D/zeroshot" --limit "${MC_LIMIT:-500}" \
    --batch-tokens 32768 --json --quiet > "$RESULTS/$model.mc.json" 2> "$RESULTS/$model.mc.err" || tail -5 "$RESULTS/$model.mc.err"
  # shellcheck disable=SC2086
  $L eval niah "$ckpt" --tokenizer "$TOK" --task s-niah-1 --lengths ${NIAH_LENGTHS:-1024 2048} --depths 0 50 100 \
    --samples 4 --batch 12 --json --quiet > "$RESULTS/$model.niah.json" 2> "$RESULTS/$model.niah.err" ||
    tail -5 "$RESULTS/$model.niah.err"
done
python3 scripts/eval_table.py "$RESULTS" --command "MODELS=$MODELS STEPS=${STEPS:-80} scripts/gpu_eval_trained.sh" \
  --commit "${LT2_COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}" --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --out-json "$OUT/eval_trained.json" --out-md "$OUT/eval_trained.md"
cat "$OUT/eval_trained.md"
