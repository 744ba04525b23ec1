#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (device tool) from the repo root with `.deps` carried (scripts/gpu_deps.sh):
# the training-speed benchmarks of the linear-time mixers, lt2 and its peer in the same call.
#   STAGES="layers peer train prefill"   which parts run (default: all; the peer runs last, within PEER_TIMEOUT s)
#   layers:  bench/mixer_bench, one layer (the lt2-gdn-1.3b shape) and the recurrence alone (--core),
#            forward and forward + backward, for MIXERS (gdn,kda,deltanet) at SHAPES (8x4096,1x32768); the
#            recurrent families at the 100M shape (16 x 2048); the GDN layer with TF32 off
#   peer:    bench/fla_peer.py, flash-linear-attention 0.6.0 from .deps/py, the same rows (PEER_MIXERS,
#            default MIXERS; Triton autotunes each kernel once per call, minutes: its compile cache
#            stays in .triton-cache while the machine is warm); PEER_PRECISION="bf16,autocast" times fla's
#            layer in bf16 and in mixer_bench's regime (fp32 weights under bf16 autocast) too
#   train:   bench/train_bench for TRAIN_MODELS (lt-100m,lt2-gdn-100m,lt2-full-gdn-100m) at seq 2048 x 16
#            and 8192 x 4 (the same tokens a step), with per-loop activation checkpointing
#   prefill: `lt2 bench prefill` of PREFILL_MODELS (lt2-gdn-1.3b,lt2-full-gdn-1.3b) at PREFILL_CONTEXTS, batch 1
# Writes $OUT/train_bench.jsonl (every RESULT line) and $OUT/train_bench.md (tables, lt2 / fla ratios).
# Builds build-gpu's lt2_cli, mixer_bench and train_bench first unless SKIP_BUILD=1 (already built this call).
# PREBUILT=build-prebuilt: the binaries scripts/prebuild_gpu.sh carried (BENCH="mixer_bench train_bench"), unpacked
# by scripts/gpu_batch.sh; no build. LAYER_EXTRAS=0 skips the layers stage's 100M-shape and TF32-off rows.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lt2_gpu_out}
mkdir -p "$OUT"
STAGES=${STAGES:-layers peer train prefill}
MIXERS=${MIXERS:-gdn,kda,deltanet}
SHAPES=${SHAPES:-8x4096,1x32768}
ROOT=$PWD/.deps/root/usr
export CMAKE_PREFIX_PATH="$ROOT:$ROOT/lib/x86_64-linux-gnu/cmake:$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export TRITON_CACHE_DIR=$PWD/.triton-cache
MIXER_BENCH=build-gpu/bench/mixer_bench TRAIN_BENCH=build-gpu/bench/train_bench LT2=build-gpu/apps/lt2/lt2
if [ -n "${PREBUILT:-}" ]; then
  MIXER_BENCH=$PREBUILT/mixer_bench TRAIN_BENCH=$PREBUILT/train_bench LT2=$PREBUILT/lt2 SKIP_BUILD=1
fi
B=build-gpu
JSONL=$OUT/train_bench.jsonl
: > "$JSONL"
has() { [[ " $STAGES " == *" $1 "* ]]; }
record() { grep '^RESULT' | sed 's/^RESULT //' | tee -a "$JSONL"; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  t0=$(date +%s)
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DLT2_SERVE=${LT2_SERVE:-OFF} -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > /tmp/tb_build.log 2>&1 &&
    cmake --build $B -j "$(nproc)" --target lt2_cli mixer_bench train_bench >> /tmp/tb_build.log 2>&1 ||
    { grep -E "error|Error" -A5 /tmp/tb_build.log | head -60; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi

if has layers; then
  for mixer in ${MIXERS//,/ }; do
    for shape in ${SHAPES//,/ }; do
      b=${shape%x*} t=${shape#*x}
      $MIXER_BENCH --model lt2-gdn-1.3b --mixer "$mixer" --batch "$b" --seq "$t" 2>&1 | record
      $MIXER_BENCH --core --mixer "$mixer" --batch "$b" --seq "$t" --heads 16 --head-k 96 --head-v 192 2>&1 | record
    done
  done
  # The 100M shape of results/mixer_layer_h200.json (before the chunk scan trained), every recurrent family.
  [ "${LAYER_EXTRAS:-1}" = 1 ] && for mixer in gdn kda mamba2 gla retnet; do
    $MIXER_BENCH --model lt2-full-gdn-100m --mixer $mixer --batch 16 --seq 2048 2>&1 | record
  done
  # TF32 off (the chunk products as fp32 FMAs): the A/B of TrainConfig::tf32 at the first shape.
  shape=${SHAPES%%,*}
  [ "${LAYER_EXTRAS:-1}" = 1 ] && $MIXER_BENCH --model lt2-gdn-1.3b --mixer gdn --batch "${shape%x*}" --seq "${shape#*x}" --tf32 0 2>&1 | record
fi


if has train; then
  models=${TRAIN_MODELS:-lt-100m,lt2-gdn-100m,lt2-full-gdn-100m}
  for model in ${models//,/ }; do
    for sb in 2048x16 8192x4; do
      $TRAIN_BENCH --model "$model" --seq-len "${sb%x*}" --batch-size "${sb#*x}" --steps "${TRAIN_STEPS:-12}" --checkpoint-loops \
        > /tmp/train_bench.log 2>&1
      record < /tmp/train_bench.log || tail -3 /tmp/train_bench.log
    done
  done
fi

if has prefill; then
  $LT2 bench prefill -m "${PREFILL_MODELS:-lt2-gdn-1.3b,lt2-full-gdn-1.3b}" \
    -c "${PREFILL_CONTEXTS:-4k,8k,16k,32k}" --json > /tmp/prefill.json 2> /tmp/prefill.err || tail -3 /tmp/prefill.err
  python3 -c "
import json
for c in json.load(open('/tmp/prefill.json'))['cells']:
    c['bench'] = 'prefill'; print('RESULT ' + json.dumps(c))" | record
fi

if has peer; then
  PYTHONPATH=$PWD/.deps/py timeout "${PEER_TIMEOUT:-300}" python3 bench/fla_peer.py --what layer,core --mixer "${PEER_MIXERS:-$MIXERS}" \
    --shape "$SHAPES" --precision "${PEER_PRECISION:-bf16}" 2>&1 | tee /tmp/fla_peer.log | record
  grep -v '^RESULT' /tmp/fla_peer.log | grep -iE "error|Traceback" -A3 | head -20
fi

python3 - "$JSONL" "$OUT/train_bench.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = []
lt2 = {(r["mixer"], "core" if r.get("model") == "core" else f"layer {r['model']}", r["batch"], r["seq"]): r
       for r in rows if "mixer" in r and "peer" not in r and r.get("tf32", True)}
fp32 = [r for r in rows if "mixer" in r and "peer" not in r and not r.get("tf32", True)]
fla = {(r["mixer"], "core" if r["what"] == "core" else "layer lt2-gdn-1.3b", r["batch"], r["seq"]): r
       for r in rows if "peer" in r}
if lt2:
    out += ["| mixer | what | batch x seq | lt2 fwd ms | fla fwd ms | lt2 fwd+bwd ms | fla fwd+bwd ms | fwd+bwd lt2/fla |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, r in lt2.items():
        p = fla.get(key)
        f = lambda x: f"{x:.2f}" if x is not None else "—"
        out.append(f"| {key[0]} | {key[1]} | {key[2]} x {key[3]} | {f(r['forward_ms'])} | {f(p and p['forward_ms'])} | "
                   f"{f(r['forward_backward_ms'])} | {f(p and p['forward_backward_ms'])} | "
                   f"{f(p and r['forward_backward_ms'] / p['forward_backward_ms'])} |")
for r in fp32:
    out.append(f"| {r['mixer']} | layer, TF32 off | {r['batch']} x {r['seq']} | {r['forward_ms']:.2f} | — | "
               f"{r['forward_backward_ms']:.2f} | — | — |")
train = [r for r in rows if "median_step_ms" in r]
if train:
    out += ["", "| model | seq x batch | ms/step | tokens/s | MFU |", "| --- | --- | ---: | ---: | ---: |"]
    for r in train:
        out.append(f"| {r['model']} | {r['seq_len']} x {r['batch_size']} | {r['median_step_ms']:.1f} | "
                   f"{r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% |")
pre = [r for r in rows if r.get("bench") == "prefill"]
if pre:
    out += ["", "| prefill model | context | tokens/s |", "| --- | ---: | ---: |"]
    out += [f"| {r['model']} | {r['context']} | {r['tokens_per_s']:.0f} |" for r in pre]
open(sys.argv[2], "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY
