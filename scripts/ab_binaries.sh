# Sourced by the A/B scripts that run inside scripts/gpu_batch.sh (gpu_prefill_ab.sh, gpu_train_ab.sh):
#   ab_binaries SCRIPT BINARY BASE_DIR
# unpacks $BASE_TARBALL's build-prebuilt/ into BASE_DIR and, where NEW_TARBALL is set, that one's into
# BASE_DIR.new (else the new arm is build-prebuilt/, which gpu_batch.sh unpacked); sets NEW and BASE
# to the two arms' BINARY and exits naming SCRIPT where one is missing.
ab_binaries() {
  local script=$1 binary=$2 dir=$3
  : "${BASE_TARBALL:?BASE_TARBALL: the prebuilt tarball of the baseline, from scripts/prebuild_gpu.sh}"
  unpack() {
    rm -rf "$2" && mkdir -p "$2"
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2"
  }
  NEW_BUILD=build-prebuilt
  if [ -n "${NEW_TARBALL:-}" ]; then unpack "$NEW_TARBALL" "$dir.new" && NEW_BUILD=$dir.new/build-prebuilt; fi
  NEW=$NEW_BUILD/$binary
  [ -x "$NEW" ] || { echo "$script: $NEW is missing: run this inside scripts/gpu_batch.sh with .deps carried"; exit 1; }
  unpack "$BASE_TARBALL" "$dir"
  BASE=$dir/build-prebuilt/$binary
  [ -x "$BASE" ] || { echo "$script: $BASE_TARBALL carries no $binary"; exit 1; }
}
