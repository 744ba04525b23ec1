#!/usr/bin/env bash
# Builds lt2 and test_gpu here (the CPU machine compiles the CUDA code too), strips them and puts them with
# the libraries they need beyond libtorch and the CUDA runtime into build-prebuilt/, and packs that folder into
# .deps/build-prebuilt.tar.xz (~17 MB against ~140 MB unpacked: the carry limit is 64 MiB) for the GPU machine:
# `run` with carry [".deps"] and scripts/gpu_batch.sh, which unpacks it, then PREBUILT=build-prebuilt in a step.
# BENCH="mixer_bench train_bench" also carries those benchmarks (build-prebuilt/<name>; the scripts that
# run them take its path, e.g. T=build-prebuilt/train_bench scripts/gpu_train_table.sh).
# COMMIT records the commit (and whether the tree had changes) the binaries were built from, SOURCE_HASH the
# kernels/ops hash of the sources they were built from (scripts/gpu_status.py --hash), for the GPU test record.
set -euo pipefail
cd "$(dirname "$0")/.."
ninja -C build -j "$(nproc)" lt2_cli test_gpu ${BENCH:-}
rm -rf build-prebuilt && mkdir -p build-prebuilt  # no binary of an earlier build stays
strip -o build-prebuilt/lt2 build/apps/lt2/lt2
strip -o build-prebuilt/test_gpu build/tests/test_gpu
for bench in ${BENCH:-}; do strip -o "build-prebuilt/$bench" "build/bench/$bench"; done
# The Debian libraries the GPU image lacks: PCRE2, and cpp-httplib with Brotli where `lt2 serve` is built.
for lib in $(ldd build/apps/lt2/lt2 | awk '/libpcre2-8|libcpp-httplib|libbrotli/ {print $3}'); do cp -L "$lib" build-prebuilt/; done
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src apps tests || echo '+changes')" > build-prebuilt/COMMIT
python3 scripts/gpu_status.py --hash > build-prebuilt/SOURCE_HASH
tar cf - build-prebuilt | xz -T"$(nproc)" -6 > .deps/build-prebuilt.tar.xz.tmp
mv .deps/build-prebuilt.tar.xz.tmp .deps/build-prebuilt.tar.xz
du -sh build-prebuilt .deps/build-prebuilt.tar.xz
