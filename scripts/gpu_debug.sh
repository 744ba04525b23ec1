#!/usr/bin/env bash
# Ad-hoc GPU-machine diagnostics: rebuilds the changed targets, then runs the failing pieces with
# backtraces (cuda-gdb works there as a plain debugger).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD/.deps/root/usr
export LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
B=build-gpu
cmake --build $B -j "$(nproc)" --target lt2_cli train_bench test_gpu test_io > /tmp/dbg_build.log 2>&1 || { grep -E "error" -A5 /tmp/dbg_build.log | head -30; exit 1; }
g++ --version | head -1
echo "== exception path"; $B/apps/lt2/lt2 info nosuchpreset; echo "rc=$?"
echo "== gdn small"; timeout 120 cuda-gdb -q -batch -ex run -ex bt --args $B/bench/train_bench --model lt2-gdn-100m --seq-len 256 --batch-size 2 --steps 3 --warm 0 2>&1 | grep -vE "^\[New Thread|^\[Thread|Detaching" | tail -25
echo "== io"; timeout 120 cuda-gdb -q -batch -ex run -ex bt --args $B/tests/test_io --gtest_filter='Checkpoint.LoadDtypeOption' 2>&1 | grep -vE "^\[New Thread|^\[Thread|Detaching" | tail -25
