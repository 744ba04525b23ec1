#!/usr/bin/env bash
# Run HERE (not on the GPU machine): unpacks into .deps/root what the GPU machine's image lacks —
# header-only libraries (nlohmann-json, CLI11, gloo's headers for c10d), PCRE2 and GoogleTest —
# from Debian packages.
# The folder is git-ignored and travels with `carry: [".deps"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download -q nlohmann-json3-dev libcli11-dev libpcre2-dev libpcre2-8-0 \
   libgtest-dev googletest libgloo-dev > /dev/null)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs .deps/root/usr/share/doc .deps/root/usr/src
du -sh .deps
