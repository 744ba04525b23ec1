#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (the device tool's command): one call that tests a prebuilt tree and measures it
# against two baselines, through scripts/gpu_batch.sh (each step under its own limit, results packed after
# each). Carry .deps/build-prebuilt.tar.xz (the tree under test) and the two baseline tarballs.
#   MID_TARBALL=.deps/build-<commit>.tar.xz   the baseline the new tree is A/B'd against (required)
#   OLD_TARBALL=.deps/build-<commit>.tar.xz   an older baseline: MID is A/B'd against it first (optional)
# Steps: the GPU suite; train_bench A/Bs (MID against OLD, then build-prebuilt against MID) of lt-100m and
# lt2-gdn-100m at seq 2048 x 16 and 8192 x 4; the GDN and full-attention layers at the 1.3B shape, MID and
# new alternating; the lt2-gdn-1.3b prefill A/B at 8k and 32k with a profile; train_bench --profile-ops of
# both models; the scan's value block at the 8k prefill and at lt2-gdn-100m's 8192 x 4 layer (the decode option
# scan_value_block: branch gpu-pending). About 9 minutes with OLD_TARBALL; the device's limit a call is 10.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${MID_TARBALL:?MID_TARBALL: the baseline tarball of scripts/prebuild_gpu.sh}"
steps=("tests 200 STAGES=test PREBUILT=build-prebuilt scripts/gpu_infer.sh")
[ -n "${OLD_TARBALL:-}" ] &&
  steps+=("midab 150 BASE_TARBALL=$OLD_TARBALL NEW_TARBALL=$MID_TARBALL ARMS='base new' STEPS=5 scripts/gpu_train_ab.sh")
steps+=(
  "newab 200 BASE_TARBALL=$MID_TARBALL STEPS=5 scripts/gpu_train_ab.sh"
  "layer 80 for i in 1 2; do for m in gdn full; do for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do
     echo \$b \$m; \$b/mixer_bench --model lt2-gdn-1.3b --mixer \$m --batch 8 --seq 4096 --iters 5 | grep RESULT;
     done; done; done"
  "prefill 150 BASE_TARBALL=$MID_TARBALL CONTEXTS=8192,32768 PROFILE_CONTEXTS=8192 scripts/gpu_prefill_ab.sh"
  "profile 120 for m in lt-100m lt2-gdn-100m; do build-prebuilt/train_bench --model \$m --seq-len 2048
     --batch-size 16 --steps 4 --warm 2 --checkpoint-loops --profile 1 --profile-ops; done"
  "scanvb 90 for vb in 8 16 32 0; do echo scan_value_block=\$vb; build-prebuilt/lt2 bench prefill -m lt2-gdn-1.3b
     -c 8192 --decode-option scan_value_block=\$vb | grep prefill; build-prebuilt/mixer_bench --model lt2-gdn-100m
     --mixer gdn --batch 4 --seq 8192 --iters 3 --option scan_value_block=\$vb | grep RESULT; done")
# A step is one line for gpu_batch.sh: fold the continuation lines above.
for i in "${!steps[@]}"; do steps[$i]=$(echo "${steps[$i]}" | tr '\n' ' ' | tr -s ' '); done
exec scripts/gpu_batch.sh "${steps[@]}"
