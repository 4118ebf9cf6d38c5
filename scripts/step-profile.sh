#!/usr/bin/env bash
# Device helper: where one training step's kernel time goes. Builds bench_train (or, with
# --trainer, cudp-vgg), runs ncu over one timed step (after one warm-up step) and prints the kernels
# grouped by name with their total time, launch count and share, largest first. ncu serialises
# kernels and (with --clock-control none) keeps the GPU's own clocks, so the sum is the kernel time
# of a step without overlap.
#   scripts/step-profile.sh [size] [precision] [bench_train flags...]
#     e.g. scripts/step-profile.sh 224 bf16;  scripts/step-profile.sh 32 bf16 --bn
#   scripts/step-profile.sh --trainer [cudp-vgg flags...]
#     the trainer's own step: cudp-vgg on its default data (Fashion-MNIST, VGG-16-BN, bf16, batch
#     256), two steps; set beside `32 bf16 --bn` it shows what the trainer's step adds to the
#     benchmark's (the gradient norm, the first layer of one channel, ...)
set -uo pipefail
cd "$(dirname "$0")/.."
trainer=0
if [[ ${1:-} == --trainer ]]; then
  trainer=1
  shift
  size=fmnist
  precision=bf16
else
  size=${1:-224}
  precision=${2:-bf16}
  shift $(( $# < 2 ? $# : 2 ))
fi
extra=("$@")
out=${OUT:-$PWD/out}; mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
[[ -f build/build.ninja ]] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
target=$([[ $trainer == 1 ]] && echo cudp-vgg || echo bench_train)
cmake --build build --target "$target" -j "$(nproc)" > "$out/profile-build.log" 2>&1 || {
  tail -20 "$out/profile-build.log"; exit 1; }
csv=$out/profile-$size-$precision.csv
if [[ $trainer == 1 ]]; then
  run_dir=$(mktemp -d)
  # The repository's copy of the data where the machine lacks the system's (the GPU machine).
  data=()
  [[ ! -d /usr/share/datasets/fashion-mnist && -d .data/fashion-mnist ]] &&
    data=(--data-dir "$PWD/.data/fashion-mnist")
  command=(build/examples/cudp-vgg --precision bf16 --epochs 1 --batch-size 256 --limit-train 512
           --limit-test 256 --graphs off --output "$run_dir/run" "${data[@]}" "${extra[@]}")
else
  command=(build/bench/bench_train --precision "$precision" --size "$size" --gpus 1 --graphs off
           --warmup 1 --steps 1 --repeats 1 "${extra[@]}")
fi
# NVTX ranges are per thread. The model's forward and backward run inside "VGG forward" and "VGG
# backward" at the top of a replica worker's stack (the benchmark's, and the trainer's: a run on
# one GPU has one replica); the trainer's loss, gradient norm and optimizer run on its main thread
# inside "training step". The trainer's evaluation forward is a "VGG forward" too: the listing
# below keeps its second step alone, by the optimizer's kernels that end each step.
ranges=(--nvtx-include "training step/" --nvtx-include "VGG forward/" --nvtx-include "VGG backward/")
ncu --clock-control none --nvtx "${ranges[@]}" \
  --metrics gpu__time_duration.sum --csv --print-units base "${command[@]}" \
  > "$csv" 2> "$out/profile-ncu.log"
[[ $trainer == 1 ]] && rm -rf "$run_dir"
python3 - "$csv" "$trainer" <<'PY'
import csv, sys, collections, re, signal
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; data = rows[1:]
name_i, value_i, id_i = head.index("Kernel Name"), head.index("Metric Value"), head.index("ID")
launches = [(int(r[id_i]), r[name_i], float(r[value_i].replace(",", ""))) for r in data]
launches.sort()
if sys.argv[2] == "1":
    # The trainer: two steps, then the evaluation's forward. Its second step is what follows the
    # first step's optimizer launch up to the second's.
    ends = [i for i, (_, name, _) in enumerate(launches) if re.search(r"sgd_kernel|adamw_kernel", name)]
    if len(ends) < 2:
        sys.exit(f"step-profile: found {len(ends)} optimizer launches, need 2 (the trainer's two steps)")
    half = launches[ends[0] + 1:ends[1] + 1]
else:
    # The warm-up step and the timed one: keep the second half.
    half = launches[len(launches) // 2:]
total = sum(t for _, _, t in half)
groups = collections.defaultdict(lambda: [0.0, 0])
for _, name, t in half:
    key = re.sub(r"\(.*", "", name)[:90]
    groups[key][0] += t; groups[key][1] += 1
print(f"one step: {len(half)} launches, {total / 1e6:.2f} ms of kernel time")
for key, (t, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:28]:
    print(f"{t / 1e6:8.3f} ms {100 * t / total:5.1f}% {n:4d}x  {key}")
PY
