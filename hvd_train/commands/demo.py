"""``hvd-train demo``: make the demo images and fine-tune on them with horovodrun."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

# Small enough for two CPU processes in a few minutes, from scratch (no
# weights can be downloaded everywhere): BatchNorm trains with momentum 0.9.
DEMO_OPTIONS = [
    "--model",
    "MobileNetV2",
    "--weights",
    "none",
    "--image-size",
    "64",
    "--batch-size",
    "16",
    "--epochs",
    "12",
    "--base-lr",
    "0.01",
    "--warmup-epochs",
    "1",
    "--val-split",
    "0.2",
    "--augment",
    "flip",
    "--crop-fraction",
    "1.0",
]


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train on generated demo images with horovodrun and report held-out accuracy",
        description="Generates a small labelled image set (shapes; nothing is downloaded) and "
        "fine-tunes a small model on it with `horovodrun -np N` on this machine.",
    )
    parser.add_argument("--np", type=int, default=2, help="number of Horovod processes")
    parser.add_argument("--data", default="demo/data", help="where to write the demo images")
    parser.add_argument("--output", default="demo/run", help="training output folder")
    parser.add_argument("--images-per-class", type=int, default=200)
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit non-zero when held-out accuracy ends below this"
    )
    parser.add_argument(
        "extra", nargs=argparse.REMAINDER, help="further `hvd-train train` options after --, e.g. -- --epochs 5"
    )
    parser.set_defaults(run=run)


def train_command(args: argparse.Namespace) -> list[str]:
    """The exact horovodrun command the demo runs."""
    horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
    extra = [a for a in args.extra if a != "--"]
    return [
        horovodrun,
        "-np",
        str(args.np),
        "--gloo",
        sys.executable,
        "-m",
        "hvd_train",
        "train",
        "--data",
        args.data,
        "--output",
        args.output,
        "--no-resume",
        *DEMO_OPTIONS,
        *extra,
    ]


def run(args: argparse.Namespace) -> int:
    from hvd_train.compat import keras  # noqa: F401  (TensorFlow for the image encoder)
    from hvd_train.demo import make_demo_data
    from hvd_train.errors import UserError
    from hvd_train.log import get_logger

    log = get_logger()
    if args.np < 1:
        raise UserError(f"`--np` must be >= 1. Received: np={args.np}.")
    make_demo_data(args.data, per_class=args.images_per_class)
    log.info("demo images in %s", args.data)
    command = train_command(args)
    log.info("running: %s", shlex.join(command))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    code = subprocess.call(command, env=env)
    if code:
        log.error("training failed with exit status %d", code)
        return code
    with open(os.path.join(args.output, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    accuracy = summary["val_accuracy"]
    print(
        f"demo: held-out accuracy {accuracy:.4f} on {summary['val_images']} images "
        f"({summary['world_size']} workers, {summary['images_per_sec']:.1f} images/s)"
    )
    if accuracy < args.min_accuracy:
        log.error("held-out accuracy %.4f is below --min-accuracy %.2f", accuracy, args.min_accuracy)
        return 1
    return 0
