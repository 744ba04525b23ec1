#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (the device tool's command): one call that tests a prebuilt tree's per-channel
# gate kernels (the chunk preparation with one decay per key channel, the C 64 score kernels on tensor
# cores) and measures the KDA and GLA layers against a baseline, through scripts/gpu_batch.sh (each step
# under its own limit, results packed after each). Carry .deps/build-prebuilt.tar.xz (the tree under test)
# and the baseline tarball.
#   BASE_TARBALL=.deps/build-<commit>.tar.xz   the baseline's binaries (scripts/prebuild_gpu.sh; required)
# Steps: the delta-rule and score tests first (a kernel fault ends the test process: the rest of the suite
# runs as its own step after the timings); the KDA and GLA layers at the 1.3B shape (d 2048, 8 x 4096), the
# baseline and the new tree with channel_gate_prepare off and on, two rounds; a per-kernel profile of each
# layer on the new tree; the rest of the GPU suite. About 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${BASE_TARBALL:?BASE_TARBALL: the baseline tarball of scripts/prebuild_gpu.sh}"
first='DeltaRuleScan.*:ChannelScoresGpu.*'
bench='--model lt2-gdn-1.3b --batch 8 --seq 4096'
steps=(
  "channel_tests 200 GTEST_FILTER='$first' STAGES=test PREBUILT=build-prebuilt scripts/gpu_infer.sh"
  "layers 200 mkdir -p /tmp/channel_base && python3 -c \"import tarfile; tarfile.open('$BASE_TARBALL').extractall('/tmp/channel_base')\" &&
     for i in 1 2; do for m in kda gla; do echo base \$m; /tmp/channel_base/build-prebuilt/mixer_bench $bench --iters 5 --mixer \$m |
     grep RESULT; for o in 0 1; do echo new \$m channel_gate_prepare=\$o; build-prebuilt/mixer_bench $bench --iters 5 --mixer \$m
     --option channel_gate_prepare=\$o | grep RESULT; done; done; done"
  "profile 100 for m in kda gla; do build-prebuilt/mixer_bench $bench --iters 3 --mixer \$m --profile 1; done"
  "rest_tests 250 GTEST_FILTER='-$first' STAGES=test PREBUILT=build-prebuilt scripts/gpu_infer.sh")
# A step is one line for gpu_batch.sh: fold the continuation lines above.
for i in "${!steps[@]}"; do steps[$i]=$(echo "${steps[$i]}" | tr '\n' ' ' | tr -s ' '); done
exec scripts/gpu_batch.sh "${steps[@]}"
