#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (the device tool's command): one call that tests a prebuilt tree and measures it
# against two baselines, through scripts/gpu_batch.sh (each step under its own limit, results packed after
# each). Carry .deps/build-prebuilt.tar.xz (the tree under test) and the two baseline tarballs.
#   MID_TARBALL=.deps/build-<commit>.tar.xz   the baseline the new tree is A/B'd against
#   MID_SOURCE=.deps/<name>-src.tar.gz         or its source archive (git archive <commit> | gzip): its
#                                              train_bench and mixer_bench build here in the background from the
#                                              call's start (scripts/gpu_build_baseline.sh, ~2-3 min beside the
#                                              tests); the steps that read MID (gated, dsa, dsasparse, gdnauto,
#                                              layer) wait for it; newab, dsaprefill, midab and prefill need
#                                              MID_TARBALL
#   OLD_TARBALL=.deps/build-<commit>.tar.xz   an older baseline: MID is A/B'd against it first (optional)
#   ONLY="tests newab ..."                     run only these steps, in this order (default: all, in their order below)
# Steps: the GPU suite in two parts (`tests`, then `chunk_tests`: the delta-rule and score kernels' tests,
# where a kernel fault would end the test process), or `focus`: the tests FOCUS_FILTER names; a train_bench A/B (build-prebuilt against MID) of lt-100m
# and lt2-gdn-100m at seq 2048 x 16 and 8192 x 4 (`newab`); `gated`: the gated linear family on the
# preparation kernel's additive mode against the libtorch form (switch gated_linear_prepare, same binary: the
# recurrence alone at 8 x 4096 with 16 heads of 128, and the Mamba2 and RetNet layers at the 1.3B shape),
# lt-100m with Mamba2 layers trained by MID and by the new tree, the GDN layer with the chunk outputs'
# backward kernel off and on, and the KDA and GLA layers at the 1.3B shape by MID and by the new tree with
# channel_gate_prepare off and on; `layerprof`: that GDN layer's per-kernel profile by operator; `dsa`: DSA
# training (lt-100m with DSA layers, MID against the new tree, indexer stage off) and the DSA layer with the
# selection's kernels off and on; `dsasparse`: the indexer loss's sparse stage, MID against the new tree,
# and its profile; `mixtrain`: lt-100m with DSA, KDA, GLA and Mamba2 layers (MIXTRAIN_PATTERNS), MID against
# the new tree; `gdnauto`: lt2-gdn-100m under auto checkpointing, MID against the new tree; `fullgdn`:
# lt2-full-gdn-100m against lt2-gdn-100m by the new tree; `ltauto`: lt-100m under auto by the new tree, and
# its profile; `mixprof`: profiles of lt-100m with Mamba2 and KDA layers; `gdnprof`: lt2-gdn-100m's
# profile; `prefill32`: the 1.3B GDN and hybrid prefill at 4k-32k; `resnorm`: the residual_norm switch
# off and on (same binary); `ncu`: Nsight Compute on the delta rule's kernels; `ncudsa`: on DSA's indexer
# backward; `ncuprep`: on the delta rule's preparation backward; `prepab`: the delta-rule layers, MID against
# the new tree; `table`: the per-mixer training table;
# `ceab`: lt-100m with the cross-entropy kernel off and on (same binary); `gateab`: the chunk gate kernels
# off and on; `lsgab`: the log-sigmoid gate kernels off and on (HGRN2, GLA); `scaleab`: Mamba2's scaled
# values' kernels off and on; `rowsab`: the score kernels on token rows off and on (GLA, KDA, HGRN2, or
# ROWSAB_PATTERNS); `pairab`: KDA's two scores in one pass each way off and on (or PAIRAB_PATTERNS);
# `gsab`: NSA's branch combination kernels off and on; `sliceab`: the preparation backward's gradients of q,
# k and v in one buffer with the projection's width off and on (GLA, or SLICEAB_PATTERNS); `sparseab`: lt-100m with DSA and NSA layers (or SPARSEAB_PATTERNS) at both shapes, MID
# against the new tree; `nsa8k`: lt-100m/nsa at 8192 x 4; `dsaprof8k`: lt-100m/dsa's profile at 8192 x 4;
# `nsaprof`: lt-100m/nsa's profile at 2048 x 16; `nsaab`: NSA's selection and mask kernels off and on at both
# shapes (or NSAAB_PATTERNS); `prodab`: the scan backward's products kernel off and on;
# `prodprof`: lt2-gdn-100m's profile with it off and on;
# `dsaprefill`: lt2-gdn-dsa-1.3b's prefill A/B; `midab`: the newab A/B of MID
# against OLD; `layer`: the GDN and full-attention layers at the 1.3B shape, MID and new alternating;
# `prefill`: the lt2-gdn-1.3b prefill A/B at 8k and 32k with a profile; `profile`: train_bench --profile-ops
# of both models. About 12 minutes with OLD_TARBALL, more than the device's limit a call: the later steps
# are cut (gpu_batch.sh packs the results after each step); ONLY picks the rest for a second call.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${MID_TARBALL:-}${MID_SOURCE:-}" ] ||
  { echo "MID_TARBALL (a scripts/prebuild_gpu.sh tarball) or MID_SOURCE (a source archive): the baseline" >&2; exit 2; }
MID_TARBALL=${MID_TARBALL:-}
chunk_tests='DeltaRuleScan.*:ChannelScoresGpu.*'
# MID unpacked where the steps after newab read it, if newab did not run.
mid=/tmp/train_ab_base/build-prebuilt
unpack_mid="[ -x $mid/mixer_bench ] || { mkdir -p /tmp/train_ab_base && python3 -c \"import tarfile;
  tarfile.open('$MID_TARBALL').extractall('/tmp/train_ab_base')\"; };"
if [ -z "$MID_TARBALL" ]; then
  # MID builds from its source beside the first steps (at low priority: the GPU tests' host threads come
  # first; at full priority the build slowed the suite past its limit); the steps that read MID wait for it.
  rm -f /tmp/baseline.done
  setsid nohup nice -n 19 bash -c "SOURCE=$MID_SOURCE scripts/gpu_build_baseline.sh; touch /tmp/baseline.done" \
    > /tmp/baseline_run.log 2>&1 < /dev/null &
  unpack_mid="[ -x $mid/mixer_bench ] || { while [ ! -e /tmp/baseline.done ]; do sleep 2; done; cat /tmp/baseline_run.log;
    [ -x /tmp/baseline/build/bench/mixer_bench ] && mkdir -p /tmp/train_ab_base && ln -sfn /tmp/baseline/build/bench $mid; };"
fi
steps=("tests 150 GTEST_FILTER='-$chunk_tests' STAGES=test PREBUILT=build-prebuilt scripts/gpu_infer.sh"
  "chunk_tests 150 GTEST_FILTER='$chunk_tests' STAGES=test PREBUILT=build-prebuilt scripts/gpu_infer.sh"
  "focus 150 GTEST_FILTER='${FOCUS_FILTER:-$chunk_tests}' STAGES=test PREBUILT=build-prebuilt scripts/gpu_infer.sh")
steps+=(
  "newab 200 BASE_TARBALL=$MID_TARBALL STEPS=5 scripts/gpu_train_ab.sh"
  "gated 160 $unpack_mid for m in mamba2 linear; do for o in 0 1; do echo core \$m gated_linear_prepare=\$o;
     build-prebuilt/mixer_bench --core --mixer \$m --batch 8 --seq 4096 --heads 16 --head-k 128 --head-v 128
     --iters 5 --option gated_linear_prepare=\$o | grep RESULT; done; done;
     for m in mamba2 retnet; do for o in 0 1; do echo layer \$m gated_linear_prepare=\$o;
     build-prebuilt/mixer_bench --model lt2-gdn-1.3b --mixer \$m --batch 8 --seq 4096 --iters 5
     --option gated_linear_prepare=\$o | grep RESULT; done; done;
     for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do echo \$b mamba2; \$b/train_bench --model lt-100m
     --pattern mamba2 --seq-len 2048 --batch-size 16 --steps 5 --warm 2 --checkpoint-loops=auto | grep RESULT; done;
     for i in 1 2; do for o in 0 1; do echo layer gdn delta_rule_output_backward=\$o; build-prebuilt/mixer_bench
     --model lt2-gdn-1.3b --mixer gdn --batch 8 --seq 4096 --iters 5 --option delta_rule_output_backward=\$o |
     grep RESULT; done; done;
     for m in kda gla; do echo layer \$m MID; /tmp/train_ab_base/build-prebuilt/mixer_bench --model lt2-gdn-1.3b
     --mixer \$m --batch 8 --seq 4096 --iters 5 | grep RESULT; for o in 0 1; do echo layer \$m channel_gate_prepare=\$o;
     build-prebuilt/mixer_bench --model lt2-gdn-1.3b --mixer \$m --batch 8 --seq 4096 --iters 5
     --option channel_gate_prepare=\$o | grep RESULT; done; done"
  )
# The GDN layer's kernels named by their launching operators: where its elementwise passes come from.
steps+=("layerprof 60 build-prebuilt/mixer_bench --model lt2-gdn-1.3b --mixer gdn --batch 8 --seq 4096 --iters 3
  --profile 1 --profile-ops")
# DSA: lt-100m with DSA layers trained by MID and by the new tree, indexer stage off, at 2048 x 16 (every key
# selected: causal) and 8192 x 4 (top-2048 of up to 8192); the DSA layer at the 1.3B shape (8 x 4096, stage
# off) by MID and by the new tree with the selection's kernels off and on.
dsa_train="--model lt-100m --pattern dsa --steps 4 --warm 2 --checkpoint-loops=auto"
steps+=("dsa 200 $unpack_mid for shape in '2048 16' '8192 4'; do set -- \$shape;
     for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do echo \$b dsa \$1 x \$2 off; \$b/train_bench $dsa_train
     --seq-len \$1 --batch-size \$2 | grep RESULT; done; done;
     echo layer dsa MID; /tmp/train_ab_base/build-prebuilt/mixer_bench --model lt2-gdn-1.3b --mixer dsa --batch 8 --seq 4096
     --iters 5 | grep RESULT; for o in 0 1; do echo layer dsa dsa_index_kernels=\$o; build-prebuilt/mixer_bench --model
     lt2-gdn-1.3b --mixer dsa --batch 8 --seq 4096 --iters 5 --option dsa_index_kernels=\$o | grep RESULT; done")
# DSA's sparse stage (the indexer loss) by MID and by the new tree, alternating, at both shapes
# (DSASPARSE_SHAPES="'2048 16'" for one, DSASPARSE_PROFILE=0 without the profile; the new
# tree with the train_bench flags in NEW_OPTS, e.g. "--option residual_norm=0", to leave a change out);
# then the new tree's per-operator profile of it at 2048 x 16.
steps+=("dsasparse 300 $unpack_mid for shape in ${DSASPARSE_SHAPES:-'2048 16' '8192 4'}; do set -- \$shape;
     for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do extra=; [ \$b = build-prebuilt ] && extra='${NEW_OPTS:-}';
     echo \$b dsa \$1 x \$2 sparse \$extra; \$b/train_bench $dsa_train --seq-len \$1 --batch-size \$2
     --indexer-stage sparse \$extra | grep RESULT; done; done;
     [ '${DSASPARSE_PROFILE:-1}' = 0 ] ||
     build-prebuilt/train_bench $dsa_train --seq-len 2048 --batch-size 16 --indexer-stage sparse --profile 1 --profile-ops |
     grep -v '^RESULT'")
# lt-100m with other mixers' layers (MIXTRAIN_PATTERNS, default DSA with its indexer stage off, KDA, GLA and
# Mamba2) at 2048 x 16 under auto, MID and the new tree alternating: what the mixers' input handling gives.
steps+=("mixtrain 240 $unpack_mid for m in ${MIXTRAIN_PATTERNS:-dsa kda gla mamba2}; do
     for b in /tmp/train_ab_base/build-prebuilt build-prebuilt build-prebuilt /tmp/train_ab_base/build-prebuilt; do
     echo \$b \$m 2048 x 16 auto; \$b/train_bench --model lt-100m --pattern \$m --seq-len 2048 --batch-size 16 --steps 4
     --warm 2 --checkpoint-loops=auto | grep RESULT; done; done")
# lt2-gdn-100m under `lt2 train`'s default checkpointing (auto) by MID and by the new tree, alternating, at
# both shapes: what the block's bf16 norms and the GDN layer's changes give where auto stores what fits.
steps+=("gdnauto 200 $unpack_mid for shape in '2048 16' '8192 4'; do set -- \$shape;
     for b in /tmp/train_ab_base/build-prebuilt build-prebuilt build-prebuilt /tmp/train_ab_base/build-prebuilt; do
     echo \$b gdn \$1 x \$2 auto; \$b/train_bench --model lt2-gdn-100m --seq-len \$1 --batch-size \$2 --steps 4
     --warm 2 --checkpoint-loops=auto | grep RESULT; done; done")
# Issue 23's hybrid criterion: lt2-full-gdn-100m against lt2-gdn-100m by the new tree under auto at both
# shapes, alternating (the hybrid within 10% of the GDN model asked).
steps+=("fullgdn 200 for shape in '2048 16' '8192 4'; do set -- \$shape; for m in lt2-gdn-100m lt2-full-gdn-100m
     lt2-full-gdn-100m lt2-gdn-100m; do echo \$m \$1 x \$2 auto; build-prebuilt/train_bench --model \$m --seq-len \$1
     --batch-size \$2 --steps 4 --warm 2 --checkpoint-loops=auto | grep RESULT; done; done")
# lt-100m by the new tree under auto at 2048 x 16, twice: its tokens/s and MFU on this device; then its
# per-operator profile.
steps+=("ltauto 120 for i in 1 2; do echo lt-100m 2048 x 16 auto; build-prebuilt/train_bench --model lt-100m
     --seq-len 2048 --batch-size 16 --steps 4 --warm 2 --checkpoint-loops=auto | grep RESULT; done;
     build-prebuilt/train_bench --model lt-100m --seq-len 2048 --batch-size 16 --steps 3 --warm 1
     --checkpoint-loops=auto --profile 1 --profile-ops | grep -v '^RESULT'")
# lt2-gdn-100m's per-operator profile by the new tree at 2048 x 16 under auto: where the GDN model's step
# goes beside lt-100m's.
steps+=("gdnprof 90 build-prebuilt/train_bench --model lt2-gdn-100m --seq-len 2048 --batch-size 16 --steps 3 --warm 1
     --checkpoint-loops=auto --profile 1 --profile-ops | grep -v '^RESULT'")
# Issue 23's prefill criterion: lt2-gdn-1.3b and lt2-full-gdn-1.3b by the new tree at 4k to 32k, batch 1, bf16.
steps+=("prefill32 150 build-prebuilt/lt2 bench prefill -m lt2-gdn-1.3b,lt2-full-gdn-1.3b -c 4096,8192,16384,32768
     --out-json \$OUT/prefill.json --out-md \$OUT/prefill.md")
# A kernel switch off and on in one binary, alternating (0 1 1 0): lt-100m with each of the layer patterns
# at 2048 x 16 under auto. switch_ab NAME SECONDS SWITCH PATTERN...
switch_ab() {
  local name=$1 seconds=$2 switch=$3
  shift 3
  echo "$name $seconds for m in $*; do for o in 0 1 1 0; do echo lt-100m \$m $switch=\$o;
     build-prebuilt/train_bench --model lt-100m --pattern \$m --seq-len 2048 --batch-size 16 --steps 4 --warm 2
     --checkpoint-loops=auto --option $switch=\$o | grep RESULT; done; done"
}
# The LM head loss's cross-entropy kernel; the chunk gate kernels (KDA, or GATEAB_PATTERNS); the log-sigmoid
# gate kernels (HGRN2, GLA); Mamba2's scaled-values kernels; the score kernels on token rows; KDA's two
# scores in one pass each way; GLA's gradients in one shared buffer; NSA's gated sum of its branches.
steps+=("$(switch_ab ceab 120 cross_entropy_kernel full)"
  "$(switch_ab gateab 150 chunk_gate ${GATEAB_PATTERNS:-kda})"
  "$(switch_ab lsgab 200 log_sigmoid_gate hgrn2 gla)"
  "$(switch_ab scaleab 120 scale_heads mamba2)"
  "$(switch_ab rowsab 240 channel_score_rows ${ROWSAB_PATTERNS:-gla kda hgrn2})"
  "$(switch_ab pairab 150 channel_score_pairs ${PAIRAB_PATTERNS:-kda})"
  "$(switch_ab sliceab 150 shared_slice_gradients ${SLICEAB_PATTERNS:-gla})"
  "$(switch_ab gsab 150 gated_sum nsa)")
# NSA's selection and its masks on their kernels, off and on in one binary: lt-100m with NSA layers (or
# NSAAB_PATTERNS) at 2048 x 16 and 8192 x 4 under auto.
# NSAAB_SWITCH names the switch (default nsa_selection_kernels; gated_sum: the branches' combination),
# NSAAB_SHAPES the shapes (default "'2048 16' '8192 4'").
steps+=("nsaab 300 for m in ${NSAAB_PATTERNS:-nsa}; do for shape in ${NSAAB_SHAPES:-"'2048 16' '8192 4'"}; do set -- \$shape;
     for o in 0 1 1 0; do echo lt-100m \$m \$1 x \$2 ${NSAAB_SWITCH:-nsa_selection_kernels}=\$o; build-prebuilt/train_bench
     --model lt-100m --pattern \$m --seq-len \$1 --batch-size \$2 --steps 4 --warm 2 --checkpoint-loops=auto
     --option ${NSAAB_SWITCH:-nsa_selection_kernels}=\$o | grep RESULT; done; done; done")
# The chunk scan's backward products in one kernel, off and on in one binary: lt2-gdn-100m, and lt-100m with
# KDA layers (PRODAB_MODELS: train_bench's model arguments, quoted each).
steps+=("prodab 240 for c in ${PRODAB_MODELS:-"'lt2-gdn-100m' 'lt-100m --pattern kda'"}; do for o in 0 1 1 0;
     do echo \$c scan_backward_products=\$o; build-prebuilt/train_bench --model \$c --seq-len 2048 --batch-size 16
     --steps 4 --warm 2 --checkpoint-loops=auto --option scan_backward_products=\$o | grep RESULT; done; done")
# lt2-gdn-100m's per-operator profile with the scan backward's kernels off and on: each kernel's time against
# the batched products, row dots and negations it replaces.
steps+=("prodprof 120 for o in 0 1; do echo lt2-gdn-100m scan_backward_products=\$o; build-prebuilt/train_bench
     --model lt2-gdn-100m --seq-len 2048 --batch-size 16 --steps 3 --warm 1 --checkpoint-loops=auto --profile 1
     --profile-ops --option scan_backward_products=\$o | grep -v '^RESULT'; done")
# lt-100m with DSA (indexer stage off) and NSA layers at 2048 x 16 and 8192 x 4, MID against the new tree
# (one run each; a run that fails prints its message): the sparse mixers' training blocks and masks.
steps+=("sparseab 300 $unpack_mid for m in ${SPARSEAB_PATTERNS:-dsa nsa}; do for shape in '2048 16' '8192 4'; do set -- \$shape;
     for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do echo \$b \$m \$1 x \$2; \$b/train_bench --model lt-100m
     --pattern \$m --seq-len \$1 --batch-size \$2 --steps 4 --warm 2 --checkpoint-loops=auto 2>&1 |
     grep -E '^RESULT|^train_bench:'; done; done; done")
# The sparse mixers at 8192 x 4 by the new tree: NSA's run with its error message where it fails, and
# lt-100m/dsa's per-operator profile (where its step goes when the top-k selects a quarter of the keys).
steps+=("nsa8k 90 build-prebuilt/train_bench --model lt-100m --pattern nsa --seq-len 8192 --batch-size 4 --steps 2
     --warm 1 --checkpoint-loops=auto 2>&1 | tail -4"
  "dsaprof8k 150 build-prebuilt/train_bench --model lt-100m --pattern dsa --seq-len 8192 --batch-size 4 --steps 3
     --warm 1 --checkpoint-loops=auto --profile 1 --profile-ops | grep -v '^RESULT'"
  "nsaprof 120 build-prebuilt/train_bench --model lt-100m --pattern nsa --seq-len 2048 --batch-size 16 --steps 3
     --warm 1 --checkpoint-loops=auto --profile 1 --profile-ops | grep -v '^RESULT'")
# Per-operator profiles of lt-100m with Mamba2 and with KDA layers (MIXPROF_PATTERNS) by the new tree at
# 2048 x 16 under auto: where the mixers furthest below lt-100m spend their steps.
steps+=("mixprof 150 for m in ${MIXPROF_PATTERNS:-mamba2 kda}; do build-prebuilt/train_bench --model lt-100m --pattern \$m
     --seq-len 2048 --batch-size 16 --steps 3 --warm 1 --checkpoint-loops=auto --profile 1 --profile-ops; done")
# The block's residual add inside the FFN norm's kernels (switch residual_norm), same binary, off and on
# alternating: lt-100m and lt2-gdn-100m at 2048 x 16 under auto.
steps+=("resnorm 160 for m in lt-100m lt2-gdn-100m; do for o in 0 1 1 0; do echo \$m residual_norm=\$o;
     build-prebuilt/train_bench --model \$m --seq-len 2048 --batch-size 16 --steps 4 --warm 2 --checkpoint-loops=auto
     --option residual_norm=\$o | grep RESULT; done; done")
# Nsight Compute on the delta rule's kernels at lt2-gdn-100m's shape: the first 4 forward launches (the
# benchmark warms up forward first: gates, preparation, scan, outputs), then the first 3 whose names say
# backward (the preparation's and the outputs' backward, the row dots): throughput against the device's,
# occupancy, warp stalls.
ncu_sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
     --section WarpStateStats --section SchedulerStats"
steps+=("ncu 150 NCU=\$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1);
     for k in 'delta_rule -c 4' 'backward|row_dots -c 3'; do set -- \$k; \$NCU --clock-control none -k regex:\"\$1\" \$2 \$3
     $ncu_sections build-prebuilt/mixer_bench --model lt2-gdn-100m --mixer gdn --batch 16 --seq 2048 --iters 1; done")
# Nsight Compute on DSA's indexer backward (the dkeys and dq kernels, one launch each) in lt-100m/dsa's sparse stage
# at 2048 x 16: the same sections. Checkpointing forced on: `auto` would first measure steps of 1 and 2 rows,
# whose launches ncu's -c 1 would catch.
steps+=("ncudsa 120 NCU=\$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1);
     for k in dsa_index_dkeys dsa_index_dq; do \$NCU --clock-control none -k regex:\$k -c 1 $ncu_sections
     build-prebuilt/train_bench --model lt-100m --pattern dsa --steps 1 --warm 0 --checkpoint-loops --seq-len 2048
     --batch-size 16 --indexer-stage sparse |
     grep -v '^RESULT'; done")
# Nsight Compute on the delta rule's preparation backward at lt2-gdn-100m's shape (one launch), with the
# compute and instruction sections too: what bounds the largest delta-rule kernel of its training step.
steps+=("ncuprep 90 NCU=\$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1);
     \$NCU --clock-control none -k regex:delta_rule_prepare_backward -c 1 $ncu_sections --section ComputeWorkloadAnalysis
     --section InstructionStats build-prebuilt/mixer_bench --model lt2-gdn-100m --mixer gdn --batch 16 --seq 2048 --iters 1")
# The delta rule's layers, MID and the new tree alternating: GDN at lt2-gdn-100m's shape (16 x 2048) and at
# the 1.3B shape (8 x 4096), and KDA (the per-channel preparation) at the 1.3B shape.
steps+=("prepab 150 $unpack_mid for i in 1 2; do for c in 'lt2-gdn-100m gdn 16 2048' 'lt2-gdn-1.3b gdn 8 4096'
     'lt2-gdn-1.3b kda 8 4096'; do set -- \$c; for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do
     echo \$b \$1 \$2 \$3 x \$4; \$b/mixer_bench --model \$1 --mixer \$2 --batch \$3 --seq \$4 --iters 5 | grep RESULT;
     done; done; done")
# Issue 24's per-mixer training table of the new tree under auto (scripts/gpu_train_table.sh) at TABLE_SHAPES
# (default 2048x16; TABLE_S the step's limit, default 420).
steps+=("table ${TABLE_S:-420} T=build-prebuilt/train_bench SHAPES=${TABLE_SHAPES:-2048x16} STEPS=4 WARM=2 RUN_S=40 scripts/gpu_train_table.sh")
# lt2-gdn-dsa-1.3b prefill (DSA's selection and sparse attention on the kernels) against MID at 8k and 32k.
steps+=("dsaprefill 150 BASE_TARBALL=$MID_TARBALL MODEL=lt2-gdn-dsa-1.3b CONTEXTS=8192,32768 ARMS='base new new base'
  PROFILE_CONTEXTS=32768 scripts/gpu_prefill_ab.sh")
# MID against OLD after the new tree's steps (the call's limit may cut the steps that follow), unpacked
# apart: /tmp/train_ab_base keeps MID for the steps after.
[ -n "${OLD_TARBALL:-}" ] && steps+=("midab 150 BASE_TARBALL=$OLD_TARBALL NEW_TARBALL=$MID_TARBALL
  BASE_DIR=/tmp/train_ab_old ARMS='base new' STEPS=5 scripts/gpu_train_ab.sh")
steps+=(
  "layer 80 $unpack_mid for i in 1 2; do for m in gdn full; do for b in /tmp/train_ab_base/build-prebuilt build-prebuilt; do
     echo \$b \$m; \$b/mixer_bench --model lt2-gdn-1.3b --mixer \$m --batch 8 --seq 4096 --iters 5 | grep RESULT;
     done; done; done"
  "prefill 150 BASE_TARBALL=$MID_TARBALL CONTEXTS=8192,32768 PROFILE_CONTEXTS=8192 scripts/gpu_prefill_ab.sh"
  "profile 120 for m in lt-100m lt2-gdn-100m; do build-prebuilt/train_bench --model \$m --seq-len 2048
     --batch-size 16 --steps 4 --warm 2 --checkpoint-loops --profile 1 --profile-ops; done")
# A step is one line for gpu_batch.sh: fold the continuation lines above; keep the ONLY ones, in ONLY's order.
chosen=()
for name in ${ONLY:-$(for step in "${steps[@]}"; do echo "${step%% *}"; done)}; do
  for step in "${steps[@]}"; do
    [ "${step%% *}" = "$name" ] && chosen+=("$(echo "$step" | tr '\n' ' ' | tr -s ' ')")
  done
done
exec scripts/gpu_batch.sh "${chosen[@]}"
