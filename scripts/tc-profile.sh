#!/usr/bin/env bash
# Device helper: ncu sections of the first forward (mode 1) and backward-weight (mode 2) mainloop
# launches of one VGG layer, after tc-run.sh has built /tmp/bd.
set -uo pipefail
out=${OUT:-$PWD/out}; mkdir -p "$out"
layer=${1:-2}
for mode in 1 2; do
  ncu --clock-control none --kernel-name-base mangled --kernel-name "regex:matmul_kernel.*Li${mode}EEEv" --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section ComputeWorkloadAnalysis \
      /tmp/bd/bench/bench_conv2d --math bf16 --size 224 --layers "$layer" > "$out/ncu_mode$mode.txt" 2>&1
  sed -n '/Section: GPU Speed/,$p' "$out/ncu_mode$mode.txt" | grep -vE '^ *-+ *$|^ *$' | cut -c1-110 | head -70
done
