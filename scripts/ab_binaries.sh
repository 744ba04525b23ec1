# Sourced by the A/B scripts that run inside scripts/gpu_batch.sh (gpu_prefill_ab.sh, gpu_train_ab.sh):
#   ab_binaries SCRIPT BINARY BASE_DIR
# checks that the new arm's build-prebuilt/BINARY is there, unpacks $BASE_TARBALL's build-prebuilt/
# into BASE_DIR and sets NEW and BASE to the two arms' BINARY; exits naming SCRIPT where one is missing.
ab_binaries() {
  local script=$1 binary=$2 dir=$3
  : "${BASE_TARBALL:?BASE_TARBALL: the prebuilt tarball of the baseline, from scripts/prebuild_gpu.sh}"
  NEW=build-prebuilt/$binary
  [ -x "$NEW" ] || { echo "$script: $NEW is missing: run this inside scripts/gpu_batch.sh with .deps carried"; exit 1; }
  rm -rf "$dir" && mkdir -p "$dir"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BASE_TARBALL" "$dir"
  BASE=$dir/build-prebuilt/$binary
  [ -x "$BASE" ] || { echo "$script: $BASE_TARBALL carries no $binary"; exit 1; }
}
