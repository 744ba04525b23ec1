#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool), from the repo root, after `STAGE=build scripts/gpu.sh` has
# built build-gpu/apps/lt2/lt2 (with `.deps` carried). The LT2 paper's curriculum experiment at
# small scale: six looped models (configs/tasks/*.json: 4 layers, width 256) x T in {1, 2, 4, 8}
# on swap-recall, one `lt2 tasks sweep` whose runs are child processes, JOBS at a time on the one
# GPU. The sweep lives in runs/gpu-tasks/ (checkpoints stay there, so running the script again on
# a warm machine resumes it); sweep.md, sweep.json, curves.png and each run's results.json,
# curve.png and log.txt are copied to $OUT/tasks. Prints the tables at the end.
#
# Budget: a fixed step budget per stage (STEPS_PER_STAGE, the same for every model: the paper's
# 100k scaled down), and a wall-time guard per run (MAX_SECONDS, derived from BUDGET_S, the wall
# time the whole sweep may take): a run cut by the guard is marked '*' in the table (its n_max is
# a lower bound) and resumes if the script runs again with the same settings. Five stages
# (n 8..128) suffice for the paper's claim (stage 4 vs 5) and let the key/value pool be 128.
#   BUDGET_S=360 JOBS=12 STEPS_PER_STAGE=1000 STAGES=5 POOL=128 BATCH=128 LR=1e-3 WARMUP=100
#   EVAL_EVERY=100 EVAL_EXAMPLES=256 LOOPS=1,2,4,8 SEED=1234
#   MODELS=full,full-window,nsa,gdn-window,gdn-nsa,full-gdn (names in configs/tasks/)
#   LT2=build-gpu/apps/lt2/lt2 DEVICE=cuda WORK=runs/gpu-tasks (a CPU smoke test: LT2=build/apps/lt2/lt2
#   DEVICE=cpu with a tiny budget)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
ROOT=$PWD/.deps/root/usr
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export OMP_NUM_THREADS=1  # each run is launch-bound: one CPU thread apiece
LT2=${LT2:-build-gpu/apps/lt2/lt2}
[[ -x $LT2 ]] || { echo "$LT2 not found: run STAGE=build scripts/gpu.sh first"; exit 1; }

BUDGET_S=${BUDGET_S:-360}
# 12 at a time: one CPU core each (these runs are launch-bound) with 4 of the 16 left for the
# driver and the OS, and two equal waves; more processes time-slice the one GPU harder.
JOBS=${JOBS:-12}
# 1000 steps: these tiny models are launch-bound on the GPU, so a step costs about its op count;
# the slowest cell (GDN+NSA, T 8) took 93 ms/step on the CPU at width 32 and batch 1 (op overhead
# alone), so ~0.1 s/step is expected and stage 1's whole budget fits in each run's guard.
STEPS_PER_STAGE=${STEPS_PER_STAGE:-1000}
STAGES=${STAGES:-5}
POOL=${POOL:-128}
BATCH=${BATCH:-128}
LR=${LR:-1e-3}
WARMUP=${WARMUP:-100}
EVAL_EVERY=${EVAL_EVERY:-100}
EVAL_EXAMPLES=${EVAL_EXAMPLES:-256}
LOOPS=${LOOPS:-1,2,4,8}
SEED=${SEED:-1234}
DEVICE=${DEVICE:-cuda}
MODELS=${MODELS:-full,full-window,nsa,gdn-window,gdn-nsa,full-gdn}
N_RUNS=$(( $(tr ',' '\n' <<< "$MODELS" | wc -l) * $(tr ',' '\n' <<< "$LOOPS" | wc -l) ))
WAVES=$(( (N_RUNS + JOBS - 1) / JOBS ))
# Each wave gets an equal share of the budget, less ~10 s of process and CUDA start-up and ~20 s
# for the tables at the end.
MAX_SECONDS=${MAX_SECONDS:-$(( (BUDGET_S - 20) / WAVES - 10 ))}

WORK=${WORK:-runs/gpu-tasks}
mkdir -p "$OUT/tasks" "$WORK"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/tasks/gpu.txt"
echo "swap-recall: $N_RUNS runs, $JOBS at a time ($WAVES wave(s)), budget $STEPS_PER_STAGE steps/stage," \
     "$STAGES stages (n 8..$(( 1 << (STAGES + 2) ))), pool $POOL, batch $BATCH, lr $LR, guard ${MAX_SECONDS} s/run" \
  | tee "$OUT/tasks/settings.txt"

specs=()
for m in ${MODELS//,/ }; do specs+=("$m=configs/tasks/$m.json"); done
t0=$(date +%s)
$LT2 tasks sweep --models "$(IFS=,; echo "${specs[*]}")" --loops "$LOOPS" \
  --task swap-recall --stages "$STAGES" --pool "$POOL" --steps-per-stage "$STEPS_PER_STAGE" \
  --eval-every "$EVAL_EVERY" --eval-examples "$EVAL_EXAMPLES" --batch-size "$BATCH" --lr "$LR" \
  --warmup "$WARMUP" --seed "$SEED" --device "$DEVICE" --log-every 100 --threads 1 \
  --jobs "$JOBS" --max-seconds "$MAX_SECONDS" --out "$WORK" > "$OUT/tasks/sweep.log" 2>&1
rc=$?
# Everything but the checkpoints.
(cd "$WORK" && find . -name results.json -o -name curve.png -o -name log.txt -o -name run_config.json \
   -o -name 'sweep.*' -o -name curves.png) | while read -r f; do
  mkdir -p "$OUT/tasks/$(dirname "$f")" && cp "$WORK/$f" "$OUT/tasks/$f"
done
echo "sweep: exit $rc, $(( $(date +%s) - t0 )) s wall"
grep -E "^(FAIL|done)" "$OUT/tasks/sweep.log" | grep -c "^done" | sed 's/^/runs completed: /'
grep -E "^FAIL" "$OUT/tasks/sweep.log" | head
[[ -f $OUT/tasks/sweep.md ]] && cat "$OUT/tasks/sweep.md" || tail -20 "$OUT/tasks/sweep.log"
exit $rc
