#!/usr/bin/env bash
# The distillation experiment of issue 27 in one call: train an Ouro-form teacher on English text and
# keep its best-validation checkpoint, distil it three ways with `lt2 distill` (a 25%-full GDN hybrid
# whose full layers the KL-guided selection picks, the same ratio uniformly (every 4th layer), and an
# all-GDN student), plus a control (the teacher itself through the same stages 2 and 3), and score
# them: WikiText-2 test perplexity, then as time allows the zero-shot average (`lt2 eval mc`),
# S-NIAH-1 at NIAH_LENGTHS (`lt2 eval niah`) and decode tokens/s at BENCH_CONTEXT x BENCH_BATCH
# (`lt2 bench decode`).
#   scripts/gpu_distill.sh DATA_DIR
# DATA_DIR is the folder scripts/distill_data.sh assembles: wikitext-2/{train,valid,test}.txt, extra/
# (more training text, any *.txt), zeroshot/ (optional: no zero-shot column without it).
# Runs ON THE GPU MACHINE from the repo root (device tool), or on the CPU with TINY=1 (tiny settings,
# the same steps end to end, a few minutes).
#
# Why these budgets (the recipe, spec'd for ~1B tokens, scaled to one ~420 s GPU call):
# - Text: WikiText-2 train (2.1M words) + Tiny Shakespeare + the essays, 3.0M tokens with a VOCAB BPE
#   trained on that text alone; WikiText-2 valid picks the teacher checkpoint, test scores the models.
# - Teacher: 20.5M tokens (the issue's floor: 20M) are ~7 epochs of that text, past the point where the
#   validation loss turns up, so the run evaluates every TEACHER_EVAL_EVERY steps and the students
#   learn from its best-validation checkpoint (`lt2 train --keep-best`), not from its last.
# - Students: stage 2 is pure KL to the teacher (the recipe's), on ~1.3M tokens each, far fewer than the
#   teacher saw, so a student can approach the teacher but not out-train it; its learning rates are 10x
#   the recipe's (1e-3 for the mixers, 7e-5 for the rest: the same ratio) because the stage is ~500x
#   shorter. Stage 3 keeps the config's plain cross-entropy at lr 1e-5, LONG_STEPS steps at LONG_SEQ.
#   Sequences are shorter than the recipe's (kd 1024 for 4096, long 2048 for 32k) to fit the call.
# - Evaluation: perplexity of every model first (the issue's criterion), then the optional columns while
#   the call's BUDGET lasts; a column that did not fit is left empty and the table says so.
# Expected H200 time, from measured rates (teacher 141k tokens/s at a 32k vocabulary, KD ~40k tokens/s,
# align + selection ~65 s at 200 align steps, ~3.5 s a perplexity evaluation): data ~5 s; teacher
# ~145 s + ~10 s of evaluations and best checkpoints; align ~35 s; selection ~17 s; each student kd
# ~33 s + long ~5 s + start-ups and its perplexity ~8 s (x 3: ~140 s). ~355 s before the optional
# columns (decode ~15 s for the four, then S-NIAH-1 ~4 s and zero-shot ~8 s a model: ~65 s).
#
# Environment:
#   OUT       results folder (default /tmp/lt2_gpu_out): distill_gpu.{md,json}, selection.{md,json},
#             teacher_metrics.jsonl (its validation curve), logs.tar.gz (every step's log): 6 files
#   WORK      scratch folder for shards and runs (default /tmp/lt2_distill)
#   LT2       the lt2 binary; default: PREBUILT/lt2 with PREBUILT set (scripts/prebuild_gpu.sh), else
#             build-gpu's, built here first (with .deps carried: docs/gpu.md)
#   RESUME=1  continue a run in the same WORK (a warm machine) where it stopped
#   TINY=1    CPU smoke run: a tiny teacher and a few steps a stage
#   BUDGET    seconds since this script started (build included) after which no optional evaluation
#             starts (default 555; TINY: 0 = no limit). The tables are rewritten after every
#             evaluation, so a call cut by its time limit still brings back every column it finished.
#   SEED      seed of the teacher and of every distillation stage (default 1234)
#   Sizes (defaults in the block below): VOCAB D LAYERS HEADS FFN LOOPS, TEACHER_STEPS TEACHER_BATCH SEQ
#   TEACHER_EVAL_EVERY, ALIGN_STEPS KD_STEPS KD_SEQ LONG_STEPS LONG_SEQ PROBE_STEPS BATCH, EVAL_LEN (ppl
#   window, tokens), EVAL_LINES (score only the first N lines of test.txt; 0 = all of it), MC_LIMIT (items
#   a zero-shot task), NIAH_LENGTHS NIAH_SAMPLES, BENCH_CONTEXT BENCH_BATCH, SELECT_METHOD (shared: every
#   layer restored on the aligned student, N + 1 KL evaluations; both: also the exhaustive ranking, one
#   PROBE_STEPS probe per layer, for the comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/gpu_distill.sh DATA_DIR   (from scripts/distill_data.sh)" >&2; exit 2; }
DATA=$1
for f in wikitext-2/train.txt wikitext-2/valid.txt wikitext-2/test.txt; do
  [ -f "$DATA/$f" ] || { echo "gpu_distill: $DATA/$f is missing (scripts/distill_data.sh assembles DATA_DIR)" >&2; exit 1; }
done
OUT=${OUT:-/tmp/lt2_gpu_out}
WORK=${WORK:-/tmp/lt2_distill}
mkdir -p "$OUT"
# RESUME=1 keeps $WORK and skips every step whose result is already there (a call cut by its time limit).
RESUME=${RESUME:-0}
[ "$RESUME" = 1 ] || rm -rf "$WORK"
LOGS=$WORK/logs
mkdir -p "$WORK/evals" "$LOGS"
# The GPU machine brings back at most 8 files from OUT: the logs travel as one archive.
pack_logs() { tar czf "$OUT/logs.tar.gz.tmp" -C "$WORK" logs && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"; }

: "${SELECT_METHOD:=shared}" "${SEED:=1234}"
if [ "${TINY:-0}" = 1 ]; then
  : "${VOCAB:=2048}" "${D:=64}" "${LAYERS:=4}" "${HEADS:=4}" "${FFN:=128}" "${LOOPS:=2}" "${TEACHER_STEPS:=40}"
  : "${TEACHER_BATCH:=4}" "${SEQ:=64}" "${TEACHER_EVAL_EVERY:=10}" "${ALIGN_STEPS:=6}" "${KD_STEPS:=6}" "${KD_SEQ:=64}"
  : "${LONG_STEPS:=2}" "${LONG_SEQ:=128}" "${PROBE_STEPS:=2}" "${BATCH:=4}" "${EVAL_LEN:=64}" "${EVAL_LINES:=100}"
  : "${MC_LIMIT:=5}" "${NIAH_LENGTHS:=256 512}" "${NIAH_SAMPLES:=1}" "${BENCH_CONTEXT:=512}" "${BENCH_BATCH:=2}"
  : "${DEVICE:=cpu}" "${BUDGET:=0}"
else
  # ~42M parameters (17M of them the embeddings and head), T 4, 20.5M tokens of teacher training.
  : "${VOCAB:=16384}" "${D:=512}" "${LAYERS:=8}" "${HEADS:=8}" "${FFN:=1408}" "${LOOPS:=4}" "${TEACHER_STEPS:=1250}"
  : "${TEACHER_BATCH:=32}" "${SEQ:=512}" "${TEACHER_EVAL_EVERY:=100}" "${ALIGN_STEPS:=150}" "${KD_STEPS:=80}"
  : "${KD_SEQ:=1024}" "${LONG_STEPS:=10}" "${LONG_SEQ:=2048}" "${PROBE_STEPS:=30}" "${BATCH:=16}" "${EVAL_LEN:=512}"
  : "${EVAL_LINES:=0}" "${MC_LIMIT:=200}" "${NIAH_LENGTHS:=1024 2048 4096}" "${NIAH_SAMPLES:=4}"
  : "${BENCH_CONTEXT:=8k}" "${BENCH_BATCH:=8}" "${DEVICE:=cuda}" "${BUDGET:=555}"
fi
LONG_BATCH=$(( BATCH * SEQ / LONG_SEQ > 0 ? BATCH * SEQ / LONG_SEQ : 1 ))

if [ -z "${LT2:-}" ]; then
  if [ -n "${PREBUILT:-}" ]; then
    LT2=$PREBUILT/lt2
    export LD_LIBRARY_PATH="$PWD/$PREBUILT:${LD_LIBRARY_PATH:-}"
  else
    ROOT=$PWD/.deps/root/usr
    export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
    t0=$(date +%s)
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > "$LOGS/build.log" 2>&1 &&
      cmake --build build-gpu -j "$(nproc)" --target lt2_cli >> "$LOGS/build.log" 2>&1 ||
      { grep -E "error" -A5 "$LOGS/build.log" | head -40; pack_logs; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
    LT2=build-gpu/apps/lt2/lt2
  fi
fi

START=$(date +%s)
phase() { pack_logs; echo "== $1 ($(( $(date +%s) - START )) s)"; }
# Runs a command with its output in logs/<name>.log, showing the last lines.
# A step is skipped under RESUME=1 when its output exists: have FILE.
have() { [ "$RESUME" = 1 ] && [ -e "$1" ]; }
logged() {
  local name=$1; shift
  "$@" > "$LOGS/$name.log" 2>&1 || { tail -30 "$LOGS/$name.log"; pack_logs; exit 1; }
  tail -2 "$LOGS/$name.log"
}
# Whether an optional evaluation may still start: BUDGET seconds of this script (0: always).
in_budget() { [ "$BUDGET" = 0 ] || [ "$SECONDS" -lt "$BUDGET" ]; }
# The newest checkpoint of a run folder (its `latest`, or `best` with a second argument).
ckpt() { echo "$1/$(cat "$1/${2:-latest}")"; }

TRAIN_TEXT=("$DATA/wikitext-2/train.txt")
[ -d "$DATA/extra" ] && TRAIN_TEXT+=("$DATA/extra")
phase "data: a $VOCAB-token BPE and the shards, from ${TRAIN_TEXT[*]} (training) and WikiText-2 valid"
have "$WORK/tokenizer.json" || logged tokenizer "$LT2" tokenizer train --input "${TRAIN_TEXT[@]}" --vocab-size "$VOCAB" \
  --out "$WORK/tokenizer.json"
have "$WORK/train/train.bin" || logged prepare_train "$LT2" data prepare --input "${TRAIN_TEXT[@]}" --tokenizer "$WORK/tokenizer.json" \
  --out "$WORK/train" --val-fraction 0
have "$WORK/valid/train.bin" || logged prepare_valid "$LT2" data prepare --input "$DATA/wikitext-2/valid.txt" --tokenizer "$WORK/tokenizer.json" \
  --out "$WORK/valid" --val-fraction 0
TRAIN=$WORK/train/train.bin
VALID=$WORK/valid/train.bin

TEST=$DATA/wikitext-2/test.txt
if [ "$EVAL_LINES" -gt 0 ]; then head -n "$EVAL_LINES" "$TEST" > "$WORK/test.txt" && TEST=$WORK/test.txt; fi
ppl() {  # ppl NAME MODEL: WikiText-2 test perplexity -> evals/NAME.ppl.json
  have "$WORK/evals/$1.ppl.json" || "$LT2" eval ppl "$2" --data "$TEST" --max-length "$EVAL_LEN" --device "$DEVICE" --json --quiet \
    > "$WORK/evals/$1.ppl.json"
}

phase "teacher: Ouro form, d $D, $LAYERS layers x $LOOPS loops, $TEACHER_STEPS steps x $TEACHER_BATCH x $SEQ tokens, best of every $TEACHER_EVAL_EVERY"
cat > "$WORK/teacher.json" <<EOF
{"name": "ouro-wikitext", "form": "ouro", "vocab_size": 0, "d_model": $D, "n_layers": $LAYERS, "n_heads": $HEADS,
 "ffn_hidden": $FFN, "n_loops": $LOOPS, "layer_pattern": "full", "max_seq_len": 8192, "rope_style": "half",
 "rope_theta": 1000000.0, "norm_eps": 1e-6, "exit_gate": true, "loop_gate": false, "attn_output_gate": false}
EOF
# Finished when its last step's checkpoint is `latest` (with --keep-best, checkpoints appear mid-run);
# under RESUME=1 an unfinished run continues.
if ! { [ "$RESUME" = 1 ] && [ "$(cat "$WORK/teacher/latest" 2> /dev/null)" = "ckpt-$TEACHER_STEPS" ]; }; then
  resume=()
  [ "$RESUME" = 1 ] && [ -e "$WORK/teacher/latest" ] && resume=(--resume)
  logged teacher "$LT2" train --model "$WORK/teacher.json" --train-data "$TRAIN" --val-data "$VALID" \
  --objective ouro --steps "$TEACHER_STEPS" --batch-size "$TEACHER_BATCH" --seq-len "$SEQ" --lr 1e-3 \
  --warmup $(( TEACHER_STEPS / 20 + 1 )) --eval-every "$TEACHER_EVAL_EVERY" --keep-best --log-every 50 --seed "$SEED" \
  --device "$DEVICE" --out "$WORK/teacher" "${resume[@]}"
fi
cp "$WORK/teacher/metrics.jsonl" "$OUT/teacher_metrics.jsonl"
TEACHER=$(ckpt "$WORK/teacher" best)
ppl teacher "$TEACHER"

# One distillation config for the students (and the control); they differ only in which layers stay full attention.
cat > "$WORK/distill.json" <<EOF
{"train": {"train_data": "$TRAIN", "val_data": "$VALID", "device": "$DEVICE", "batch_size": $BATCH, "seed": $SEED,
           "log_every": 50, "eval_batches": 4, "eval_every": 0, "save_every": 0},
 "student": {"mixer": "gdn", "keep_fraction": 0.25},
 "align": {"seq_len": $SEQ, "steps": $ALIGN_STEPS, "lr": 1e-3, "warmup": $(( ALIGN_STEPS / 10 + 1 )), "min_lr_ratio": 0.0,
           "weight_decay": 0.0},
 "select": {"method": "$SELECT_METHOD", "probe_steps": $PROBE_STEPS, "shared_probe_steps": 0, "eval_batches": 4},
 "kd": {"seq_len": $KD_SEQ, "steps": $KD_STEPS, "lr": 1e-3, "other_lr": 7e-5, "warmup": $(( KD_STEPS / 10 + 1 ))},
 "long": {"seq_len": $LONG_SEQ, "batch_size": $LONG_BATCH, "steps": $LONG_STEPS, "lr": 1e-5,
          "warmup": $(( LONG_STEPS / 10 + 1 ))}}
EOF
distill() { local name=$1; shift; logged "$name" "$LT2" distill --teacher "$TEACHER" --config "$WORK/distill.json" "$@"; }

phase "stage 1 (align), shared by the students"
have "$WORK/kl/align/latest" || distill align --stage align --out "$WORK/kl"
for s in uniform gdn self; do have "$WORK/$s/align" || { mkdir -p "$WORK/$s" && cp -r "$WORK/kl/align" "$WORK/kl/distill_config.json" "$WORK/$s/"; }; done
phase "KL-guided selection"
have "$WORK/kl/select/selection.json" || distill select --stage select --out "$WORK/kl"
cp "$WORK/kl/select/selection.md" "$WORK/kl/select/selection.json" "$OUT/"
UNIFORM=$(seq -s, 3 4 $(( LAYERS - 1 )))
# The control: every layer kept full attention, i.e. the teacher itself through stages 2 and 3. The
# students beat a teacher that over-fits its small corpus (the KL to its soft targets smooths it), so
# the gap that the mixer swap opens is measured at equal training: all-GDN against this control.
for s in kl uniform gdn self; do
  case $s in
    kl) keep=() ;;
    uniform) keep=(--kd-keep "$UNIFORM") ;;
    gdn) keep=(--set 'kd.keep=[]') ;;
    self) keep=(--kd-keep "$(seq -s, 0 $(( LAYERS - 1 )))") ;;
  esac
  phase "stage 2 (kd) and stage 3 (long): $s"
  have "$WORK/$s/kd/latest" || distill "kd_$s" --stage kd --out "$WORK/$s" "${keep[@]}"
  have "$WORK/$s/long/latest" || distill "long_$s" --stage long --out "$WORK/$s"
  ppl "$s" "$(ckpt "$WORK/$s/long")"
done

cat > "$WORK/settings.json" <<EOF
{"vocab": $VOCAB, "d": $D, "layers": $LAYERS, "heads": $HEADS, "ffn": $FFN, "loops": $LOOPS, "eval_len": $EVAL_LEN,
 "eval_lines": $EVAL_LINES, "device": "$DEVICE", "seed": $SEED, "uniform_keep": [$UNIFORM], "teacher": "$TEACHER",
 "mc_limit": $MC_LIMIT, "niah_samples": $NIAH_SAMPLES, "bench": "$BENCH_CONTEXT x $BENCH_BATCH",
 "tokens": {"teacher_run": $(( TEACHER_STEPS * TEACHER_BATCH * SEQ )), "teacher_step": $(( TEACHER_BATCH * SEQ )),
            "align": $(( ALIGN_STEPS * BATCH * SEQ )), "select_forward": $(( (LAYERS + 1) * 4 * BATCH * KD_SEQ )),
            "kd": $(( KD_STEPS * BATCH * KD_SEQ )), "long": $(( LONG_STEPS * LONG_BATCH * LONG_SEQ ))}}
EOF
table() {  # distill_gpu.{json,md} from what evals/ holds so far, and the logs
  pack_logs
  python3 - "$WORK" "$OUT" "$(( $(date +%s) - START ))" <<'EOF'
import glob, json, os, sys
sys.path.insert(0, "scripts")
from eval_table import load  # a JSON file, or None where it is missing or incomplete
work, out, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = load(f"{work}/settings.json")
evals = {os.path.basename(p)[:-5]: load(p) for p in glob.glob(f"{work}/evals/*.json")}
best = load(os.path.join(s["teacher"], "trainer_state.json"))
selection = load(f"{work}/kl/select/selection.json")
r = {"settings": s, "teacher_best_step": best["best_step"], "teacher_best_val_loss": best["best_val_loss"],
     "selection": selection, "evals": evals, "seconds": seconds}
def write(name, text):  # whole or not at all: the call may be cut at any moment
    with open(f"{out}/{name}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{out}/{name}.tmp", f"{out}/{name}")
write("distill_gpu.json", json.dumps(r, indent=1) + "\n")

models = [("teacher", "teacher (best validation)", "all"),
          ("kl", "KL-selected 25% full", ", ".join(map(str, selection["keep"]))),
          ("uniform", "uniform every 4th", ", ".join(map(str, s["uniform_keep"]))), ("gdn", "all GDN", "none"),
          ("self", "control: teacher through stages 2-3", "all")]
def ppl(name):
    e = evals.get(f"{name}.ppl")
    return e["exits"][-1]["word_perplexity"] if e else None
def cell(x, fmt):
    return format(x, fmt) if x is not None else ""
bench = evals.get("bench")
niah_lengths = None
rows = []
for i, (name, label, layers) in enumerate(models):
    e = evals.get(f"{name}.ppl")
    mc = evals.get(f"{name}.mc")
    niah = evals.get(f"{name}.niah")
    niah_cells = []
    if niah:
        niah_lengths = niah["lengths"]
        niah_cells = [cell(100 * sum(line) / len(line), ".0f") for line in niah["exits"][-1]["scores"]]
    tok_s = bench["cells"][i]["tokens_per_s"] if bench and i < len(bench["cells"]) else None
    rows.append([label, layers, cell(ppl(name), ".2f"), cell(e["exits"][-1]["token_perplexity"] if e else None, ".2f"),
                 cell(100 * mc["average"][-1] if mc else None, ".1f"), niah_cells, cell(tok_s, ".0f")])
lengths = niah_lengths or []
t = s["tokens"]
md = ["# Distilling an Ouro-form teacher into LT2 hybrids (WikiText-2)\n",
    f"Teacher: d {s['d']}, {s['layers']} layers x {s['loops']} loops, {s['vocab']}-token BPE; a run of {t['teacher_run']:,} "
    f"tokens whose best validation checkpoint (step {best['best_step']}, {best['best_step'] * t['teacher_step']:,} tokens, "
    f"WikiText-2 valid loss {best['best_val_loss']:.4f}) is the teacher. Perplexity: WikiText-2 test, windows of "
    f"{s['eval_len']} tokens{'' if s['eval_lines'] == 0 else ', first ' + str(s['eval_lines']) + ' lines'}. Zero-shot: "
    f"average accuracy over the tasks of `lt2 eval mc --tasks all`, first {s['mc_limit']} items each. S-NIAH-1: % exact "
    f"over depths 0/50/100, {s['niah_samples']} sample(s) per (length, depth). Decode: `lt2 bench decode`, {s['bench']}, tokens/s.\n",
    "| model | full-attention layers | word ppl | token ppl | zero-shot avg (%) | "
    + " | ".join(f"S-NIAH-1 @{n}" for n in lengths) + (" | " if lengths else "") + "decode tok/s |",
    "| --- | --- | --- | --- | --- | " + "--- | " * len(lengths) + "--- |"]
for label, layers, w, tk, z, n, d in rows:
    n = n or [""] * len(lengths)
    md.append(f"| {label} | {layers} | {w} | {tk} | {z} | " + "".join(f"{x} | " for x in n) + f"{d} |")
def recovery(reference, label):
    if not all(ppl(m) is not None for m in (reference, "kl", "uniform", "gdn")):
        return
    gap = ppl("gdn") - ppl(reference)
    if gap > 0:
        rec = lambda m: 100 * (ppl("gdn") - ppl(m)) / gap
        md.append(f"\nGap ({label}: all-GDN word ppl {ppl('gdn'):.2f} - {ppl(reference):.2f}) recovered by the "
                  f"KL-selected hybrid: {rec('kl'):.0f}% (uniform: {rec('uniform'):.0f}%); the issue asks >= 90% "
                  "and more than uniform.")
    else:
        md.append(f"\nAll-GDN is not worse than {label} ({ppl('gdn'):.2f} against {ppl(reference):.2f} word "
                  f"ppl): no gap to recover against it. The KL-selected hybrid: {ppl('kl'):.2f}, uniform: "
                  f"{ppl('uniform'):.2f}.")
recovery("self", "the control (the teacher through the same stages, every layer full)")
recovery("teacher", "the teacher")
names = {"mc": "zero-shot", "niah": "S-NIAH-1"}
scored = [m for m, _, _ in models if m != "self"]  # the control is there for its perplexity only
missing = [f"{names[k]} ({', '.join(m for m in scored if f'{m}.{k}' not in evals)})" for k in names
           if any(f"{m}.{k}" not in evals for m in scored)] + ([] if bench else ["decode"])
if missing:
    md.append(f"\nNot measured within the call's time budget (or without data): {'; '.join(missing)}.")
md.append(f"\nTokens: align {t['align']:,} (shared by the students), selection {t['select_forward']:,} "
                   f"(forward only), kd {t['kd']:,} and long {t['long']:,} per student. Pipeline: {seconds} s.")
write("distill_gpu.md", "\n".join(md) + "\n")
EOF
}
table

# Optional columns, in order of cost, while the budget lasts.
phase "decode tokens/s at $BENCH_CONTEXT x $BENCH_BATCH"
if in_budget && ! have "$WORK/evals/bench.json"; then
  configs=()
  for m in "$TEACHER" "$(ckpt "$WORK/kl/long")" "$(ckpt "$WORK/uniform/long")" "$(ckpt "$WORK/gdn/long")"; do configs+=("$m/config.json"); done
  "$LT2" bench decode -m "${configs[@]}" -c "$BENCH_CONTEXT" -b "$BENCH_BATCH" --paths engine --device "$DEVICE" \
    --out-json "$WORK/evals/bench.json" > "$LOGS/bench.log" 2>&1 || tail -5 "$LOGS/bench.log"
fi
for s in teacher kl uniform gdn; do
  model=$([ $s = teacher ] && echo "$TEACHER" || ckpt "$WORK/$s/long")
  phase "S-NIAH-1 ($NIAH_LENGTHS) and zero-shot: $s"
  # shellcheck disable=SC2086
  in_budget && ! have "$WORK/evals/$s.niah.json" && { "$LT2" eval niah "$model" --task s-niah-1 --lengths $NIAH_LENGTHS \
    --depths 0 50 100 --samples "$NIAH_SAMPLES" --batch 12 --device "$DEVICE" --json --quiet > "$WORK/evals/$s.niah.json" \
    2> "$LOGS/niah_$s.log" || { tail -5 "$LOGS/niah_$s.log"; rm -f "$WORK/evals/$s.niah.json"; }; }
  [ -d "$DATA/zeroshot" ] && in_budget && ! have "$WORK/evals/$s.mc.json" && { "$LT2" eval mc "$model" --tasks all \
    --data-dir "$DATA/zeroshot" --limit "$MC_LIMIT" --batch-tokens 32768 --device "$DEVICE" --json --quiet \
    > "$WORK/evals/$s.mc.json" 2> "$LOGS/mc_$s.log" || { tail -5 "$LOGS/mc_$s.log"; rm -f "$WORK/evals/$s.mc.json"; }; }
  table
done
cat "$OUT/distill_gpu.md"
phase done
