#!/usr/bin/env python3
"""Builds one benchmark report from the benches' JSON outputs.

Reads, from --raw DIR (each file optional; what is absent, empty or unreadable is listed in the
report and skipped):

  machine.json            scripts/bench-report.sh's collector: date, GPUs, driver, CUDA, cuDNN, NCCL, PyTorch
  train_cudp*.json        bench_train --json            (JSON lines, one object per configuration;
                          "processes" > 1 on the rows of `mpirun -np N bench_train`, 1 if absent)
  train_torch*.json       bench/pytorch_train.py --json (JSON lines; several files, e.g. fp32 and tf32)
  comm.json               bench_comm --json             (JSON lines, one object per size)
  gemm.json, conv2d.json, elementwise.json, norm_pool.json
                          bench_gemm / bench_conv2d / bench_elementwise / bench_norm_pool --json
                          (one JSON document each, {"benchmark": ..., "results": [...]})

and writes, into --out DIR: report.md (Markdown tables), report.json (the same data, normalised) and
scaling.png (img/s against GPU count per configuration, cudp and PyTorch; needs matplotlib).

--training DIR (repeatable) adds the training rows of another run kept in its own directory (its
train_cudp*.json and train_torch*.json, e.g. bench/report/bf16-1gpu): cudp and PyTorch are set
against each other within each run only, never across runs, and every training row names its run
("run": the directory's name). The plot shows --raw's run.

  python3 bench/report.py --raw bench/report/raw --training bench/report/bf16-1gpu --out bench/report
"""
import argparse
import glob
import json
import math
import os
import sys

KERNEL_BENCHES = ("gemm", "conv2d", "elementwise", "norm_pool")


# ---- reading -------------------------------------------------------------------------------------

def load_objects(path):
    """The JSON objects of a file: a whole document (an object or a list of them), else JSON lines.

    Lines that do not parse are skipped (a run killed by its timeout can leave half a line), and a
    trailing comma is tolerated, so that the per-result lines of a truncated kernel document are
    still read. Returns (objects, problem); problem is None, or why the file gave nothing.
    """
    if not os.path.exists(path):
        return [], "absent"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        return [], f"unreadable ({e.strerror})"
    if not text.strip():
        return [], "empty"
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            return [doc], None
        if isinstance(doc, list):
            return [o for o in doc if isinstance(o, dict)], None
    except ValueError:
        pass
    objects, header, bad = [], {}, 0
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if not line or line in ("{", "}", "]", "[") or line.endswith("["):
            continue
        if line.startswith('"'):  # `"key": value` of a kernel document's header
            try:
                header.update(json.loads("{" + line + "}"))
            except ValueError:
                bad += 1
            continue
        try:
            o = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(o, dict):
            objects.append(o)
        else:
            bad += 1
    if not objects and not header:
        return [], "no JSON object could be read"
    problem = f"{bad} unreadable line(s) skipped" if bad else None
    if header:  # a document cut short (its bench killed while writing): keep what it holds
        problem = "truncated document, " + (problem or "read") + f", {len(objects)} result(s)"
        return [dict(header, results=objects)], problem
    return objects, problem


def num(o, key, default=None):
    """o[key] as a float, or default when missing or not a finite number."""
    v = o.get(key)
    if isinstance(v, bool) or v is None:
        return default
    try:
        v = float(v)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def fmt(v, digits=1, suffix=""):
    if v is None:
        return "—"
    return f"{v:,.{digits}f}{suffix}"


def md_table(header, rows, align=None):
    align = align or ["---"] * len(header)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


# ---- training ------------------------------------------------------------------------------------

def torch_setting(r):
    """PyTorch's settings as one label: precision, then NHWC and compiled when used."""
    label = str(r.get("precision", "fp32"))
    if r.get("channels_last"):
        label += " NHWC"
    if r.get("compile"):
        label += " compiled"
    return label


def processes_of(r):
    """The processes a cudp row ran as: N under `mpirun -np N bench_train` (DistributedDataParallel,
    one GPU each), 1 for one process on its GPUs (DataParallel) and for rows written before
    bench_train had the field."""
    p = num(r, "processes", 1)
    return int(p) if p and p >= 1 else 1


def model_of(r):
    """The model a training row timed: its name, with "-bn" when it has BatchNorm after every
    convolution (bench_train --bn, pytorch_train.py --bn; rows without the field have none), so
    that VGG-16-BN is never set against VGG-16."""
    return str(r.get("model", "?")) + ("-bn" if r.get("bn") is True else "")


def cudp_mode(r):
    """How a row's cudp ran: 1 GPU, DataParallel (one process on its GPUs) or DDP (N processes)."""
    p = r.get("processes") or 1
    if r["gpus"] <= 0:
        return "CPU" + (f", {p} processes" if p > 1 else "")
    if p > 1:
        return f"DDP ({p} processes)"
    return "1 GPU" if r["gpus"] == 1 else "DataParallel"


def training(cudp_rows, torch_rows, run):
    """Rows per (model, size, batch/GPU, cudp precision, graphs, processes, GPUs, PyTorch setting
    and mode): img/s, scaling efficiency, ratios, from one run (`run`: its name, carried by every
    row). The model is "vgg16-bn" for VGG-16 with BatchNorm (model_of; every row has "bn"), set
    against PyTorch's with BatchNorm only. Every row carries cudp_precision (fp32, tf32 or bf16;
    fp32 for rows written before bench_train had --precision) and processes (1 for one process, N
    for N processes of one GPU each). A row of N processes is set against PyTorch's DDP at the
    same GPU count, and against cudp's one process on as many GPUs with the same precision and
    graphs (cudp_over_one_process); its scaling efficiency is against that one process on 1 GPU."""
    configs = {}
    for r in cudp_rows:
        if num(r, "images_per_s") is None or num(r, "gpus") is None:
            continue
        key = (model_of(r), int(num(r, "size", 0)), int(num(r, "batch_per_gpu", 0)))
        c = configs.setdefault(key, {"cudp": {}, "torch": {}})
        # Rows written before bench_train had --graphs launched every kernel: graphs "off".
        setting = (str(r.get("cudp_precision", "fp32")), str(r.get("cudp_graphs", "off")),
                   processes_of(r))
        c["cudp"].setdefault(setting, {})[int(num(r, "gpus"))] = r
    for r in torch_rows:
        if num(r, "images_per_s") is None or num(r, "gpus") is None:
            continue
        key = (model_of(r), int(num(r, "size", 0)), int(num(r, "batch_per_gpu", 0)))
        mode = str(r.get("mode", "single"))
        c = configs.setdefault(key, {"cudp": {}, "torch": {}})
        c["torch"].setdefault(torch_setting(r), {}).setdefault(mode, {})[int(num(r, "gpus"))] = r

    rows = []
    for (model, size, batch), c in sorted(configs.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        torch_gpus = {g for p in c["torch"].values() for m in p.values() for g in m}
        settings = sorted(c["cudp"].items()) or [((None, None, 1), {})]
        for (cudp_precision, cudp_graphs, processes), cudp in settings:
            # One process with the same precision and graphs: the 1-GPU baseline of the scaling,
            # and, for N processes, the same GPU count in one process.
            one_process = c["cudp"].get((cudp_precision, cudp_graphs, 1), {})
            cudp_one = num(one_process.get(1, {}), "images_per_s")
            gpu_counts = set(cudp) if processes > 1 else set(cudp) | torch_gpus
            for g in sorted(gpu_counts):
                cr = cudp.get(g)
                ips = num(cr, "images_per_s") if cr else None
                eff = ratio(ips, cudp_one * g) if cudp_one else None
                over_one = (ratio(ips, num(one_process.get(g, {}), "images_per_s"))
                            if processes > 1 else None)
                step_ms = num(cr, "step_ms") if cr else None
                ar_ms = num(cr, "allreduce_ms") if cr else None
                base = {
                    "run": run, "model": model, "bn": model.endswith("-bn"), "size": size,
                    "batch_per_gpu": batch, "gpus": g,
                    "cudp_precision": cudp_precision, "cudp_graphs": cudp_graphs,
                    "processes": processes,
                    "cudp_images_per_s": ips, "cudp_scaling_efficiency": eff,
                    "cudp_over_one_process": over_one,
                    "cudp_step_ms": step_ms,
                    "cudp_allreduce_ms": ar_ms if g > 1 else None,
                    "cudp_allreduce_share_of_step": ratio(ar_ms, step_ms) if g > 1 and ar_ms else None,
                    # step time with the all-reduce minus without, over the step (bench_train
                    # --exposed-comm): what the overlapped all-reduce leaves exposed
                    "cudp_exposed_comm_share": num(cr, "cudp_exposed_comm_share") if cr and g > 1 else None,
                    "cudp_peak_gib": num(cr, "peak_gib") if cr else None,
                }
                torch_modes = []
                for setting, modes in sorted(c["torch"].items()):
                    single = num(modes.get("single", {}).get(1, {}), "images_per_s")
                    # N processes of cudp against PyTorch's N processes (DDP) only
                    for mode in ("ddp",) if processes > 1 else ("single", "dp", "ddp"):
                        tr = modes.get(mode, {}).get(g)
                        if tr is None:
                            continue
                        t_ips = num(tr, "images_per_s")
                        torch_modes.append(dict(base, **{
                            "pytorch_mode": mode, "pytorch_precision": setting,
                            "pytorch_framework": tr.get("framework", "pytorch"),
                            "pytorch_images_per_s": t_ips,
                            "pytorch_scaling_efficiency": ratio(t_ips, single * g) if single else None,
                            "pytorch_peak_gib": num(tr, "peak_gib"),
                            "cudp_over_pytorch": ratio(ips, t_ips),
                        }))
                if torch_modes:
                    rows += torch_modes
                elif ips is not None:
                    rows.append(dict(base, pytorch_mode=None, pytorch_precision=None,
                                     pytorch_images_per_s=None, pytorch_scaling_efficiency=None,
                                     pytorch_peak_gib=None, cudp_over_pytorch=None))
    return rows


def training_md(rows):
    if not rows:
        return "_No training results (train_cudp.json / train_torch*.json absent)._"
    body = []
    for r in rows:
        mode = "—"
        if r.get("pytorch_mode"):
            mode = {"single": "1 GPU", "dp": "DataParallel", "ddp": "DDP"}.get(r["pytorch_mode"], r["pytorch_mode"])
            mode += f" ({r['pytorch_precision']})"
        body.append([
            r.get("run", "—"), r["model"], f"{r['size']}²", r["batch_per_gpu"], r["gpus"], cudp_mode(r),
            (r.get("cudp_precision") or "—") + (" graphs" if r.get("cudp_graphs") == "on" else ""),
            fmt(r["cudp_images_per_s"], 0), fmt(r["cudp_scaling_efficiency"], 2),
            mode, fmt(r.get("pytorch_images_per_s"), 0), fmt(r.get("pytorch_scaling_efficiency"), 2),
            fmt(r.get("cudp_over_pytorch"), 2, "×"),
            fmt(r["cudp_allreduce_ms"], 2),
            fmt(100 * r["cudp_allreduce_share_of_step"] if r["cudp_allreduce_share_of_step"] else None, 1, "%"),
            fmt(r["cudp_peak_gib"], 2), fmt(r.get("pytorch_peak_gib"), 2),
        ])
    return md_table(
        ["run", "model", "image", "batch/GPU", "GPUs", "cudp", "cudp precision", "cudp img/s", "cudp scaling", "PyTorch",
         "PyTorch img/s", "PyTorch scaling", "cudp/PyTorch", "cudp all-reduce ms", "all-reduce / step",
         "cudp peak GiB", "PyTorch peak GiB"],
        body, ["---", "---", "---", "---:", "---:", "---", "---", "---:", "---:", "---", "---:", "---:", "---:",
               "---:", "---:", "---:", "---:"])


# ---- kernels -------------------------------------------------------------------------------------

def kernel_rows(bench, doc):
    """Normalised rows {bench, op, shape, unit, ours, vendor, vendor_name, ratio, valid} of one
    kernel bench's document."""
    rows = []
    results = doc.get("results") if isinstance(doc.get("results"), list) else [doc]
    copy_gbs = num(doc, "copy_bandwidth_gbs")
    for r in results:
        if not isinstance(r, dict):
            continue
        valid = r.get("valid")
        if bench == "gemm":
            ours, vendor, unit, name = num(r, "ours_tflops"), num(r, "cublas_tflops"), "TFLOP/s", "cuBLAS"
            op, shape = r.get("op", "gemm"), r.get("shape", "")
        elif bench == "conv2d":
            ours, vendor, unit = num(r, "ours_tflops"), num(r, "cudnn_tflops"), "TFLOP/s"
            name = f"cuDNN algo {r.get('cudnn_algo', '?')}"
            op = f"conv {r.get('pass', '?')}"
            shape = (f"{r.get('input', '?')}² layer {r.get('layer', '?')}: N{r.get('n', '?')} "
                     f"{r.get('h', '?')}x{r.get('w', '?')} {r.get('c', '?')}→{r.get('k', '?')}")
        elif bench in ("elementwise", "norm_pool"):
            ours, unit = num(r, "ours_gbs"), "GB/s"
            vendor, name = num(r, "cudnn_gbs"), "cuDNN"
            if not vendor:  # no cuDNN counterpart: the device-to-device copy is the bar
                vendor, name = copy_gbs, "D2D copy"
            op, shape = r.get("op", "?"), r.get("shape", "")
            if bench == "elementwise" and r.get("floor"):
                op += " [floor]" + ("" if r.get("meets_floor", True) else " BELOW FLOOR")
        else:
            continue
        if ours is None:
            continue
        # The arithmetic: fp32 unless the row or its document says tf32 / bf16 (tensor cores).
        math_mode = r.get("math") or doc.get("math") or "fp32"
        rows.append({"bench": bench, "math": math_mode, "op": op, "shape": shape, "unit": unit,
                     "ours": ours, "vendor": vendor, "vendor_name": name,
                     "ratio": ratio(ours, vendor), "valid": valid})
    return rows


def kernels_md(rows):
    if not rows:
        return "_No kernel results (gemm/conv2d/elementwise/norm_pool JSON absent)._"
    parts = []
    summary = []
    groups = [(bench, m) for bench in KERNEL_BENCHES for m in ("fp32", "tf32", "bf16")]
    for bench, math_mode in groups:
        sub = [r for r in rows if r["bench"] == bench and r["math"] == math_mode]
        if not sub:
            continue
        ratios = [r["ratio"] for r in sub if r["ratio"]]
        worst = min(sub, key=lambda r: r["ratio"] if r["ratio"] is not None else float("inf"))
        summary.append([f"bench_{bench} {math_mode}", len(sub), fmt(geomean(ratios), 2, "×"),
                        f"{fmt(worst['ratio'], 2, '×')} ({worst['op']}, {worst['shape']})",
                        sum(1 for r in sub if r["valid"] is False)])
        body = [[r["op"], r["shape"], fmt(r["ours"], 2), f"{fmt(r['vendor'], 2)} ({r['vendor_name']})",
                 r["unit"], fmt(r["ratio"], 2, "×"),
                 {True: "yes", False: "**NO**", None: "—"}.get(r["valid"], str(r["valid"]))]
                for r in sub]
        parts.append(f"#### bench_{bench}, {math_mode}\n\n" + md_table(
            ["op", "shape", "ours", "vendor", "unit", "ours/vendor", "valid"], body,
            ["---", "---", "---:", "---:", "---", "---:", "---"]))
    head = md_table(["bench", "rows", "geomean ours/vendor", "worst", "invalid rows"], summary,
                    ["---", "---:", "---:", "---", "---:"])
    return head + "\n\n" + "\n\n".join(parts)


# ---- all-reduce ----------------------------------------------------------------------------------

VGG16_GRAD_BYTES = 553_430_176


def size_text(b):
    if b == VGG16_GRAD_BYTES:
        return "553,430,176 B (VGG-16 grads)"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:g} {unit}"
    return f"{b} B"


def allreduce(rows):
    out = []
    for r in rows:
        if r.get("op", "allreduce") != "allreduce" or num(r, "bytes") is None:
            continue
        c, n = num(r, "cudp_busbw_gbs"), num(r, "nccl_busbw_gbs")
        out.append({"gpus": int(num(r, "gpus", 0)), "bytes": int(num(r, "bytes")),
                    "cudp_busbw_gbs": c, "nccl_busbw_gbs": n, "cudp_over_nccl": ratio(c, n),
                    "cudp_ms": num(r, "cudp_ms"), "nccl_ms": num(r, "nccl_ms"),
                    "valid": r.get("valid")})
    return sorted(out, key=lambda r: (r["gpus"], r["bytes"]))


def allreduce_md(rows):
    if not rows:
        return "_No all-reduce results (comm.json absent: bench_comm needs 2 GPUs)._"
    body = [[r["gpus"], ("**" + size_text(r["bytes"]) + "**") if r["bytes"] == VGG16_GRAD_BYTES
             else size_text(r["bytes"]), fmt(r["cudp_ms"], 3), fmt(r["nccl_ms"], 3),
             fmt(r["cudp_busbw_gbs"], 1), fmt(r["nccl_busbw_gbs"], 1), fmt(r["cudp_over_nccl"], 3, "×"),
             {True: "yes", False: "**NO**", None: "—"}.get(r["valid"], str(r["valid"]))] for r in rows]
    return md_table(["GPUs", "size", "cudp ms", "NCCL ms", "cudp bus GB/s", "NCCL bus GB/s", "cudp/NCCL",
                     "valid"], body, ["---:", "---", "---:", "---:", "---:", "---:", "---:", "---"])


# ---- plot ----------------------------------------------------------------------------------------

def plot_scaling(train_rows, path):
    """img/s against GPU count, one panel per (model, image size): cudp, and PyTorch's DataParallel
    and DDP lines (both starting from PyTorch's 1-GPU figure), with cudp's ideal linear scaling."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    configs = {}
    for r in train_rows:
        c = configs.setdefault((r["model"], r["size"], r["batch_per_gpu"]), {})
        if r["cudp_images_per_s"] is not None:
            kind = "cudp_ddp" if (r.get("processes") or 1) > 1 else "cudp"
            c.setdefault((kind, None), {})[r["gpus"]] = r["cudp_images_per_s"]
        if r.get("pytorch_images_per_s") is not None:
            mode, prec = r["pytorch_mode"], r["pytorch_precision"]
            if mode == "single":  # the first point of both multi-GPU lines
                for m in ("dp", "ddp"):
                    c.setdefault((m, prec), {})[1] = r["pytorch_images_per_s"]
            else:
                c.setdefault((mode, prec), {})[r["gpus"]] = r["pytorch_images_per_s"]
    for c in configs.values():  # cudp's N processes start from cudp's one process on 1 GPU
        if ("cudp_ddp", None) in c and 1 in c.get(("cudp", None), {}):
            c[("cudp_ddp", None)].setdefault(1, c[("cudp", None)][1])
    configs = {k: v for k, v in configs.items() if any(len(s) for s in v.values())}
    if not configs:
        return "no training results: no plot"
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4.2), squeeze=False)
    styles = {"cudp": dict(color="tab:blue", marker="o", linestyle="-", linewidth=2),
              "dp": dict(color="tab:orange", marker="s", linestyle="--"),
              "ddp": dict(color="tab:green", marker="^", linestyle="-."),
              "cudp_ddp": dict(color="tab:purple", marker="v", linestyle="-")}
    names = {"cudp": "cudp", "dp": "PyTorch DataParallel", "ddp": "PyTorch DDP",
             "cudp_ddp": "cudp DDP (1 process per GPU)"}
    for ax, ((model, size, batch), series) in zip(axes[0], sorted(configs.items(), key=lambda kv: (kv[0][0], -kv[0][1]))):
        all_g = sorted({g for s in series.values() for g in s})
        cudp = series.get(("cudp", None), {})
        if 1 in cudp and len(all_g) > 1:
            ax.plot(all_g, [cudp[1] * g for g in all_g], color="grey", linewidth=0.8, linestyle=":",
                    label="cudp ideal (linear)")
        for (kind, prec), points in sorted(series.items(),
                                           key=lambda kv: (not kv[0][0].startswith("cudp"), str(kv[0]))):
            if kind not in styles or not points:
                continue
            gs = sorted(points)
            if not kind.startswith("cudp") and gs == [1]:
                continue  # a lone PyTorch single-GPU point: drawn once, below
            label = names[kind] + (f" ({prec})" if prec and prec != "fp32" else "")
            style = dict(styles[kind])
            if prec == "tf32":
                style["alpha"] = 0.6
            ax.plot(gs, [points[g] for g in gs], label=label, **style)
        lone = [(prec, p[1]) for (kind, prec), p in series.items() if kind == "dp" and list(p) == [1]]
        for prec, v in lone:
            ax.plot([1], [v], marker="D", color="tab:red", linestyle="none",
                    label="PyTorch 1 GPU" + (f" ({prec})" if prec != "fp32" else ""))
        ax.set_title(f"{model}, {size}², batch {batch}/GPU")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("images / s")
        ax.set_xticks(all_g)
        ax.margins(y=0.08)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Training throughput against GPU count (fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---- the report ----------------------------------------------------------------------------------

def machine_md(m):
    if not m:
        return "_No machine information (machine.json absent)._"
    keys = [("date", "date"), ("host", "host"), ("gpus", "GPUs"), ("gpu_name", "GPU"),
            ("gpu_memory", "GPU memory"), ("driver", "driver"), ("cuda", "CUDA (nvcc)"),
            ("cudnn", "cuDNN (headers)"), ("nccl", "NCCL (headers)"), ("pytorch", "PyTorch"),
            ("pytorch_cuda", "PyTorch's CUDA"), ("pytorch_cudnn", "PyTorch's cuDNN"),
            ("pytorch_nccl", "PyTorch's NCCL"), ("git_commit", "cudp commit"), ("interconnect", "interconnect")]
    body = [[label, m[k]] for k, label in keys if m.get(k) not in (None, "")]
    body += [[k, v] for k, v in m.items() if k not in dict(keys) and isinstance(v, (str, int, float))]
    return md_table(["", ""], body, ["---", "---"])


def headline(train, comm):
    lines = []
    # One GPU: each cudp setting (model, size, precision, graphs) against the PyTorch setting a user
    # would pick at that precision, the fastest in the same run of those of the same precision
    # (eager or compiled: at 32² compiled can be the slower), or, in a run that has none of that
    # precision, the fastest of any; from the last run that has the cudp setting, runs being in the
    # order given (--raw, then each --training: oldest first). Every comparison stays in the
    # training table.
    best, runs_of = {}, {}
    for r in train:
        if not (r["gpus"] == 1 and r.get("pytorch_mode") == "single" and r.get("cudp_over_pytorch")):
            continue
        precision = r.get("cudp_precision") or "fp32"
        key = (r["model"], r["size"], precision, r.get("cudp_graphs"))
        same = str(r["pytorch_precision"]).split()[0] == precision
        rank = (r.get("run"), same, r["pytorch_images_per_s"] or 0)
        if key in best and best[key][0][0] == r.get("run"):
            if rank <= best[key][0]:
                continue
        else:
            runs_of.setdefault(key, []).append(r.get("run"))
            best.pop(key, None)  # re-inserted: the order is that of the last runs
        best[key] = (rank, r)
    for key, (_, r) in best.items():
        graphs = ", graphs" if r.get("cudp_graphs") == "on" else ""
        earlier = len(set(runs_of[key])) - 1
        lines.append(f"- {r['model']} {r['size']}², 1 GPU, run {r.get('run', '?')}: cudp "
                     f"({r.get('cudp_precision') or 'fp32'}{graphs}) "
                     f"{fmt(r['cudp_images_per_s'], 0)} img/s, "
                     f"PyTorch ({r['pytorch_precision']}) {fmt(r['pytorch_images_per_s'], 0)}: "
                     f"**{fmt(r['cudp_over_pytorch'], 2, '×')}**"
                     + (f" ({earlier} earlier run{'s' if earlier > 1 else ''} in the table below)"
                        if earlier else ""))
    seen = set()
    for r in train:
        key = (r["model"], r["size"], r["gpus"], r.get("processes") or 1)
        if (r.get("processes") or 1) > 1:
            if key not in seen and r["cudp_images_per_s"] is not None:
                seen.add(key)
                graphs = "graphs on" if r.get("cudp_graphs") == "on" else "graphs off"
                lines.append(f"- {r['model']} {r['size']}², {r['processes']} processes of one GPU "
                             f"(DDP, {r.get('cudp_precision') or 'fp32'}, {graphs}): cudp "
                             f"{fmt(r['cudp_images_per_s'], 0)} img/s, "
                             f"**{fmt(r.get('cudp_over_one_process'), 2, '×')}** one process on "
                             f"{r['gpus']} GPUs (the bar: ≥ 0.98×), scaling efficiency "
                             f"{fmt(r['cudp_scaling_efficiency'], 2)}")
            if r.get("pytorch_mode") == "ddp" and r.get("cudp_over_pytorch"):
                lines.append(f"- {r['model']} {r['size']}², {r['gpus']} GPUs: cudp DDP vs PyTorch DDP "
                             f"({r['pytorch_precision']}) **{fmt(r['cudp_over_pytorch'], 2, '×')}**")
            continue
        if r["gpus"] > 1 and r["cudp_scaling_efficiency"] is not None and key not in seen:
            seen.add(key)
            share = r["cudp_allreduce_share_of_step"]
            lines.append(f"- {r['model']} {r['size']}², {r['gpus']} GPUs: cudp scaling efficiency "
                         f"**{fmt(r['cudp_scaling_efficiency'], 2)}**"
                         + (f", gradient all-reduce alone {fmt(100 * share, 1)}% of a step" if share else ""))
        if r["gpus"] > 1 and r.get("pytorch_mode") == "ddp" and r.get("cudp_over_pytorch"):
            lines.append(f"- {r['model']} {r['size']}², {r['gpus']} GPUs: cudp vs PyTorch DDP "
                         f"({r['pytorch_precision']}) **{fmt(r['cudp_over_pytorch'], 2, '×')}**")
    for r in comm:
        if r["bytes"] == VGG16_GRAD_BYTES:
            lines.append(f"- all-reduce of VGG-16's fp32 gradients on {r['gpus']} GPUs: cudp "
                         f"{fmt(r['cudp_busbw_gbs'], 1)} GB/s, NCCL {fmt(r['nccl_busbw_gbs'], 1)} GB/s bus "
                         f"bandwidth (**{fmt(r['cudp_over_nccl'], 3, '×')}**)")
    return "\n".join(lines) if lines else "_Nothing to summarise._"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw", default="bench/report/raw", help="directory with the benches' JSON files")
    p.add_argument("--out", default="bench/report", help="where report.md, report.json, scaling.png go")
    p.add_argument("--machine", help="machine-info JSON (default: RAW/machine.json)")
    p.add_argument("--title", default="cudp benchmark report")
    p.add_argument("--training", action="append", default=[], metavar="DIR",
                   help="another run's directory of train_cudp*.json / train_torch*.json to add")
    args = p.parse_args()

    inputs = {}

    def read(name, directory=None):
        objects, problem = load_objects(os.path.join(directory or args.raw, name))
        inputs[name if directory is None else f"{os.path.basename(os.path.normpath(directory))}/{name}"] = (
            problem or f"{len(objects)} object(s)")
        return objects

    machine_objs, problem = load_objects(args.machine or os.path.join(args.raw, "machine.json"))
    inputs[os.path.basename(args.machine) if args.machine else "machine.json"] = problem or "read"
    machine = machine_objs[0] if machine_objs else {}

    def read_all(pattern, default, directory=None):  # every file matching, or the default (absent)
        names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(directory or args.raw, pattern)))
        return [o for name in names or [default] for o in read(name, directory)]

    def read_training(directory=None):
        cudp = [o for o in read_all("train_cudp*.json", "train_cudp.json", directory)
                if str(o.get("framework", "cudp")).startswith("cudp")]
        torch = [o for o in read_all("train_torch*.json", "train_torch.json", directory)
                 if str(o.get("framework", "pytorch")).startswith("pytorch")]
        return training(cudp, torch, os.path.basename(os.path.normpath(directory or args.raw)))

    runs = read("runs.json") if os.path.exists(os.path.join(args.raw, "runs.json")) else []
    inputs.pop("runs.json", None)
    train = read_training()
    main_run = list(train)  # the plot's: the other runs are kept beside it, not on its lines
    for directory in args.training:
        train += read_training(directory)
    comm = allreduce(read("comm.json"))
    kernels = []
    for bench in KERNEL_BENCHES:
        for doc in read_all(f"{bench}*.json", f"{bench}.json"):  # gemm.json, gemm_bf16.json, ...
            kind = doc.get("benchmark") if doc.get("benchmark") in KERNEL_BENCHES else bench
            kernels += kernel_rows(kind, doc)

    os.makedirs(args.out, exist_ok=True)
    plot_problem = plot_scaling(main_run, os.path.join(args.out, "scaling.png"))
    if plot_problem is not None and os.path.exists(os.path.join(args.out, "scaling.png")):
        os.remove(os.path.join(args.out, "scaling.png"))  # an older run's plot would mislead

    md = [f"# {args.title}", ""]
    if machine.get("date"):
        md += [f"Generated from the run of {machine['date']} ({os.path.basename(os.path.normpath(args.raw))})"
               + "".join(f"; training rows also from {os.path.basename(os.path.normpath(d))} (another run: "
                         f"its README in {d} gives its date, machine and commands)" for d in args.training)
               + ".", ""]
    md += ["## Machine", "", machine_md(machine), "",
           "## Headline", "", headline(train, comm), "",
           "## Training throughput (bench_train vs bench/pytorch_train.py)", "",
           "Images per second of the median of timed windows of steps (data already on the GPU; "
           "each window's figure is in the raw JSON). Scaling = img/s on g GPUs / "
           "(g × img/s on 1 GPU) of the same framework (PyTorch's DataParallel and DDP against PyTorch "
           "on 1 GPU). cudp/PyTorch compares the same GPU count within one run (the run column). cudp "
           "runs as one process on its GPUs (1 GPU, DataParallel), or as N processes of one GPU each "
           "(DDP, `mpirun -np N bench_train`), which are set against PyTorch's DDP only. The "
           "all-reduce column is cudp's gradient all-reduce timed alone, an upper bound of the "
           "communication a step exposes.", "",
           training_md(train), ""]
    if plot_problem is None:
        md += ["![img/s against GPU count](scaling.png)", ""]
    else:
        md += [f"_({plot_problem})_", ""]
    md += ["## Kernels: ours vs the vendor libraries", ""]
    # What the JSON cannot say about the kernel rows (where and when some were measured): a note
    # kept beside them, RAW/notes-kernels.md, goes before the table as it is.
    notes_path = os.path.join(args.raw, "notes-kernels.md")
    if os.path.exists(notes_path):
        with open(notes_path, encoding="utf-8") as f:
            md += [f.read().strip(), ""]
    md += [
           "TFLOP/s for GEMM and convolution (2·m·n·k and 2·N·P·Q·K·R·S·C), GB/s of the least bytes an op "
           "must move for the memory-bound ones; the vendor is cuBLAS / cuDNN, or the measured "
           "device-to-device copy where cuDNN has no such op. Ratio > 1: ours is faster.", "",
           kernels_md(kernels), "",
           "## All-reduce (bench_comm): cudp's Communicator vs raw NCCL", "",
           "fp32 sum in place; bus bandwidth = bytes / time × 2(n−1)/n; median of repetitions.", "",
           allreduce_md(comm), "",
           "## Inputs", "",
           md_table(["file", "status"], [[k, v] for k, v in inputs.items()], ["---", "---"]), ""]
    if runs:
        md += ["## Runs (scripts/bench-report.sh)", "",
               md_table(["bench", "status", "seconds", "command"],
                        [[r.get("bench", "?"), r.get("status", "?"), r.get("seconds", ""),
                          "`" + str(r.get("command", "")) + "`"] for r in runs],
                        ["---", "---", "---:", "---"]), ""]
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    with open(os.path.join(args.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump({"machine": machine, "training": train, "kernels": kernels, "allreduce": comm,
                   "inputs": inputs, "runs": runs, "plot": "scaling.png" if plot_problem is None else None},
                  f, indent=1)
        f.write("\n")
    print(f"report.py: wrote {os.path.join(args.out, 'report.md')}, report.json"
          + (", scaling.png" if plot_problem is None else f" ({plot_problem})"))
    missing = [k for k, v in inputs.items() if v in ("absent", "empty") or v.startswith("no JSON")]
    if missing:
        print("report.py: missing or empty: " + ", ".join(missing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
