#!/usr/bin/env bash
# compute-sanitizer over the kernel GPU tests: memcheck (out-of-bounds and misaligned accesses,
# leaks) and racecheck (shared-memory hazards). VGG-sized and vendor-comparison cases are filtered out:
# under the sanitizer they take minutes and add nothing (same kernels, larger grids; vendor code).
#   scripts/sanitize.sh [build-dir]     (prints one line per test and tool, then a summary)
set -uo pipefail
build=${1:-build}
export PATH=/usr/local/cuda/bin:$PATH
filter='-*Vgg*:*vgg*:*Large*:*Cudnn*:*Cublas*:*cudnn*:*cublas*:*Deterministic*'
failed=0
for t in "$build"/tests/kernels_*_gpu_test; do
  name=$(basename "$t")
  for tool in memcheck racecheck; do
    log=${OUT:-/tmp}/sanitize-$name-$tool.log
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 99 "$t" --gtest_filter="$filter" \
      --gtest_brief=1 > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    printf '%-36s %-9s rc=%-3s %s\n' "$name" "$tool" "$rc" "$summary"
    [[ $rc == 0 ]] || failed=1
  done
done
exit $failed
