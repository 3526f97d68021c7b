"""Training throughput: hvd_train at 1 and 2 ranks against plain tf.keras ``fit``.

Same model (MobileNetV2 from scratch), same images, same per-worker batch,
same input size. Images/s is measured over the epochs after the first (the
first includes graph tracing), over training steps only.

    python benchmarks/throughput.py [--images-per-class 200] [--epochs 4] [--out DIR]
    python benchmarks/throughput.py --pairs 3 [--image-size 96]   # plain fit and hvd-train np=1, alternating

Prints a Markdown table; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def plain_keras_fit(data: str, image_size: int, batch: int, epochs: int, threads: int) -> float:
    """images/s of a textbook tf.keras pipeline and fit() in a fresh process."""
    code = f"""
import os, time, statistics, json
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
import tf_keras as keras
tf.config.threading.set_intra_op_parallelism_threads({threads})
tf.config.threading.set_inter_op_parallelism_threads(max(2, {threads}))
ds = keras.utils.image_dataset_from_directory({data!r}, image_size=({image_size}, {image_size}),
                                             batch_size={batch}, shuffle=True, seed=1)
n = sum(int(x.shape[0]) for x, _ in ds)
pre = keras.applications.mobilenet_v2.preprocess_input
ds = ds.map(lambda x, y: (pre(x), y), num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
base = keras.applications.MobileNetV2(include_top=False, weights=None, input_shape=({image_size}, {image_size}, 3))
x = keras.layers.GlobalAveragePooling2D()(base.output)
model = keras.Model(base.input, keras.layers.Dense(5, activation="softmax")(x))
model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy", ["accuracy"])
times = []
class T(keras.callbacks.Callback):
    def on_epoch_begin(self, e, logs=None): self.t = time.perf_counter()
    def on_epoch_end(self, e, logs=None): times.append(time.perf_counter() - self.t)
model.fit(ds, epochs={epochs}, verbose=0, callbacks=[T()])
print(json.dumps(statistics.median([n / t for t in times[1:]])))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def hvd_train(
    data: str, out: str, np_: int, image_size: int, batch: int, epochs: int, threads: int, pin: bool = False
) -> dict:
    """Runs hvd-train; with ``pin`` each process is bound to one core (taskset / mpirun --bind-to core)."""
    command = [
        sys.executable,
        "-m",
        "hvd_train",
        "train",
        "--data",
        data,
        "--output",
        out,
        "--no-resume",
        "--model",
        "MobileNetV2",
        "--weights",
        "none",
        "--image-size",
        str(image_size),
        "--batch-size",
        str(batch),
        "--epochs",
        str(epochs),
        "--val-split",
        "0",
        "--augment",
        "none",
        "--crop-fraction",
        "1.0",
        "--threads-per-rank",
        str(threads),
        "--no-tensorboard",
    ]
    # hvd_train on tf-keras, as the textbook fit it is compared with (benchmarks/kerases.py compares the Kerases).
    env = dict(os.environ, HVD_TRAIN_KERAS="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if np_ > 1 and pin:
        command = ["mpirun", "-np", str(np_), "--bind-to", "core", "--map-by", "core", "-x", "PATH", *command]
    elif np_ > 1:
        command = [os.path.join(BIN, "horovodrun"), "-np", str(np_), "--gloo", *command]
    elif pin:
        command = ["taskset", "-c", "0", *command]
    subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images-per-class", type=int, default=200)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    parser.add_argument(
        "--pairs", type=int, default=0, help="only plain fit against hvd-train np=1 (all cores), N alternating pairs"
    )
    args = parser.parse_args()

    from hvd_train import compat  # noqa: F401
    from hvd_train.demo import make_demo_data

    work = args.out or tempfile.mkdtemp(prefix="hvd-bench-")
    data = make_demo_data(os.path.join(work, "data"), per_class=args.images_per_class)
    cores = os.cpu_count() or 1
    if args.pairs:
        pairs(data, work, args, cores)
        return
    rows = []
    t0 = time.time()
    rows.append(
        (
            "plain tf.keras fit, 1 process",
            cores,
            plain_keras_fit(data, args.image_size, args.batch_size, args.epochs, cores),
        )
    )
    one_all = hvd_train(data, os.path.join(work, "np1-all"), 1, args.image_size, args.batch_size, args.epochs, cores)
    rows.append(("hvd-train, np=1", cores, one_all["images_per_sec"]))
    two_all = hvd_train(data, os.path.join(work, "np2-all"), 2, args.image_size, args.batch_size, args.epochs, 1)
    rows.append(("hvd-train, np=2 (horovodrun, unpinned)", cores, two_all["images_per_sec"]))
    one = hvd_train(data, os.path.join(work, "np1"), 1, args.image_size, args.batch_size, args.epochs, 1, pin=True)
    rows.append(("hvd-train, np=1 pinned to 1 core (taskset)", 1, one["images_per_sec"]))
    two = hvd_train(data, os.path.join(work, "np2"), 2, args.image_size, args.batch_size, args.epochs, 1, pin=True)
    rows.append(("hvd-train, np=2 pinned 1 core per rank (mpirun --bind-to core)", 2, two["images_per_sec"]))

    print(
        f"machine: {platform.machine()}, {cores} cores, Python {platform.python_version()}, "
        f"TensorFlow {one['tensorflow']}, Horovod {one['horovod']}"
    )
    print(
        f"MobileNetV2 from scratch, {args.image_size}x{args.image_size}, batch {args.batch_size} per worker, "
        f"{5 * args.images_per_class} images, median images/s of epochs 2..{args.epochs}; "
        f"{time.time() - t0:.0f} s in all\n"
    )
    print("| run | cores | images/s |\n|---|---|---|")
    for name, used, rate in rows:
        print(f"| {name} | {used} | {rate:.1f} |")
    plain = rows[0][2]
    print(f"\nhvd-train np=1 / plain fit: {rows[1][2] / plain:.2f}")
    print(f"np=2 / np=1 at one core per rank: {rows[4][2] / rows[3][2]:.2f}")


def pairs(data: str, work: str, args, cores: int) -> None:
    """Plain fit and hvd-train np=1, alternating (the first of each pair alternates too)."""
    import statistics

    plain, ours = [], []
    for i in range(args.pairs):
        for who in ("plain", "ours") if i % 2 == 0 else ("ours", "plain"):
            if who == "plain":
                plain.append(plain_keras_fit(data, args.image_size, args.batch_size, args.epochs, cores))
            else:
                out = os.path.join(work, f"pair-{i}")
                run = hvd_train(data, out, 1, args.image_size, args.batch_size, args.epochs, cores)
                ours.append(run["images_per_sec"])
            print(who, f"{(plain if who == 'plain' else ours)[-1]:.1f}", file=sys.stderr, flush=True)
    print(
        f"MobileNetV2 from scratch, {args.image_size}x{args.image_size}, batch {args.batch_size}, "
        f"{5 * args.images_per_class} images, {cores} cores; images/s, median of epochs 2..{args.epochs}\n"
    )
    print("| plain fit | hvd-train np=1 | ratio |\n|---|---|---:|")
    for p, o in zip(plain, ours):
        print(f"| {p:.1f} | {o:.1f} | {o / p:.2f} |")
    print(f"\nmedian ratio: **{statistics.median(ours) / statistics.median(plain):.2f}**")


if __name__ == "__main__":
    main()
