#!/usr/bin/env python3
"""Writes the PyTorch golden file that tests/pytorch/golden_gpu_test.cpp compares cudp against.

The model is cudp's vgg11 with batch norm and the compact head (layers/vgg.h: VggHead::Compact)
on 1x32x32 inputs with 10 classes, built here in plain PyTorch with torchvision's names:

  features    [Conv2d(3x3, padding 1), BatchNorm2d, ReLU] blocks and MaxPool2d(2, 2), config A
  classifier  Linear(512, 512), ReLU, Dropout(p=0), Linear(512, 512), ReLU, Dropout(p=0),
              Linear(512, 10)

Dropout is off (p = 0, the identity) so that the run is deterministic, while BatchNorm is in
training mode (batch statistics, running statistics updated), as in training.

With fixed seeds it initialises the model (torchvision's scheme, plus small random biases and
BatchNorm affine parameters and running statistics, so that no tensor is trivially zero or one),
draws one batch, and runs K steps of SGD with momentum and weight decay (the seed program's
optimizer) on that batch, recording:

  init.<name>     the state_dict before training (parameters and buffers, PyTorch layout)
  input           the batch, NCHW as PyTorch takes it (cudp takes NHWC: the test converts)
  labels          int32
  logits, loss    of the first forward
  grad.<name>     every parameter's gradient after the first backward
  losses          the loss of each of the K steps
  final.<name>    the state_dict after K steps (parameters, running statistics, counters)

and, on a CUDA device, the first forward of the same model and batch in float32 under PyTorch's
reduced precisions, which cudp's precision policies are compared with:

  bf16.logits, bf16.loss   under torch.autocast(cuda, bfloat16) (bf16 products, bf16 activations)
  tf32.logits, tf32.loss   with TF32 allowed for cuDNN and cuBLAS (fp32 storage, TF32 products)

By default the computation runs in float64 (the inputs and initial values are float32 numbers,
so both sides start from the same values) and everything is stored as float32: the test then
measures cudp's own fp32 error against a reference whose error is negligible. --dtype float32
gives a plain fp32 PyTorch reference instead (TF32 is off either way, cuDNN is deterministic).

Usage: python3 tests/pytorch/make_golden.py --out <dir>   (writes <dir>/vgg11_bn_golden.safetensors)
"""
import argparse
import os

# Deterministic cuBLAS needs this before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

FILE_NAME = "vgg11_bn_golden.safetensors"
CONFIG_A = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VggCompact(nn.Module):
    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        layers, channels = [], in_channels
        for v in CONFIG_A:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, v, kernel_size=3, padding=1), nn.BatchNorm2d(v),
                           nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(True), nn.Dropout(p=0.0),
            nn.Linear(512, 512), nn.ReLU(True), nn.Dropout(p=0.0),
            nn.Linear(512, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


@torch.no_grad()
def initialise(model):
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.uniform_(m.bias, -0.1, 0.1)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.1, 0.1)
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.05)
            nn.init.uniform_(m.bias, -0.05, 0.05)


def snapshot(tensors, prefix):
    """float32 (integers as they are), contiguous, owning copies under prefix + name."""
    out = {}
    for name, t in tensors.items():
        t = t.detach()
        out[prefix + name] = (t.float() if t.is_floating_point() else t).contiguous().cpu().clone()
    return out


def reduced_precision_forwards(init, x, labels, device):
    """The first forward in float32 under bf16 autocast and under TF32, from the same state."""
    state = {name[len("init."):]: t for name, t in init.items()}
    out = {}
    for name in ("bf16", "tf32"):
        model = VggCompact()
        model.load_state_dict(state, strict=True)
        model = model.to(device).train()
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        torch.backends.cudnn.allow_tf32 = name == "tf32"
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=name == "bf16"):
            logits = model(x.to(device))
            loss = F.cross_entropy(logits.float(), labels.to(device))
        out[name + ".logits"] = logits.float().cpu().contiguous()
        out[name + ".loss"] = loss.float().cpu().reshape(())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write " + FILE_NAME + " into")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="precision of PyTorch's computation (stored as float32 either way)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn, not fail, on an op without one
    torch.manual_seed(args.seed)

    lr, momentum, weight_decay = 0.05, 0.9, 5e-4
    dtype = getattr(torch, args.dtype)
    model = VggCompact()
    initialise(model)  # in float32: the values cudp loads are exactly these
    init = snapshot(model.state_dict(), "init.")
    x = torch.randn(args.batch, 1, 32, 32)
    labels = torch.randint(0, 10, (args.batch,))

    model = model.to(device=args.device, dtype=dtype).train()
    xd = x.to(device=args.device, dtype=dtype)
    yd = labels.to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
    record, losses = {}, []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        logits = model(xd)
        loss = F.cross_entropy(logits, yd)
        loss.backward()
        if step == 0:
            record["logits"] = logits.detach().float().cpu().contiguous()
            record["loss"] = loss.detach().float().cpu().reshape(())
            record.update(snapshot({n: p.grad for n, p in model.named_parameters()}, "grad."))
        losses.append(loss.item())
        optimizer.step()

    tensors = {**init, **record, **snapshot(model.state_dict(), "final.")}
    if str(args.device).startswith("cuda"):
        tensors.update(reduced_precision_forwards(init, x, labels, args.device))
    tensors["input"] = x.contiguous()
    tensors["labels"] = labels.to(torch.int32).contiguous()
    tensors["losses"] = torch.tensor(losses, dtype=torch.float32)
    metadata = {
        "model": "vgg11_bn compact head, 1x32x32 inputs, 10 classes, dropout p=0",
        "k_steps": str(args.steps), "lr": repr(lr), "momentum": repr(momentum),
        "weight_decay": repr(weight_decay), "batch": str(args.batch), "seed": str(args.seed),
        "compute_dtype": args.dtype, "device": str(args.device), "torch": torch.__version__,
        "cudnn_deterministic": "true", "tf32": "false",
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, FILE_NAME)
    save_file(tensors, path, metadata=metadata)
    print(f"wrote {path}: {len(tensors)} tensors, losses {losses}")


if __name__ == "__main__":
    main()
