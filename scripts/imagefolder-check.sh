#!/usr/bin/env bash
# Issue 17's GPU check: cudp-vgg trains VGG-16-BN (torchvision head) on an ImageFolder of JPEGs and
# PNGs, writes its run folder, and its best checkpoint loads strictly into
# torchvision.models.vgg16_bn and gives the same test accuracy there, on the very same test images
# (cudp-vgg --save-test-set writes them as the model sees them).
#
#   scripts/imagefolder-check.sh [BUILD_DIR] [WORK_DIR]     (defaults: build, /tmp/cudp-imagefolder)
#
# Needs: a built cudp-vgg, python3 with numpy and Pillow (to make the images), torch, torchvision
# and safetensors (to check). Also prints the decoding speed (one worker and all of them) and the
# training speed at 224x224.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
work=${2:-/tmp/cudp-imagefolder}
vgg=$build/examples/cudp-vgg
[[ -x $vgg ]] || { echo "imagefolder-check: $vgg is not built" >&2; exit 1; }
python3 -c "import numpy, PIL, torch, torchvision, safetensors" || {
  echo "imagefolder-check: needs python3 with numpy, Pillow, torch, torchvision, safetensors" >&2
  exit 1
}
mkdir -p "$work"
# cudp reads JPEG through libturbojpeg.so.0 (Debian/Ubuntu libturbojpeg0), loaded at run time;
# without it the images are all PNG (and the check says so).
jpeg=1
if ! ldconfig -p | grep 'libturbojpeg\.so\.0' >/dev/null; then
  jpeg=0
  echo "imagefolder-check: libturbojpeg.so.0 is absent (apt-get install libturbojpeg0): PNG only"
fi
export CUDP_CHECK_JPEG=$jpeg

# 10 classes told apart by colour and stripe frequency, with random phases and noise; 300 train
# and 60 val images per class at 80x72 (resized and cropped by the reader), half JPEG, half PNG.
make_images() {  # dir side-length images-per-class-train images-per-class-val
  python3 - "$@" <<'EOF'
import os, sys
import numpy as np
from PIL import Image
root, w, n_train, n_val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
h = w * 9 // 10
rng = np.random.default_rng(0)
for split, n in (("train", n_train), ("val", n_val)):
    for c in range(10):
        folder = os.path.join(root, split, f"class{c:02d}")
        os.makedirs(folder, exist_ok=True)
        hue = np.array([np.cos(c), np.cos(c + 2.1), np.cos(c + 4.2)]) * 90 + 128
        for i in range(n):
            y, x = np.mgrid[0:h, 0:w].astype(np.float32)
            phase = rng.uniform(0, 2 * np.pi)
            stripes = np.sin((x + y * (c % 3 - 1)) * (0.15 + 0.05 * (c // 3)) + phase)[..., None]
            img = hue + 60 * stripes + rng.normal(0, 25, (h, w, 3))
            img = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
            name = os.path.join(folder, f"{i:04d}")
            if i % 2 and os.environ.get("CUDP_CHECK_JPEG") == "1":
                img.save(name + ".jpg", quality=90)
            else:
                img.save(name + ".png")
EOF
}

data=$work/data64
[[ -d $data/val ]] || make_images "$data" 80 300 60
run=$work/run64
rm -rf "$run"
"$vgg" --data folder --data-dir "$data" --image-size 64 --head torchvision --arch vgg16 \
  --epochs 6 --batch-size 128 --lr 0.02 --augment --gpus 0 --output "$run" \
  --save-test-set "$work/test64.safetensors" | tee "$work/train64.log"

python3 - "$run" "$work/test64.safetensors" <<'EOF'
import csv, sys
import torch, torchvision
from safetensors import safe_open
from safetensors.torch import load_file
run, test = sys.argv[1], sys.argv[2]
torch.backends.cudnn.allow_tf32 = False  # cudp-vgg computes in fp32: compare like with like
torch.backends.cuda.matmul.allow_tf32 = False
rows = list(csv.DictReader(open(f"{run}/metrics.csv")))
best = max(rows, key=lambda r: float(r["test_top1"]))  # the first epoch with the best top-1
model = torchvision.models.vgg16_bn(num_classes=10)
model.load_state_dict(load_file(f"{run}/best.safetensors"), strict=True)
model = model.cuda().eval()
t = load_file(test)
with safe_open(test, "pt") as f:
    meta = f.metadata()
mean = torch.tensor([float(v) for v in meta["mean"].split(",")]).view(1, 3, 1, 1)
std = torch.tensor([float(v) for v in meta["std"].split(",")]).view(1, 3, 1, 1)
x = (t["images"].permute(0, 3, 1, 2).float() / 255 - mean) / std
labels = t["labels"].long()
correct = 0
with torch.no_grad():
    for i in range(0, len(x), 256):
        correct += (model(x[i:i + 256].cuda()).argmax(1).cpu() == labels[i:i + 256]).sum().item()
acc = 100.0 * correct / len(x)
print(f"cudp-vgg best epoch {best['epoch']}: test top-1 {float(best['test_top1']):.4f}%")
print(f"torchvision.models.vgg16_bn, strict load of best.safetensors: {correct}/{len(x)} = {acc:.4f}%")
diff = abs(acc - float(best["test_top1"])) * len(x) / 100
print("SAME ACCURACY" if diff < 0.5 else f"DIFFERENT by {diff:.0f} image(s)")
sys.exit(0 if diff <= 1.5 else 1)  # an argmax tie broken differently may move one image
EOF

# Decoding and training speed at 224x224: the loader's workers decode every image at every epoch
# (RandomResizedCrop(224) + flip for training). With one worker the input is the bottleneck, so the
# epoch's img/s is one core's decoding rate (its input wait is most of the epoch); with every core
# the input wait shows whether decoding keeps up with training.
data=$work/data224
[[ -d $data/val ]] || make_images "$data" 288 200 20
for j in 1 $(nproc); do
  "$vgg" --data folder --data-dir "$data" --image-size 224 --arch vgg16 --epochs 1 --augment \
    --batch-size 128 --gpus 0 -j "$j" --limit-train 1024 --limit-test 128 | tee "$work/train224-j$j.log" |
    grep -E "^epoch 1/1:" | sed "s/^/-j $j: /"
done
echo "decoding speed: the img/s and input wait of each epoch line above (one worker, then all)"
