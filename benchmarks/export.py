"""Size and latency of each export of a run, in its own runtime, on this CPU.

    python benchmarks/export.py RUN_DIR [--threads 1] [--repeats 20]

Exports RUN_DIR (a finished `hvd-train train` folder) as SavedModel, TFLite
and ONNX, unquantised, float16 and int8 (`hvd-train export --check` each,
into a temporary folder), then times a forward pass at batch 1 and batch 32
in TensorFlow (the SavedModel's `serving_uint8`, images already decoded),
LiteRT and ONNX Runtime, all with the same number of threads. Latency per
image is the median of --repeats timed runs after two untimed ones, divided
by the batch. Prints Markdown; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def export(run_dir: str, folder: Path, quantize: str, formats: str) -> dict:
    command = [sys.executable, "-m", "hvd_train", "export", run_dir, "--output", str(folder), "--check"]
    command += ["--format", formats, "--quantize", quantize]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"export failed ({quantize}):\n{done.stderr[-3000:]}")
    with open(folder / "manifest.json", encoding="utf-8") as f:
        return json.load(f)


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def timed(call, repeats: int) -> float:
    call()
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def runner(fmt: str, path: Path, threads: int):
    """A function of a uint8 batch that runs the file in its runtime."""
    if fmt != "savedmodel":
        from hvd_train.results.export.formats import (
            runner as file_runner,
        )  # the runtime calls of `hvd-train export --check`

        return file_runner(fmt, str(path), threads)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    serve = tf.saved_model.load(str(path)).signatures["serving_uint8"]
    return lambda batch: serve(images=tf.constant(batch))["probabilities"].numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with open(os.path.join(args.run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    size = summary["image_size"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for quantize, formats in (
            ("none", "savedmodel,tflite,onnx"),
            ("float16", "tflite,onnx"),
            ("int8", "tflite,onnx"),
        ):
            folder = Path(tmp) / quantize
            manifest = export(args.run_dir, folder, quantize, formats)
            for entry, parity in zip(manifest["formats"], manifest["check"]["formats"]):
                path = folder / entry["path"]
                run = runner(entry["format"], path, args.threads)
                rng = np.random.default_rng(0)
                per_image = []
                for batch in (1, 32):
                    images = rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8)
                    per_image.append(timed(lambda images=images, run=run: run(images), args.repeats) / batch)
                rows.append((entry["path"], quantize, size_of(path), *per_image, parity))
    print(f"{summary['model']}, {size} px, {args.threads} thread(s); latency per image, median of {args.repeats}\n")
    print("| file | quantize | size (MB) | batch 1 (ms) | batch 32 (ms/image) | agreement | max \\|Δp\\| |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for path, quantize, nbytes, one, many, parity in rows:
        print(
            f"| {path} | {quantize} | {nbytes / 1e6:.1f} | {1e3 * one:.2f} | {1e3 * many:.2f} | "
            f"{parity['top1_agreement']:.1%} | {parity['max_abs_diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
