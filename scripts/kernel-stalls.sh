#!/usr/bin/env bash
# Device helper: why one kernel waits. Profiles one launch of a kernel with ncu (GPU clocks left as
# they are), prints its warp-state statistics (the stall reasons, averaged over the launch) and the
# SASS instructions that hold most of the sampled stalls, with their reasons: where a fixed cost per
# tile sits (the epilogue's stores, the pipeline's ramp, the scheduler) reads from the top lines.
#   scripts/kernel-stalls.sh <kernel-regex> <launch-skip> -- <command...>
#   e.g. scripts/kernel-stalls.sh 'matmul_kernel' 20 -- build/bench/bench_conv2d --math bf16 \
#          --size 224 --layers 2
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
# Per loop level (instructions grouped by how often they ran), then per instruction.
if ncu -i "$report.ncu-rep" --page source --print-source sass --csv > "$out/stalls-sass.csv" \
     2> "$out/stalls-source.log"; then
  python3 - "$out/stalls-sass.csv" <<'PY'
import collections, csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head_i = next(i for i, r in enumerate(rows) if "Source" in r)
head, data = rows[head_i], [r for r in rows[head_i + 1:] if len(r) == len(rows[head_i])]
src = head.index("Source")
col = next((i for i, c in enumerate(head) if "Sampling" in c and "All" in c), None)
if col is None:
    sys.exit("no stall-sampling column in: " + ", ".join(head))
execs = head.index("Instructions Executed")
reasons = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
def num(s):
    try: return float(s.replace(",", ""))
    except ValueError: return 0.0
total = sum(num(r[col]) for r in data) or 1.0
# Instructions that ran equally often belong to one loop level: per launch, per tile, per k-block.
# Their share of the samples says which level holds the time.
groups = collections.defaultdict(lambda: [0.0, 0, collections.Counter()])
for r in data:
    g = groups[int(num(r[execs]))]
    g[0] += num(r[col]); g[1] += 1
    for i in reasons: g[2][head[i]] += num(r[i])
print(f"{'share':>6} {'runs':>10} {'instrs':>6}  top stall reasons  ({int(total)} samples)")
for runs, (samples, count, why) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:8]:
    top = ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in why.most_common(3))
    print(f"{100 * samples / total:5.1f}% {runs:>10} {count:>6}  {top}")
print()
print(f"{'share':>6}  SASS, the 30 instructions with the most samples")
for r in sorted(data, key=lambda r: -num(r[col]))[:30]:
    print(f"{100 * num(r[col]) / total:5.1f}%  {r[src].strip()}")
PY
else
  echo "ncu's source page is not available here (see $out/stalls-source.log); details above"
fi
