"""Training end to end at many classes, the head data-parallel and sharded by class (``--head-parallel``).

Writes ``--classes`` classes of two 32 px PNGs each (each class a coarse
pattern of its own, with noise), then trains them in both layouts:

    horovodrun -np NP --gloo hvd-train train --data DATA --val-split 0.5 --model MODEL --weights none
        --image-size 32 --batch-size 32 --epochs E --threads-per-rank 1 --check-images none --augment none
        [--head-parallel NP]

each under ``/usr/bin/time -v``: half the images trained on, half held out
and scored exactly. Prints, per layout, images/s (median of the epochs
after the first), the held-out images scored and how long that took, the
peak memory of the larger rank (GNU time's maximum resident set: the
largest process it waited for) and the wall time.

``--features F`` trains a backbone of the benchmark's own (three
convolutions, then F features) instead of ``--model``: the head's cost is
F x C, so a small F reaches more classes in the same time.

    python benchmarks/many_classes.py --classes 20000 [--model MobileNetV2] [--np 2] [--epochs 2]
    python benchmarks/many_classes.py --classes 100000 --features 256 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

BACKBONE = """
import keras  # the run's Keras


def backbone(input_shape):
    images = keras.Input(input_shape)
    x = images
    for n, filters in enumerate((32, 64, {features})):
        x = keras.layers.Conv2D(filters, 3, strides=2, padding="same", use_bias=False, name=f"conv{{n}}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{{n}}")(x)
        x = keras.layers.ReLU(name=f"relu{{n}}")(x)
    return keras.Model(images, x, name="wide")
"""


def write_data(root: str, classes: int, size: int = 32, seed: int = 0) -> str:
    """``root/cNNNNNN/{0,1}.png``: two noisy draws of each class's own 4 x 4 pattern (kept if complete)."""
    import tensorflow as tf

    marker = os.path.join(root, f".complete-{classes}-{size}-{seed}")
    if os.path.exists(marker):
        return root
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = os.path.join(root, f"c{c:06d}")
        os.makedirs(folder, exist_ok=True)
        pattern = np.kron(rng.integers(0, 256, (4, 4, 3)), np.ones((size // 4, size // 4, 1)))
        for i in range(2):
            noisy = np.clip(pattern + rng.normal(0, 24, pattern.shape), 0, 255).astype(np.uint8)
            with open(os.path.join(folder, f"{i}.png"), "wb") as f:
                f.write(tf.io.encode_png(noisy).numpy())
    open(marker, "w").close()
    return root


def train(data: str, out: str, args, split: bool) -> dict:
    model = args.model
    if args.features:
        path = os.path.join(os.path.dirname(out), "wide_net.py")
        with open(path, "w") as f:
            f.write(BACKBONE.format(features=args.features))
        model = f"{path}:backbone"
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    command = [
        "/usr/bin/time", "-v", horovodrun, "-np", str(args.np), "--gloo",
        sys.executable, "-m", "hvd_train", "train", "--data", data, "--val-split", "0.5", "--output", out,
        "--model", model, "--weights", "none", "--image-size", "32", "--batch-size", "32",
        "--epochs", str(args.epochs), "--threads-per-rank", "1", "--check-images", "none", "--augment", "none",
        "--no-tensorboard",
    ]  # fmt: skip
    if split:
        command += ["--head-parallel", str(args.np)]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"training failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    return {
        "layout": f"--head-parallel {args.np}" if split else "data-parallel",
        # The median of the epochs after the first; with one epoch, the first's (its tracing included).
        "images_per_sec": summary["images_per_sec"] or summary["images_per_sec_first_epoch"],
        "val_images": summary["val_images"],
        "val_seconds": summary["val_seconds"],
        "val_accuracy": summary["val_accuracy"],
        "peak_gb": peak / 1e9,
        "wall_s": wall,
        "saved_model": summary.get("saved_model"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=20_000)
    parser.add_argument("--model", default="MobileNetV2")
    parser.add_argument("--features", type=int, default=0, help="the benchmark's own backbone of F features")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--layouts", default="split,data", help="split, data or both (comma-separated)")
    parser.add_argument("--data", default="", help="where the images go (default: a temporary folder)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="many-classes-") as tmp:
        started = time.perf_counter()
        data = write_data(args.data or os.path.join(tmp, "data"), args.classes)
        print(f"{args.classes} classes, {2 * args.classes} images written in {time.perf_counter() - started:.0f} s")
        rows = []
        for layout in args.layouts.split(","):
            row = train(data, os.path.join(tmp, f"run-{layout}"), args, split=layout == "split")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| layout | images/s | held-out images scored | peak memory of the larger rank | wall time |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        minutes, seconds = divmod(round(r["wall_s"]), 60)
        print(
            f"| {r['layout']} | {r['images_per_sec']:.1f} | {r['val_images']:,} (in {r['val_seconds']:.1f} s) "
            f"| {r['peak_gb']:.2f} GB | {minutes}:{seconds:02d} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
