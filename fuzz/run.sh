#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (in build-fuzz, or $CUDP_FUZZ_BUILD_DIR), writes their seed
# corpora and runs each target for a bounded time. CI runs it with the default 45 s per target; a
# longer local run:
#   fuzz/run.sh 600            # ten minutes per target
#   fuzz/run.sh 0 2000000      # until 2,000,000 executions per target
# Any crash, sanitizer report, leak, timeout or excess allocation fails the run and leaves the
# input in build-fuzz/fuzz/artifacts/ (replay it with build-fuzz/fuzz/<target>_fuzz <file>).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-45}
runs=${2:--1}
build=${CUDP_FUZZ_BUILD_DIR:-build-fuzz}
targets=(safetensors checkpoint idx cifar gzip image_decode)

# The library is built as usual (g++); fuzz/CMakeLists.txt builds the targets with clang against it.
# An existing build (CI passes build-ci) is reused: only the fuzz targets are added.
if [[ -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -DCUDP_BUILD_FUZZERS=ON > /dev/null
else
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUDP_BUILD_FUZZERS=ON \
    -DCUDP_BUILD_TESTS=OFF -DCUDP_BUILD_EXAMPLES=OFF -DCUDP_BUILD_BENCH=OFF
fi
cmake --build "$build" -j"${CUDP_JOBS:-2}" --target cudp_fuzzers

out=$build/fuzz
rm -rf "$out/seeds"
"$out/cudp-fuzz-seeds" "$out/seeds"
rm -rf "$out/artifacts"
mkdir -p "$out/artifacts"
# Inputs are files (the readers take paths): keep them in memory where possible.
[[ -d /dev/shm && -w /dev/shm ]] && export TMPDIR=/dev/shm

status=0
for t in "${targets[@]}"; do
  mkdir -p "$out/corpus/$t"
  echo "fuzz: $t for ${seconds}s$( ((runs > 0)) && echo " or $runs runs")"
  # The limits make an allocation out of proportion to the input (a reader trusting a size field)
  # a finding: inputs are at most 64 KiB, so no reader needs 512 MB. The image decoder is the
  # exception by design: a JPEG's header of a few hundred bytes may ask for the largest image it
  # accepts, 2^28 pixels (768 MiB of RGB), which it allocates before decoding.
  malloc_mb=512
  [[ $t == image_decode ]] && malloc_mb=1024
  if ! ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0 UBSAN_OPTIONS=print_stacktrace=1 \
       "$out/${t}_fuzz" "$out/corpus/$t" "$out/seeds/$t" \
       -max_total_time="$seconds" -runs="$runs" -max_len=65536 -timeout=10 \
       -rss_limit_mb=2048 -malloc_limit_mb="$malloc_mb" -print_final_stats=1 \
       -artifact_prefix="$out/artifacts/$t-" 2>&1 | tee "$out/$t.log" | grep -E "^(stat::|#[0-9]+ +DONE|==[0-9]+==ERROR|SUMMARY|INFO: Running)" ; then
    :
  fi
  if ! grep -q "^Done [0-9]* runs" "$out/$t.log"; then
    echo "fuzz: $t FAILED; see $out/$t.log and $out/artifacts/" >&2
    tail -40 "$out/$t.log" >&2
    status=1
  fi
done
exit $status
