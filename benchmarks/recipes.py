"""Default recipes against hand-picked ones and ``--base-lr auto``, and transparent images.

    python benchmarks/recipes.py [--work DIR] [--only NAME ...]

Cases (one process each, 2 vCPUs are enough; results go to RESULTS.md by hand):

* ``frozen-vgg16``: a frozen VGG16 backbone with a new head, on the demo
  images. No ImageNet weights can be downloaded here, so the backbone is a
  VGG16 made here whose last convolution is scaled so that its pooled
  features are as large as those that made the default SGD diverge on a
  real VGG16 (a linear head on unnormalised features of norm ~100). Runs:
  the defaults, a hand-picked Adam rate, ``--base-lr auto``, and the head
  without its LayerNormalization (``--head-norm none``); then the whole
  network trained (not frozen) with the defaults and with ``--base-lr auto``.
* ``demo``: the demo recipe (MobileNetV2 from scratch) with its hand-picked
  0.01 against ``--base-lr auto``.
* ``alpha``: clip-art-like transparent PNGs (a shape per class on a
  transparent background; under the transparent pixels each file stores
  random colours), trained once composited (the default) and once with the
  alpha channel dropped as before (the same files saved as RGB).

Each run prints held-out accuracy, the largest training loss of any epoch and
the base learning rate used.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HVD_TRAIN = [sys.executable, "-m", "hvd_train"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore"}


def vgg16_weights(path: str, image_size: int, data: str, target_norm: float = 100.0) -> float:
    """A VGG16 backbone (include_top=False) whose pooled features have an L2 norm of about ``target_norm``."""
    from hvd_train import compat  # noqa: F401
    from hvd_train.compat import keras
    from hvd_train.model.catalogue import get_spec

    keras.utils.set_random_seed(0)
    model = keras.applications.VGG16(include_top=False, weights=None, input_shape=(image_size, image_size, 3))
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(data) for f in fs if f.endswith((".png", ".jpg")))[::20]
    from PIL import Image

    images = np.stack(
        [np.asarray(Image.open(f).convert("RGB").resize((image_size, image_size)), np.float32) for f in files]
    )
    features = lambda: keras.layers.GlobalAveragePooling2D()(model(get_spec("VGG16").preprocess_input()(images)))  # noqa: E731
    norm = float(np.linalg.norm(features(), axis=1).mean())
    last = model.get_layer("block5_conv3")
    kernel, bias = last.get_weights()
    last.set_weights([kernel * target_norm / norm, bias])  # ReLU is positively homogeneous: the norm scales
    scaled = float(np.linalg.norm(features(), axis=1).mean())
    model.save_weights(path)
    return scaled


def train(name: str, work: str, data: str, options: list[str]) -> dict:
    out = os.path.join(work, name)
    started = time.perf_counter()
    proc = subprocess.run(
        [*HVD_TRAIN, "train", "--data", data, "--output", out, "--no-resume", "--no-tensorboard", *options],
        env=ENV,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{name} failed")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    result = {
        "run": name,
        "val_accuracy": round(summary["val_accuracy"], 4),
        "max_train_loss": round(max(float(r["loss"]) for r in rows), 3),
        "final_train_loss": round(float(rows[-1]["loss"]), 3),
        "base_lr": summary["base_lr"],
        "seconds": round(time.perf_counter() - started),
    }
    print(json.dumps(result), flush=True)
    return result


def transparent_folder(root: str, per_class: int = 60, size: int = 48, seed: int = 0) -> tuple[str, str]:
    """Two copies of a clip-art-like set: RGBA PNGs, and the same pixels with alpha dropped (RGB PNGs)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    shapes = ("circle", "square", "triangle", "cross", "ring")
    rgba_root, rgb_root = os.path.join(root, "rgba"), os.path.join(root, "alpha-dropped")
    for shape in shapes:
        for folder in (rgba_root, rgb_root):
            os.makedirs(os.path.join(folder, shape), exist_ok=True)
        for i in range(per_class):
            # Under the transparent pixels: blobs of random colours, as editors leave them.
            hidden = rng.integers(0, 256, (size // 8, size // 8, 3)).astype(np.uint8)
            pixels = np.asarray(Image.fromarray(hidden).resize((size, size), Image.NEAREST))
            alpha = Image.new("L", (size, size), 0)
            draw = ImageDraw.Draw(alpha)
            s, c = rng.integers(size // 4, size // 2 - 2), rng.integers(size // 2 - 4, size // 2 + 4, 2)
            box = [int(c[0] - s), int(c[1] - s), int(c[0] + s), int(c[1] + s)]
            if shape == "circle":
                draw.ellipse(box, fill=255)
            elif shape == "square":
                draw.rectangle(box, fill=255)
            elif shape == "triangle":
                draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=255)
            elif shape == "cross":
                w = max(2, int(s) // 3)
                draw.rectangle([box[0], int(c[1]) - w, box[2], int(c[1]) + w], fill=255)
                draw.rectangle([int(c[0]) - w, box[1], int(c[0]) + w, box[3]], fill=255)
            else:
                draw.ellipse(box, fill=255)
                inner = max(2, int(s) // 2)
                draw.ellipse([int(c[0]) - inner, int(c[1]) - inner, int(c[0]) + inner, int(c[1]) + inner], fill=0)
            colour = rng.integers(0, 256, 3).astype(np.uint8)
            rgb = np.array(pixels)
            mask = np.asarray(alpha) > 0
            rgb[mask] = colour  # the shape: one colour; the rest stays hidden under alpha 0
            Image.fromarray(np.dstack([rgb, np.asarray(alpha)]), "RGBA").save(
                os.path.join(rgba_root, shape, f"{i:03d}.png")
            )
            Image.fromarray(rgb, "RGB").save(os.path.join(rgb_root, shape, f"{i:03d}.png"))
    return rgba_root, rgb_root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "hvd-train-recipes"))
    parser.add_argument("--only", nargs="*", default=["frozen-vgg16", "demo", "alpha"])
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    from hvd_train import compat  # noqa: F401
    from hvd_train.demo import make_demo_data

    common = ["--threads-per-rank", "2", "--val-split", "0.2", "--seed", "1"]
    if "frozen-vgg16" in args.only or "demo" in args.only:
        demo = make_demo_data(os.path.join(args.work, "demo-data"))
    if "frozen-vgg16" in args.only:
        weights = os.path.join(args.work, "vgg16-notop.weights.h5")
        norm = vgg16_weights(weights, 64, demo)
        print(f"VGG16 backbone made here: pooled feature norm {norm:.1f}")
        base = ["--model", "vgg16", "--weights", weights, "--freeze-backbone", "--image-size", "64", "--epochs", "6"]
        base += common
        train("vgg16-defaults", args.work, demo, base)
        train("vgg16-defaults-head-norm-none", args.work, demo, [*base, "--head-norm", "none"])
        train("vgg16-adam-0.0005", args.work, demo, [*base, "--optimizer", "adam", "--base-lr", "0.0005"])
        train("vgg16-auto", args.work, demo, [*base, "--base-lr", "auto"])
        train("vgg16-auto-head-norm-none", args.work, demo, [*base, "--base-lr", "auto", "--head-norm", "none"])
        whole = [b for b in base if b != "--freeze-backbone"]
        train("vgg16-whole-defaults", args.work, demo, whole)
        train("vgg16-whole-auto", args.work, demo, [*whole, "--base-lr", "auto"])
    if "demo" in args.only:
        from hvd_train.commands.demo import DEMO_OPTIONS

        train("demo-0.01", args.work, demo, [*DEMO_OPTIONS, *common])
        options = list(DEMO_OPTIONS)
        options[options.index("--base-lr") + 1] = "auto"
        train("demo-auto", args.work, demo, [*options, *common])
        train("demo-0.01-head-norm-layer", args.work, demo, [*DEMO_OPTIONS, *common, "--head-norm", "layer"])
    if "alpha" in args.only:
        rgba, dropped = transparent_folder(os.path.join(args.work, "alpha-data"))
        opts = ["--model", "MobileNetV2", "--weights", "none", "--image-size", "48", "--batch-size", "16"]
        opts += ["--epochs", "10", "--warmup-epochs", "1", "--augment", "flip", "--crop-fraction", "1.0", *common]
        train("alpha-composited-white", args.work, rgba, opts)
        train("alpha-dropped", args.work, dropped, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
