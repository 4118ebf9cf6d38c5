#!/usr/bin/env bash
# Device helper for the tensor-core work: build the given targets, run the given test filter and
# benchmarks. Usage: scripts/tc-run.sh "<targets>" "<ctest regex>" "<bench args;...>"
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
out=${OUT:-$PWD/out}; mkdir -p "$out"
t0=$(date +%s)
cmake -S . -B /tmp/bd -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUDP_WERROR=ON > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build /tmp/bd -j "$(nproc)" --target $1 > "$out/build.log" 2>&1 || { grep -E "error|FAILED" -A4 "$out/build.log" | head -40; exit 1; }
echo "build ok ($(( $(date +%s) - t0 )) s)"
if [[ -n $2 ]]; then
  ctest --test-dir /tmp/bd -R "$2" --output-on-failure --timeout 600 > "$out/ctest.log" 2>&1
  grep -E "tests passed|tests failed|Failed|Passed|\*\*\*" "$out/ctest.log" | tail -20
  grep -E "Failure|error|Expected|worst|elements off|relative" "$out/ctest.log" | head -40
fi
IFS=';' read -ra benches <<< "${3:-}"
for b in "${benches[@]}"; do
  [[ -z $b ]] && continue
  echo "=== $b"
  timeout 300 /tmp/bd/bench/$b > "$out/$(echo $b | tr ' /' '__').log" 2>&1
  grep -E "validate|^\|" "$out/$(echo $b | tr ' /' '__').log" | grep -v "^|---" | head -40
done
