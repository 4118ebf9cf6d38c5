#!/usr/bin/env python3
"""PyTorch side of bench_train: the same VGG configurations, the same measurement.

Runs torchvision's VGG (no BatchNorm; --bn: torchvision's vgg*_bn, "bn": true in the JSON) with
SGD(momentum 0.9, weight decay 5e-4), data already on the GPU, `--warmup` untimed steps then
`--repeats` windows of `--steps` timed steps, each between synchronisations, the figure being the
median window's as bench_train's (each window's img/s in the JSON's "window_images_per_s"), on one
GPU, with nn.DataParallel, and with
DistributedDataParallel (one process per GPU, NCCL). The 32x32 configuration uses cudp's compact
head (512 -> 512 -> 512 -> 10), built here from torchvision's features. Prints a Markdown table and
writes JSON lines with --json.

  python3 bench/pytorch_train.py --json out.json              # fp32, TF32 off
  python3 bench/pytorch_train.py --tf32                       # PyTorch's default cuDNN TF32
  python3 bench/pytorch_train.py --precision bf16 --channels-last [--compile]
                                                              # PyTorch's fastest settings: bf16
                                                              # autocast, NHWC, torch.compile
"""
import argparse
import json
import os
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision


def build(arch, size, bn=False):
    arch = arch + "_bn" if bn else arch
    if size == 32:
        features = getattr(torchvision.models, arch)().features
        head = nn.Sequential(nn.Flatten(), nn.Linear(512, 512), nn.ReLU(True), nn.Dropout(),
                             nn.Linear(512, 512), nn.ReLU(True), nn.Dropout(), nn.Linear(512, 10))
        return nn.Sequential(features, head), 10
    return getattr(torchvision.models, arch)(), 1000


def settings(args):
    # bf16 autocast runs convolutions and matmuls in bf16; what stays fp32 under it follows TF32.
    tf32 = args.tf32 or args.precision in ("tf32", "bf16")
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = args.channels_last or args.precision != "fp32"


def prepare(model, x, args):
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x


def timed_steps(model, opt, x, y, warmup, steps, devices, args):
    """The seconds of each of args.repeats windows of `steps` steps, after `warmup` steps."""
    loss_fn = nn.CrossEntropyLoss()
    forward = torch.compile(model) if args.compile else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    windows = []
    for _ in range(args.repeats):
        for d in devices:
            torch.cuda.synchronize(d)
        if dist.is_initialized():
            dist.barrier()  # the ranks start each window together
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        for d in devices:
            torch.cuda.synchronize(d)
        windows.append(time.perf_counter() - t0)
    return windows


def single_or_dp(arch, size, per_gpu, gpus, args):
    settings(args)
    torch.manual_seed(1)
    model, classes = build(arch, size, args.bn)
    model = model.cuda(0)
    for d in range(gpus):
        torch.cuda.reset_peak_memory_stats(d)
    if gpus > 1:
        model = nn.DataParallel(model, device_ids=list(range(gpus)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    batch = per_gpu * gpus
    x = torch.randn(batch, 3, size, size, device="cuda:0")
    y = torch.arange(batch, device="cuda:0") % classes
    model, x = prepare(model, x, args)
    windows = timed_steps(model, opt, x, y, args.warmup, args.steps, range(gpus), args)
    peak = max(torch.cuda.max_memory_allocated(d) for d in range(gpus)) / 2**30
    return batch * args.steps / median(windows), peak, [batch * args.steps / w for w in windows]


def ddp_worker(rank, world, arch, size, per_gpu, args, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    settings(args)
    torch.manual_seed(1)
    model, classes = build(arch, size, args.bn)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = nn.parallel.DistributedDataParallel(model.cuda(rank), device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(per_gpu, 3, size, size, device=rank)
    y = torch.arange(per_gpu, device=rank) % classes
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    torch.cuda.reset_peak_memory_stats(rank)
    dist.barrier()
    windows = timed_steps(model, opt, x, y, args.warmup, args.steps, [rank], args)
    # The slowest rank's seconds of each window.
    slowest = torch.tensor(windows, device=rank)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    windows = slowest.tolist()
    if rank == 0:
        images = per_gpu * world * args.steps
        queue.put((images / median(windows), torch.cuda.max_memory_allocated(rank) / 2**30,
                   [images / w for w in windows]))
    dist.barrier()
    dist.destroy_process_group()


def ddp(arch, size, per_gpu, gpus, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(ddp_worker, args=(gpus, arch, size, per_gpu, args, queue), nprocs=gpus,
                       start_method="spawn")
    return queue.get()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["vgg16"])
    p.add_argument("--size", nargs="+", type=int, default=[224, 32])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each window")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed windows; img/s is the median window's")
    p.add_argument("--tf32", action="store_true", help="allow TF32 (PyTorch's cuDNN default)")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default=None,
                   help="fp32 (TF32 off), tf32, or bf16 autocast (TF32 for what stays fp32)")
    p.add_argument("--channels-last", action="store_true", help="NHWC activations and weights")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--bn", action="store_true",
                   help="BatchNorm after every convolution (torchvision's vgg16_bn, ...)")
    p.add_argument("--modes", nargs="+", default=["single", "dp", "ddp"])
    p.add_argument("--json")
    args = p.parse_args()
    if args.repeats < 1 or args.steps < 1:
        p.error("--repeats and --steps take a whole number >= 1")
    if args.precision is None:
        args.precision = "tf32" if args.tf32 else "fp32"
    rows = []
    print("| framework | model | image | batch/GPU | GPUs | mode | img/s | peak GiB |")
    print("|---|---|---|---:|---:|---|---:|---:|")
    for arch in args.arch:
        for size in args.size:
            per_gpu = 256 if size == 32 else 64
            runs = [("single", 1)] if "single" in args.modes else []
            for g in range(2, args.gpus + 1):
                runs += [(m, g) for m in ("dp", "ddp") if m in args.modes]
            for mode, g in runs:
                ips, peak, windows = (ddp if mode == "ddp" else single_or_dp)(arch, size, per_gpu, g,
                                                                             args)
                row = {"framework": "pytorch " + torch.__version__, "model": arch, "bn": args.bn,
                       "size": size,
                       "batch_per_gpu": per_gpu, "gpus": g, "mode": mode,
                       "precision": args.precision, "channels_last": args.channels_last,
                       "compile": args.compile, "images_per_s": round(ips, 1),
                       "repeats": args.repeats,
                       "window_images_per_s": [round(w, 1) for w in windows],
                       "peak_gib": round(peak, 3)}
                rows.append(row)
                setting = args.precision + (" NHWC" if args.channels_last else "") + (
                    " compiled" if args.compile else "")
                name = arch + ("-bn" if args.bn else "")
                print(f"| pytorch {setting} | {name} | {size} | {per_gpu} | {g} | {mode} | "
                      f"{ips:.0f} | {peak:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
