#!/usr/bin/env bash
# The host test suite under AddressSanitizer + UndefinedBehaviorSanitizer, in build-asan. Uses the
# `asan` workflow preset where CMakePresets.json has one; otherwise configures the same build
# directly. GPU tests are not run (CI has no GPU; compute-sanitizer covers device code). cudp-vgg
# is built and its test runs the hostile-input cases the preset's CUDP_VGG_TEST_FILTER names; its
# MPI test (minutes of training in two processes) is left out.
#   scripts/asan.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if cmake --workflow --list-presets 2>/dev/null | grep '"asan"' >/dev/null; then
  exec cmake --workflow --preset asan
fi

sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
vgg_filter=$(sed -n 's/.*"CUDP_VGG_TEST_FILTER": "\(.*\)".*/\1/p' CMakePresets.json)
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCUDP_BUILD_EXAMPLES=ON -DCUDP_VGG_TEST_FILTER="$vgg_filter" -DCUDP_BUILD_BENCH=OFF \
  -DCMAKE_CXX_FLAGS="$sanitize" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build build-asan -j"${CUDP_JOBS:-2}"
ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:halt_on_error=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -L host -E '^examples_mpi_vgg_test$' --output-on-failure -j2
