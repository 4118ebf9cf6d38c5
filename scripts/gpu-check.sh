#!/usr/bin/env bash
# The GPU machine's one command: build with every core, run the whole ctest suite (GPU tests
# included), optionally the benchmarks, and print a short summary last.
#
#   scripts/gpu-check.sh                 # build + all tests
#   scripts/gpu-check.sh --bench         # and the kernel benchmarks
#   scripts/gpu-check.sh --probes        # and the hardware probes (build/bench/probe_*)
#   scripts/gpu-check.sh --train         # and VGG-16 training img/s (bf16, 1 GPU) against PyTorch's
#                                        # bf16 channels_last in the same run, cudp's tf32 and its
#                                        # VGG-16-BN (bf16, 32², batch 256: the Fashion-MNIST
#                                        # step), and cudp-vgg on Fashion-MNIST in bf16
#                                        # (.data/fashion-mnist or the system's)
#   scripts/gpu-check.sh --sustained     # and a sustained run beside the trainer: bench_train's
#                                        # VGG-16-BN 32² bf16 step over 3 windows of 500 steps
#                                        # (~1 s each), then cudp-vgg on Fashion-MNIST, with the
#                                        # GPU's SM clock, power and clock-event reasons logged
#                                        # every 200 ms (is a short burst faster than a long run?)
#   scripts/gpu-check.sh --overlap       # and the update beside the backward, A/B in one run:
#                                        # bench_train bf16 32² (VGG-16 and VGG-16-BN) with
#                                        # --overlap-update off and on, alternating, two rounds,
#                                        # then cudp-vgg on Fashion-MNIST with it on
#   scripts/gpu-check.sh --splitk        # and the split-K reduction four columns a thread, A/B in
#                                        # one run: bench_train bf16 32² (VGG-16 and VGG-16-BN)
#                                        # with --splitk kernel and kernel4, alternating, two rounds
#   scripts/gpu-check.sh --bias-final    # and the bias gradients' last launches queued and run as
#                                        # one, A/B in one run: bench_train bf16 32² (VGG-16 and
#                                        # VGG-16-BN) with --bias-final batched and each,
#                                        # alternating, two rounds
#   CUDP_TESTS='kernels_' scripts/gpu-check.sh   # a ctest -R filter
#   CUDP_CTEST_JOBS=6 scripts/gpu-check.sh       # ctest's parallel jobs (4 by default)
# Logs go to $OUT (the device tool's output folder) when set, else ./out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/out}
mkdir -p "$out"
bench=0
train=0
probes=0
sustained=0
overlap=0
splitk=0
bias_final=0
for arg in "$@"; do
  [[ $arg == --bench ]] && bench=1
  [[ $arg == --probes ]] && probes=1
  [[ $arg == --train ]] && train=1
  [[ $arg == --sustained ]] && sustained=1
  [[ $arg == --overlap ]] && overlap=1
  [[ $arg == --splitk ]] && splitk=1
  [[ $arg == --bias-final ]] && bias_final=1
done
export PATH=/usr/local/cuda/bin:$PATH

summary=()
step() { summary+=("$(printf '%-28s %s' "$1" "$2")"); }

# An A/B of one bench_train option: VGG-16 and VGG-16-BN, bf16, 32², graphs on, the option's two
# values alternating, two rounds; one summary line per run.  ab_32 TAG OPTION VALUE_A VALUE_B
ab_32() {
  local tag=$1 option=$2 round model mode rc ips name
  for round in 1 2; do
    for model in plain bn; do
      for mode in "$3" "$4"; do
        name=$tag-$model-$mode-$round
        timeout 60 build/bench/bench_train --precision bf16 --gpus 1 --size 32 --graphs on \
          $([[ $model == bn ]] && echo --bn) "$option" "$mode" \
          --json "$out/$name.json" > "$out/$name.md" 2>&1
        rc=$?
        ips=$(grep -o '"images_per_s": [0-9.]*' "$out/$name.json" 2>/dev/null | cut -d' ' -f2)
        step "$tag $model $mode r$round" "rc=$rc ${ips:-?} img/s"
      done
    done
  done
}

start=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$out/gpus.txt" 2>&1
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUDP_WERROR=ON > "$out/configure.log" 2>&1 \
  && cmake --build build -j "$(nproc)" -- -k 0 > "$out/build.log" 2>&1
build_rc=$?
# With --keep-going a broken target does not stop the others: run what was built.
if [[ $build_rc != 0 && -f build/CTestTestfile.cmake ]]; then partial=1; else partial=0; fi
step "build" "$([[ $build_rc == 0 ]] && echo ok || echo FAILED) ($(( $(date +%s) - start )) s)"
if [[ $build_rc != 0 ]]; then grep -E "error|FAILED" -A4 "$out/build.log" | head -60; fi

if [[ $build_rc == 0 || $partial == 1 ]]; then
  if command -v python3 >/dev/null && [[ -f tests/pytorch/make_golden.py ]]; then
    mkdir -p build/golden
    python3 tests/pytorch/make_golden.py --out build/golden > "$out/golden.log" 2>&1 \
      && export CUDP_GOLDEN_DIR=$PWD/build/golden
    step "pytorch golden file" "$([[ -n ${CUDP_GOLDEN_DIR:-} ]] && echo written || echo FAILED)"
  fi
  t0=$(date +%s)
  ctest --test-dir build -j "${CUDP_CTEST_JOBS:-4}" --timeout 600 ${CUDP_TESTS:+-R "$CUDP_TESTS"} --output-on-failure \
    > "$out/ctest.log" 2>&1
  ctest_rc=$?
  step "ctest" "$(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
  grep -E "\*\*\*Failed|\*\*\*Skipped|Timeout|Not Run" "$out/ctest.log" | head -40
  if [[ $ctest_rc != 0 ]]; then
    # The first failures' details, for the reply's tail.
    grep -E "Failure|error:|Expected|got|worst|Caught|what\(\)" "$out/ctest.log" | head -60
  fi
  CUDA_VISIBLE_DEVICES=1 ./build/examples/cudp-devices > "$out/devices-visible1.txt" 2>&1
  ./build/examples/cudp-devices > "$out/devices.txt" 2>&1
  if [[ $train == 1 ]]; then
    timeout 150 build/bench/bench_train --precision bf16 --gpus 1 --size 224 32 \
      --json "$out/train.json" > "$out/train.md" 2>&1
    step "bench_train bf16" "rc=$?"
    timeout 90 build/bench/bench_train --precision tf32 --gpus 1 --size 224 32 \
      --json "$out/train_tf32.json" > "$out/train_tf32.md" 2>&1
    step "bench_train tf32" "rc=$?"
    timeout 60 build/bench/bench_train --precision bf16 --bn --gpus 1 --size 32 \
      --batch-per-gpu 256 --json "$out/train_bn.json" > "$out/train_bn.md" 2>&1
    step "bench_train bf16 --bn 32²" "rc=$?"
    timeout 150 python3 bench/pytorch_train.py --modes single --gpus 1 --precision bf16 \
      --channels-last --json "$out/pytorch.json" > "$out/pytorch.md" 2>&1
    step "pytorch_train bf16 NHWC" "rc=$?"
    data=/usr/share/datasets/fashion-mnist
    [[ -d .data/fashion-mnist ]] && data=$PWD/.data/fashion-mnist
    rm -rf /tmp/cudp-fmnist
    timeout 120 build/examples/cudp-vgg --precision bf16 --epochs 10 --batch-size 256 --gpus 0 \
      --data-dir "$data" --output /tmp/cudp-fmnist --json "$out/fmnist.json" > "$out/fmnist.log" 2>&1
    step "cudp-vgg fmnist bf16" "rc=$? $(grep -iE 'best|test acc|wall' "$out/fmnist.log" | tail -2 | tr '\n' ' ')"
  fi
  if [[ $overlap == 1 ]]; then
    ab_32 overlap --overlap-update off on
    data=/usr/share/datasets/fashion-mnist
    [[ -d .data/fashion-mnist ]] && data=$PWD/.data/fashion-mnist
    rm -rf /tmp/cudp-fmnist-overlap
    timeout 120 build/examples/cudp-vgg --precision bf16 --epochs 10 --batch-size 256 --gpus 0 \
      --data-dir "$data" --overlap-update on --output /tmp/cudp-fmnist-overlap \
      --json "$out/fmnist-overlap.json" > "$out/fmnist-overlap.log" 2>&1
    step "cudp-vgg fmnist overlap" "rc=$? $(grep -iE 'best|test acc|wall' "$out/fmnist-overlap.log" | tail -2 | tr '\n' ' ')"
  fi
  if [[ $splitk == 1 ]]; then
    ab_32 splitk --splitk kernel kernel4
  fi
  if [[ $bias_final == 1 ]]; then
    ab_32 bias-final --bias-final batched each
  fi
  if [[ $sustained == 1 ]]; then
    # The clock-event field's name since driver 535; the older one before.
    reasons=clocks_event_reasons.active
    nvidia-smi --query-gpu=$reasons --format=csv,noheader > /dev/null 2>&1 ||
      reasons=clocks_throttle_reasons.active
    data=/usr/share/datasets/fashion-mnist
    [[ -d .data/fashion-mnist ]] && data=$PWD/.data/fashion-mnist
    for phase in bench trainer; do
      nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,$reasons \
        --format=csv,noheader -lms 200 > "$out/clocks-$phase.csv" 2>&1 &
      logger=$!
      if [[ $phase == bench ]]; then
        timeout 120 build/bench/bench_train --precision bf16 --bn --gpus 1 --size 32 --graphs on \
          --steps 500 --repeats 3 --json "$out/sustained.json" > "$out/sustained.md" 2>&1
      else
        rm -rf /tmp/cudp-sustained
        timeout 120 build/examples/cudp-vgg --precision bf16 --epochs 10 --batch-size 256 --gpus 0 \
          --data-dir "$data" --output /tmp/cudp-sustained > "$out/sustained-fmnist.log" 2>&1
      fi
      rc=$?
      kill "$logger" 2> /dev/null
      wait "$logger" 2> /dev/null
      # The SM clock (MHz) and power (W) over the run: min / median / max of the 200 ms samples.
      clocks=$(awk -F', ' '{gsub(/ MHz/, "", $2); gsub(/ W/, "", $3); print $2, $3}' \
        "$out/clocks-$phase.csv" | sort -n | awk '{c[NR] = $1; p += $2} END {
          if (NR) printf "SM %d / %d / %d MHz, mean %.0f W", c[1], c[int((NR + 1) / 2)], c[NR], p / NR }')
      step "sustained $phase" "rc=$rc $clocks"
    done
  fi
  if [[ $probes == 1 ]]; then
    for p in build/bench/probe_*; do
      [[ -x $p ]] || continue
      timeout 60 "$p" > "$out/$(basename "$p").txt" 2>&1
      step "$(basename "$p")" "rc=$?"
    done
  fi
  if [[ $bench == 1 ]]; then
    for b in build/bench/bench_*; do
      [[ -x $b ]] || continue
      name=$(basename "$b")
      timeout 300 "$b" --json "$out/$name.json" > "$out/$name.md" 2>&1
      step "$name" "rc=$?"
    done
  fi
fi

echo
echo "==================== summary ===================="
cat "$out/gpus.txt"
cat "$out/devices.txt" 2>/dev/null | head -12
echo "--- CUDA_VISIBLE_DEVICES=1 ---"; cat "$out/devices-visible1.txt" 2>/dev/null | head -6
for line in "${summary[@]}"; do echo "$line"; done
if [[ $train == 1 ]]; then
  for f in "$out/train.md" "$out/train_tf32.md" "$out/train_bn.md" "$out/pytorch.md"; do
    [[ -f $f ]] && grep '^|' "$f"
  done
  tail -4 "$out/fmnist.log" 2>/dev/null
fi
if [[ $sustained == 1 ]]; then
  grep '^|' "$out/sustained.md" 2>/dev/null
  grep -o '"window_images_per_s": \[[^]]*\]' "$out/sustained.json" 2>/dev/null
  grep -E "step 235/235|training time" "$out/sustained-fmnist.log" 2>/dev/null | tail -3
fi
if [[ $probes == 1 ]]; then
  for f in "$out"/probe_*.txt; do [[ -f $f ]] && { echo "--- $(basename "$f" .txt)"; cat "$f"; }; done
fi
if [[ $bench == 1 ]]; then
  for f in "$out"/bench_*.md; do [[ -f $f ]] && { echo "--- $(basename "$f")"; grep '^|' "$f"; }; done
fi
