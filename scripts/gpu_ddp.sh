#!/usr/bin/env bash
# Data-parallel scaling (issue 8). Runs ON a multi-GPU machine (device kind nvidia-h200-x2, -x4 or
# -x8) from the repo root, with `.deps` and `data/austen/shards` carried (make them here with
# scripts/gpu_deps.sh and scripts/demo.sh). Builds lt2, trains MODEL data-parallel over NCCL on
# 1, 2, 4, ... GPUs (up to the GPUs present, or GPUS=1,2) with the same global batch (GRAD_ACCUM
# micro-batches of BATCH x SEQ tokens, shared out over the ranks), and reports the median
# tokens/s of the steps after the first WARMUP_STEPS and the scaling efficiency against one GPU:
# $OUT/ddp_scaling.json and .md, one run log per GPU count.
#   MODEL=lt-100m STEPS=20 WARMUP_STEPS=5 BATCH=16 SEQ=2048 GRAD_ACCUM=8 LT2=build-gpu/apps/lt2/lt2 DEVICE=cuda
#   (a CPU smoke test: LT2=build/apps/lt2/lt2 DEVICE=cpu MODEL=tiny-full GPUS=1,2 BATCH=2 SEQ=64 STEPS=4 WARMUP_STEPS=1 GRAD_ACCUM=2)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
MODEL=${MODEL:-lt-100m} STEPS=${STEPS:-20} WARMUP_STEPS=${WARMUP_STEPS:-5}
BATCH=${BATCH:-16} SEQ=${SEQ:-2048} GRAD_ACCUM=${GRAD_ACCUM:-8} DEVICE=${DEVICE:-cuda}
LT2=${LT2:-build-gpu/apps/lt2/lt2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ ! -x $LT2 ]]; then
  ROOT=$PWD/.deps/root/usr
  export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
  export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} > /tmp/ddp_build.log 2>&1 &&
    cmake --build build-gpu -j "$(nproc)" --target lt2_cli >> /tmp/ddp_build.log 2>&1 ||
    { grep -E "error" -A5 /tmp/ddp_build.log | head -40; exit 1; }
fi
if [[ -z ${GPUS:-} ]]; then
  n=$(nvidia-smi -L | wc -l); GPUS=1
  for k in 2 4 8; do (( k <= n )) && GPUS+=",$k"; done
fi
DATA=data/austen/shards
rows=()
for n in ${GPUS//,/ }; do
  run=/tmp/ddp_run_$n; rm -rf "$run"
  "$LT2" train --model "$MODEL" --train-data $DATA/train.bin --out "$run" --device "$DEVICE" --steps "$STEPS" \
    --seq-len "$SEQ" --batch-size "$BATCH" --grad-accum "$GRAD_ACCUM" --warmup 2 --log-every 1 --eval-every 0 \
    --save-every 0 --nproc "$n" > "$OUT/ddp_$n.log" 2>&1 || { echo "nproc $n failed:"; tail -5 "$OUT/ddp_$n.log"; continue; }
  rows+=("$n $(python3 - "$run/metrics.jsonl" "$WARMUP_STEPS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
print(statistics.median(r["tokens_per_s"] for r in rows if r["step"] > int(sys.argv[2])))
PY
)")
done
python3 - "$OUT" "$MODEL" "$BATCH" "$SEQ" "$GRAD_ACCUM" "$STEPS" "${rows[@]}" <<'PY'
import json, sys, datetime
out, model, batch, seq, accum, steps, *rows = sys.argv[1:]
res = [dict(gpus=int(r.split()[0]), tokens_per_s=float(r.split()[1])) for r in rows]
base = next((r["tokens_per_s"] for r in res if r["gpus"] == 1), None)
for r in res:
    r["efficiency"] = r["tokens_per_s"] / (base * r["gpus"]) if base else None
meta = dict(model=model, global_batch_tokens=int(batch) * int(accum) * int(seq), steps=int(steps),
            date=str(datetime.date.today()), runs=res)
json.dump(meta, open(f"{out}/ddp_scaling.json", "w"), indent=2)
md = [f"{model}, global batch {meta['global_batch_tokens']} tokens, median tokens/s after warm-up\n",
      "| GPUs | tokens/s | scaling efficiency |", "|---:|---:|---:|"]
md += [f"| {r['gpus']} | {r['tokens_per_s']:.0f} | {100 * r['efficiency']:.0f}% |" if r["efficiency"] else
       f"| {r['gpus']} | {r['tokens_per_s']:.0f} | |" for r in res]
open(f"{out}/ddp_scaling.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
