#!/usr/bin/env bash
# Installs everything lt2 needs on a fresh Debian 12 machine: build tools and header-only libraries
# from Debian's apt, libtorch from PyPI's torch==2.11.0, test oracles from PyPI, and the
# public-domain English corpus (Jane Austen's novels, r-cran-janeaustenr) for the main job.
# Nothing is fetched from anywhere else. Safe to run again.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git python3 python3-pip
  nlohmann-json3-dev libcli11-dev libpcre2-dev libgtest-dev libbenchmark-dev
  gnuplot-nox r-cran-janeaustenr
  libgloo-dev  # headers only: c10d's ProcessGroupGloo.hpp includes them; the wheel does not ship them
  libcpp-httplib-dev  # cpp-httplib, the HTTP layer of `lt2 serve`
  clang-14 libclang-rt-14-dev  # libFuzzer for scripts/fuzz.sh, which scripts/test.sh runs briefly
)
PIP_PACKAGES=(torch==2.11.0 numpy tokenizers==0.22.1)
# The official OpenAI client: tests/scripts/openai_client_test.py drives `lt2 serve` with it.
PIP_TEST_PACKAGES=(openai)
# flash-linear-attention's pure-PyTorch naive references: an independent oracle for the mixers.
PIP_NODEPS_PACKAGES=(fla-core==0.6.0 einops)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.0") else 1)' 2>/dev/null \
   || ! $PY -c 'import tokenizers, numpy' 2>/dev/null; then
  echo "setup: pip install ${PIP_PACKAGES[*]}"
  $PY -m pip install -q "${PIP_PACKAGES[@]}" || $PY -m pip install -q --break-system-packages "${PIP_PACKAGES[@]}"
fi
if ! $PY -c 'import openai' 2>/dev/null; then
  echo "setup: pip install ${PIP_TEST_PACKAGES[*]}"
  $PY -m pip install -q "${PIP_TEST_PACKAGES[@]}" || $PY -m pip install -q --break-system-packages "${PIP_TEST_PACKAGES[@]}"
fi
if ! $PY -c 'import fla, einops' 2>/dev/null; then
  echo "setup: pip install --no-deps ${PIP_NODEPS_PACKAGES[*]}"
  $PY -m pip install -q --no-deps "${PIP_NODEPS_PACKAGES[@]}" \
    || $PY -m pip install -q --no-deps --break-system-packages "${PIP_NODEPS_PACKAGES[@]}"
fi
echo "setup: done (libtorch at $($PY -c 'import torch; print(torch.utils.cmake_prefix_path)'))"
