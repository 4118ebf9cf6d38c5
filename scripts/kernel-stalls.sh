#!/usr/bin/env bash
# Device helper: why one kernel waits. Profiles one launch of a kernel with ncu (GPU clocks left as
# they are), prints its warp-state statistics (the stall reasons, averaged over the launch) and the
# SASS instructions that hold most of the sampled stalls, with their reasons: where a fixed cost per
# tile sits (the epilogue's stores, the pipeline's ramp, the scheduler) reads from the top lines.
#   scripts/kernel-stalls.sh <kernel-regex> <launch-skip> -- <command...>
#   e.g. scripts/kernel-stalls.sh 'matmul_kernel' 20 -- build/bench/bench_conv2d --math bf16 \
#          --size 224 --layers 2
# Written without a GPU at hand (2026-12-02): its first run is the check of its ncu options.
set -uo pipefail
[[ $# -ge 4 && $3 == -- ]] || { sed -n 2,8p "$0"; exit 2; }
kernel=$1 skip=$2
shift 3
out=${OUT:-$PWD/out}; mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
report=$out/stalls
ncu --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
  --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section SourceCounters --import-source no -f -o "$report" "$@" \
  > "$out/stalls-ncu.log" 2>&1 || { tail -20 "$out/stalls-ncu.log"; exit 1; }
ncu -i "$report.ncu-rep" --page details --print-units base \
  | grep -E "Kernel|Duration|Registers|Shared Memory|Achieved Occupancy|Warp Cycles|Stall|Issued|Eligible|Throughput" \
  | head -60
# Per instruction: the SASS with its sampled stalls, the heaviest first (until 90% of samples).
if ncu -i "$report.ncu-rep" --page source --print-source sass --csv > "$out/stalls-sass.csv" \
     2> "$out/stalls-source.log"; then
  python3 - "$out/stalls-sass.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head_i = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
head, data = rows[head_i], rows[head_i + 1:]
src = head.index("Source")
samples = [i for i, c in enumerate(head) if "Sampling" in c and "All" in c]
if not samples:
    sys.exit("no stall-sampling column in: " + ", ".join(head))
col = samples[0]
def num(s):
    try: return float(s.replace(",", ""))
    except ValueError: return 0.0
total = sum(num(r[col]) for r in data if len(r) > col) or 1.0
ranked = sorted((r for r in data if len(r) > col), key=lambda r: -num(r[col]))
acc = 0.0
print(f"{'share':>6}  SASS ({head[col]}, {int(total)} samples)")
for r in ranked:
    acc += num(r[col])
    print(f"{100 * num(r[col]) / total:5.1f}%  {r[src].strip()}")
    if acc / total >= 0.9 or num(r[col]) == 0: break
PY
else
  echo "ncu's source page is not available here (see $out/stalls-source.log); details above"
fi
