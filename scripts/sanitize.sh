#!/usr/bin/env bash
# compute-sanitizer over the GPU tests: memcheck (out-of-bounds and misaligned accesses, leaks),
# racecheck (shared-memory hazards), synccheck (illegal barriers) and initcheck (reads of
# uninitialised device memory). Vendor-comparison cases (cuBLAS, cuDNN: not our code) and the
# VGG-sized and deliberately large cases are filtered out by default: under the sanitizer they take
# minutes and add nothing (same kernels, larger grids); so are the tests that make allocations fail
# on purpose (*OutOfMemory*: the sanitizer reports each failed cudaMalloc as an API error, which is
# what those tests ask for); so is the test that leaves a CUDA graph owning memory on purpose
# (*WithoutTheRelease*: memcheck misreads graph-owned allocations, engine/core/memory.h); set
# FILTER to choose others. initcheck runs the 64-channel bf16 convolutions on their unswapped tiles
# (the tests' --cudp_conv_swapped=off): it does not count the swapped tiles' TMA stores as writes,
# and would report every read of their outputs; memcheck and racecheck run them as they are.
#   scripts/sanitize.sh [build-dir] [test-glob]      e.g. scripts/sanitize.sh build-ci 'kernels_*'
#   TOOLS="memcheck initcheck" scripts/sanitize.sh build-ci
# Prints one line per test and tool, the logs go to $OUT (or /tmp); exits 1 if any run failed.
set -uo pipefail
build=${1:-build}
glob=${2:-*}
tools=${TOOLS:-memcheck racecheck synccheck initcheck}
export PATH=/usr/local/cuda/bin:$PATH
filter=${FILTER:--*Vgg*:*vgg*:*Large*:*Cudnn*:*Cublas*:*cudnn*:*cublas*:*Deterministic*:*OutOfMemory*:*WithoutTheRelease*}
failed=0
shopt -s nullglob
tests=("$build"/tests/${glob}_gpu_test)
if ((${#tests[@]} == 0)); then
  echo "sanitize: no GPU tests match $build/tests/${glob}_gpu_test" >&2
  exit 1
fi
for t in "${tests[@]}"; do
  name=$(basename "$t")
  # A binary whose every test the filter leaves out runs no CUDA code, which the sanitizer reports
  # as a failure of its own: say so instead.
  # (grep -c reads the whole listing: grep -q would stop at the first match, and under pipefail the
  # listing's SIGPIPE then read as "no tests" for binaries with long listings.)
  selected=$("$t" --gtest_filter="$filter" --gtest_list_tests 2>/dev/null | grep -c '^  ')
  if [[ ${selected:-0} == 0 ]]; then
    printf '%-40s %-9s the filter selects none of its tests (FILTER to choose)\n' "$name" "-"
    continue
  fi
  for tool in $tools; do
    log=${OUT:-/tmp}/sanitize-$name-$tool.log
    extra=()
    args=()
    [[ $tool == memcheck ]] && extra=(--leak-check full)
    [[ $tool == initcheck ]] && args=(--cudp_conv_swapped=off)
    # NCCL's communicator set-up probes its own kernels with cudaFuncGetAttributes and takes the
    # "no kernel image" answers for the architectures it was not built for as expected: those are
    # API errors inside libnccl, not ours (the sanitizer's backtraces end in ncclCommInitAll), and
    # reporting them would hide any real finding. Memory accesses are still checked in full.
    [[ $name == parallel_* ]] && extra+=(--report-api-errors no)
    timeout 900 compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 "$t" \
      --gtest_filter="$filter" --gtest_brief=1 "${args[@]}" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    printf '%-40s %-9s rc=%-3s %s\n' "$name" "$tool" "$rc" "$summary"
    if [[ $rc == 0 ]]; then
      rm -f "$log"  # keep only the logs that say something
    else
      failed=1
      # The first distinct reports, for a reader who only sees this script's output.
      grep -E "^========= [A-Z]|^========= +(Invalid|Program hit|Race|Barrier|Uninitialized)" "$log" \
        | sort | uniq -c | sort -rn | head -6 | sed 's/^/    /'
      [[ -z $summary ]] && tail -5 "$log" | sed 's/^/    /'
    fi
  done
done
exit $failed
