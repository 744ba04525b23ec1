#!/usr/bin/env bash
# Run HERE (not on the GPU machine): unpacks into .deps/root what the GPU machine's image lacks —
# header-only libraries (nlohmann-json, CLI11, gloo's headers for c10d), PCRE2, GoogleTest and
# cpp-httplib (its header and library, and Brotli, which that library links) —
# from Debian packages, and into .deps/py the peer of the training benchmarks, flash-linear-attention
# 0.6.0 (PyPI's fla-core and flash-linear-attention wheels, plus einops), for PYTHONPATH.
# The folder is git-ignored and travels with `carry: [".deps"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download -q nlohmann-json3-dev libcli11-dev libpcre2-dev libpcre2-8-0 \
   libgtest-dev googletest libgloo-dev libcpp-httplib-dev libcpp-httplib0.11 libbrotli1 libbrotli-dev \
   libssl-dev zlib1g-dev > /dev/null)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs .deps/root/usr/share/doc .deps/root/usr/src
mkdir -p .deps/wheels .deps/py
python3 -m pip download -q --no-deps -d .deps/wheels fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2
for w in .deps/wheels/*.whl; do python3 -m zipfile -e "$w" .deps/py; done
rm -rf .deps/wheels
du -sh .deps
