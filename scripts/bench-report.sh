#!/usr/bin/env bash
# The benchmark report in one command, on a GPU machine after a build in ./build: runs the standard
# suite (bench_comm, bench_train as one process and, with 2+ GPUs and mpirun, as one process per
# GPU, bench/pytorch_train.py, bench_gemm, bench_conv2d, bench_norm_pool, bench_elementwise), each
# under a timeout and all within a total budget, collects the machine's versions, then writes
# bench/report/{report.md,report.json,scaling.png} with bench/report.py.
#
#   scripts/bench-report.sh                      # the standard suite, bf16, tf32 and fp32
#   scripts/bench-report.sh --precision bf16     # cudp and PyTorch in bf16 only (quicker)
#   scripts/bench-report.sh --quick              # fewer steps and sizes
#   scripts/bench-report.sh --only comm,train    # a subset: comm train torch gemm conv2d norm_pool elementwise
#   scripts/bench-report.sh --report-only        # rebuild the report from the JSON already there
#
# Options: --build DIR (default build), --gpus N (default: all visible), --budget SEC (total for the
# benches, default 1800; a bench whose turn comes with under 20 s left is skipped), --precision LIST
# (cudp's training precisions, in this order, default bf16,tf32,fp32; each beside PyTorch's
# strongest setting of that precision: fp32 with TF32 off, tf32 and bf16 autocast channels_last),
# --compile on|off (default on: PyTorch's tf32 and bf16 also under torch.compile, on one GPU),
# --tf32 (also PyTorch fp32 with TF32, PyTorch's default, as train_torch_*_tf32.json), --quick,
# --only LIST, --report-only.
# Raw JSON and each bench's log go to $OUT when set (the device tool's output folder), else
# bench/report/raw; with $OUT set, report.md, report.json and scaling.png are copied there too.
# Exit status: 0 when every bench ran and passed, 3 when the report was written but some bench
# failed, timed out or was skipped, else report.py's failure.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH

build=build
gpus=""
budget=1800
quick=0
tf32=0
precisions="bf16,tf32,fp32"
compile=on
report_only=0
only="comm,train,torch,gemm,conv2d,norm_pool,elementwise"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --tf32) tf32=1; shift ;;
    --precision) precisions=$2; shift 2 ;;
    --compile) compile=$2; shift 2 ;;
    --report-only) report_only=1; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "bench-report.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

IFS=, read -r -a precision_list <<< "$precisions"
(( ${#precision_list[@]} > 0 )) || {
  echo "bench-report.sh: --precision takes fp32, tf32 and/or bf16, comma-separated; got none" >&2
  exit 2
}
for p in "${precision_list[@]}"; do
  [[ $p == fp32 || $p == tf32 || $p == bf16 ]] || {
    echo "bench-report.sh: --precision takes fp32, tf32 and/or bf16, comma-separated; got '$p'" >&2
    exit 2
  }
done
[[ $compile == on || $compile == off ]] || {
  echo "bench-report.sh: --compile takes on or off; got '$compile'" >&2
  exit 2
}

raw=${OUT:-bench/report/raw}
mkdir -p "$raw" bench/report
raw=$(cd "$raw" && pwd)
bin=$build/bench

if [[ -z $gpus ]]; then
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
  else
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  fi
fi
[[ $gpus =~ ^[0-9]+$ ]] || gpus=0

# ---- machine information ------------------------------------------------------------------------
header_version() {  # header_version FILE PREFIX: "MAJOR.MINOR.PATCH" from #defines PREFIX{MAJOR,MINOR,...}
  local f="" dir
  for dir in /usr/include /usr/include/*-linux-gnu /usr/local/include /usr/local/cuda/include \
             /usr/local/cuda-*/include /usr/local/cuda/targets/*/include ${CUDA_HOME:+$CUDA_HOME/include}; do
    [[ -f $dir/$1 ]] && { f=$dir/$1; break; }
  done
  [[ -n $f ]] || return 0
  awk -v p="$2" '$1 == "#define" && $2 == p"MAJOR" {a=$3} $1 == "#define" && $2 == p"MINOR" {b=$3}
                 $1 == "#define" && ($2 == p"PATCH" || $2 == p"PATCHLEVEL") {c=$3}
                 END {if (a != "") printf "%s.%s.%s", a, b, c}' "$f"
}

collect_machine() {
  local smi="" torch_json="{}"
  command -v nvidia-smi >/dev/null && smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader 2>/dev/null | head -1)
  command -v nvidia-smi >/dev/null && nvidia-smi topo -m > "$raw/topology.txt" 2>&1
  if python3 -c 'import torch' 2>/dev/null; then
    torch_json=$(python3 -c 'import json, torch
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print(json.dumps({"pytorch": torch.__version__, "pytorch_cuda": torch.version.cuda,
                  "pytorch_cudnn": str(torch.backends.cudnn.version()),
                  "pytorch_nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}))' 2>/dev/null \
      || echo '{}')
  fi
  SMI="$smi" TORCH="$torch_json" GPUS="$gpus" \
  CUDA_V="$(nvcc --version 2>/dev/null | sed -n 's/.*release [0-9.]*, V\([0-9.]*\).*/\1/p')" \
  CUDNN_V="$(header_version cudnn_version.h CUDNN_)" NCCL_V="$(header_version nccl.h NCCL_)" \
  LINK="$(awk '/^GPU0/ {print $3; exit}' "$raw/topology.txt" 2>/dev/null)" \
  COMMIT="$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo '+dirty')" \
  python3 - > "$raw/machine.json" <<'EOF'
import datetime, json, os, socket
smi = [s.strip() for s in os.environ["SMI"].split(",")] if os.environ["SMI"] else []
m = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
     "host": socket.gethostname(), "gpus": int(os.environ["GPUS"] or 0),
     "gpu_name": smi[0] if smi else None, "gpu_memory": smi[1] if len(smi) > 1 else None,
     "driver": smi[2] if len(smi) > 2 else None, "cuda": os.environ["CUDA_V"] or None,
     "cudnn": os.environ["CUDNN_V"] or None, "nccl": os.environ["NCCL_V"] or None,
     "interconnect": ("GPU0-GPU1 " + os.environ["LINK"]) if os.environ["LINK"] else None,
     "git_commit": os.environ["COMMIT"] or None}
try:
    m.update(json.loads(os.environ["TORCH"]))
except ValueError:
    pass
print(json.dumps({k: v for k, v in m.items() if v is not None}))
EOF
}

# ---- the benches --------------------------------------------------------------------------------
start=$(date +%s)
failures=0
summary=()
wants() { [[ ",$only," == *",$1,"* ]]; }

# run NAME TIMEOUT CMD...: runs CMD under min(TIMEOUT, what is left of the budget), its output in
# $raw/NAME.log, its outcome a line of $raw/runs.json.
run() {
  local name=$1 limit=$2; shift 2
  local left=$(( budget - ($(date +%s) - start) ))
  (( limit > left )) && limit=$left
  local t0 rc status
  if (( limit < 20 )); then
    status="skipped (budget)"; rc=-1
    rm -f "$raw/$name.json"
    echo "  $name: skipped, ${left}s of the budget left"
  else
    echo "  $name: $* (timeout ${limit}s)"
    rm -f "$raw/$name.json"  # no stale result from an earlier run
    t0=$(date +%s)
    timeout -k 15 "$limit" "$@" > "$raw/$name.log" 2>&1
    rc=$?
    case $rc in
      0) status=ok ;;
      124|137) status="TIMED OUT after ${limit}s" ;;
      *) status="FAILED (exit $rc)" ;;
    esac
  fi
  [[ $status == ok ]] || failures=$((failures + 1))
  summary+=("$(printf '%-22s %s' "$name" "$status")")
  printf '{"bench": "%s", "status": "%s", "rc": %d, "seconds": %d, "command": "%s"}\n' "$name" "$status" \
    "$rc" "$(( $(date +%s) - ${t0:-$(date +%s)} ))" "$*" >> "$raw/runs.json"
}

have() {  # have PROGRAM: built?
  if [[ -x $bin/$1 ]]; then return 0; fi
  summary+=("$(printf '%-22s %s' "$1" "not built ($bin/$1)")")
  failures=$((failures + 1))
  return 1
}

if [[ $report_only == 0 ]]; then
  rm -f "$raw"/runs.json
  echo "bench-report.sh: $gpus GPU(s), raw results in $raw, budget ${budget}s, precisions $precisions$([[ $quick == 1 ]] && echo ', quick')"
  if (( quick )); then
    comm_args=(--max 256M --reps 20); train_args=(--warmup 2 --steps 5 --repeats 3)
    torch_args=(--warmup 2 --steps 5 --repeats 3)
    gemm_args=(--reps 10); conv_args=(--layers 3,5,8); elem_args=(--quick); norm_args=(--quick)
  else
    comm_args=(); train_args=(--warmup 3 --steps 10); torch_args=(--warmup 3 --steps 10)
    gemm_args=(); conv_args=(); elem_args=(); norm_args=()
  fi
  # The headline figures first (training, all-reduce), then the kernels.
  if wants comm && have bench_comm; then
    run comm 90 "$bin/bench_comm" --gpus "$gpus" --json "$raw/comm.json" "${comm_args[@]}"
  fi
  # One run per image size: what finished survives a later timeout.
  # fp32's files keep the names they had before the other precisions: train_cudp_<size>.json.
  suffix() { [[ $1 == fp32 ]] || echo "_$1"; }
  if wants train && have bench_train; then
    for size in 224 32; do
      for p in "${precision_list[@]}"; do
        run "train_cudp_$size$(suffix "$p")" 150 "$bin/bench_train" --size "$size" --gpus "$gpus" \
          --precision "$p" --json "$raw/train_cudp_$size$(suffix "$p").json" "${train_args[@]}"
      done
    done
    # One process per GPU (DistributedDataParallel), beside the one-process rows above, with
    # graphs on and off as they are. Open MPI: as root it needs --allow-run-as-root, and it would
    # bind each of 2
    # ranks to one core (the host thread, NCCL's and the watchdog's threads on it): --bind-to none.
    if (( gpus < 2 )); then
      summary+=("$(printf '%-22s %s' train_cudp_np "skipped (one process per GPU needs 2+ GPUs)")")
    elif ! command -v mpirun >/dev/null; then
      summary+=("$(printf '%-22s %s' train_cudp_np "skipped (no mpirun: install openmpi-bin)")")
    else
      mpi_flags=()
      if mpirun --version 2>&1 | grep 'Open MPI\|OpenRTE' >/dev/null; then
        mpi_flags=(--bind-to none)
        [[ $(id -u) == 0 ]] && mpi_flags+=(--allow-run-as-root)
      fi
      for size in 224 32; do
        for p in "${precision_list[@]}"; do
          run "train_cudp_np${gpus}_$size$(suffix "$p")" 150 mpirun "${mpi_flags[@]}" -np "$gpus" \
            "$bin/bench_train" --size "$size" --precision "$p" \
            --json "$raw/train_cudp_np${gpus}_$size$(suffix "$p").json" "${train_args[@]}"
        done
      done
    fi
  fi
  if wants torch; then
    if python3 -c 'import torch, torchvision' 2>/dev/null; then
      # Per precision PyTorch's strongest setting: fp32 as cudp's (TF32 off; --tf32 adds PyTorch's
      # default, TF32 on), tf32 and bf16 (autocast) with channels_last, eager on 1..N GPUs and, with
      # --compile on, under torch.compile on one GPU (at 32² it can be slower than eager: both are
      # kept, and the report sets cudp against each).
      for size in 224 32; do
        for p in "${precision_list[@]}"; do
          if [[ $p == fp32 ]]; then
            run "train_torch_$size" 180 python3 bench/pytorch_train.py --size "$size" --gpus "$gpus" \
              --json "$raw/train_torch_$size.json" "${torch_args[@]}"
            if (( tf32 )); then
              run "train_torch_${size}_tf32" 180 python3 bench/pytorch_train.py --size "$size" \
                --gpus "$gpus" --tf32 --json "$raw/train_torch_${size}_tf32.json" "${torch_args[@]}"
            fi
            continue
          fi
          run "train_torch_${size}_${p}_nhwc" 180 python3 bench/pytorch_train.py --size "$size" \
            --gpus "$gpus" --precision "$p" --channels-last \
            --json "$raw/train_torch_${size}_${p}_nhwc.json" "${torch_args[@]}"
          if [[ $compile == on ]]; then
            run "train_torch_${size}_${p}_nhwc_compiled" 240 python3 bench/pytorch_train.py \
              --size "$size" --gpus "$gpus" --modes single --precision "$p" --channels-last \
              --compile --json "$raw/train_torch_${size}_${p}_nhwc_compiled.json" "${torch_args[@]}"
          fi
        done
      done
    else
      summary+=("$(printf '%-22s %s' train_torch "skipped (torch/torchvision do not import)")")
    fi
  fi
  if wants gemm && have bench_gemm; then
    run gemm 90 "$bin/bench_gemm" --json "$raw/gemm.json" "${gemm_args[@]}"
    # The tensor-core products (bf16, TF32) against cublasGemmEx (sm_90 only: elsewhere they fail).
    for m in bf16 tf32; do
      run gemm_$m 90 "$bin/bench_gemm" --math $m --json "$raw/gemm_$m.json" "${gemm_args[@]}"
    done
  fi
  if wants conv2d && have bench_conv2d; then
    run conv2d 180 "$bin/bench_conv2d" --json "$raw/conv2d.json" "${conv_args[@]}"
    for m in bf16 tf32; do
      run conv2d_$m 180 "$bin/bench_conv2d" --math $m --json "$raw/conv2d_$m.json" "${conv_args[@]}"
    done
  fi
  if wants norm_pool && have bench_norm_pool; then
    run norm_pool 90 "$bin/bench_norm_pool" --json "$raw/norm_pool.json" "${norm_args[@]}"
  fi
  if wants elementwise && have bench_elementwise; then
    run elementwise 90 "$bin/bench_elementwise" --json "$raw/elementwise.json" "${elem_args[@]}"
  fi
fi

# --report-only rebuilds from the raw results as they are, the machine's description included (this
# machine may not be the one that ran them).
[[ $report_only == 1 && -f $raw/machine.json ]] || collect_machine
python3 bench/report.py --raw "$raw" --out bench/report
report_rc=$?
if [[ -n ${OUT:-} && $report_rc == 0 ]]; then
  for f in report.md report.json scaling.png; do
    [[ -f bench/report/$f ]] && cp "bench/report/$f" "$OUT/"
  done
fi

echo
echo "== bench-report.sh: $(( $(date +%s) - start )) s =="
for line in "${summary[@]}"; do echo "  $line"; done
echo "  report: bench/report/report.md$([[ -n ${OUT:-} ]] && echo " (and in \$OUT)")"
if [[ $report_rc != 0 ]]; then exit "$report_rc"; fi
(( failures == 0 )) || exit 3
exit 0
