"""The host's share of a training step: the time between one step's update and the next step's start.

    python benchmarks/host_share.py [--model MobileNetV2] [--image-size 32] [--batch-size 1]
        [--steps 300] [--steps-per-call 1 4] [--before SRC [--before-steps-per-call K]] [--repeats 3]

Every variant runs in a process of its own on one core (``taskset -c 0``,
one TensorFlow thread), with the model's ``train_step`` wrapped so that it
writes ``tf.timestamp()`` into a variable when its batch is there and again
when its update and metrics are done (the step runs as a function of its
own inside the wrapper: a function's outputs wait for all it does). For each step after the first 20
(tracing, the pipeline filling), the *gap* is the next step's start minus
this step's end: what the host does between two steps (the loop's Python,
the call of the compiled function, reading results back), plus taking the
next batch from the pipeline. The host's share is the gaps' sum over the
span of those steps. The variants:

* ``fit``: a bare Keras ``fit`` of the same model on one cached random
  batch (what Horovod's synthetic benchmark runs): the floor.
* ``train K``: ``hvd-train train`` for one epoch on a folder of PNG images,
  ``--steps-per-call K``;
* ``before``: ``hvd-train train`` from the source folder SRC (a checkout of
  an earlier commit), at its default steps per call or at
  ``--before-steps-per-call K``.

Variants alternate within each repeat. Prints Markdown (median over the
repeats of each variant's median gap, median step and share);
benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# tf-keras, as the recorded results (benchmarks/kerases.py compares the Kerases).
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1", HVD_TRAIN_KERAS="2")
WARMUP = 20

# Wraps train_step (the Keras model's and hvd_train's Classifier's) to record each step's start and end.
STAMPS = """
import json, sys
import tensorflow as tf
import tf_keras as keras

BUFFER = {}


def timed(original):
    def train_step(self, data):
        if "stamps" not in BUFFER:
            with tf.init_scope():
                BUFFER["stamps"] = tf.Variable(tf.zeros([200000, 2], tf.float64), trainable=False)
                BUFFER["count"] = tf.Variable(0, dtype=tf.int32, trainable=False)
        with tf.control_dependencies(tf.nest.flatten(data)):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            data = tf.nest.map_structure(tf.identity, data)
        # A function of its own: its outputs come after all it does (the update included),
        # where the metrics alone need only the forward pass.
        out = tf.function(lambda d: original(self, d), autograph=False)(data)
        with tf.control_dependencies(tf.nest.flatten(out)):
            end = tf.timestamp()
        count = BUFFER["count"]
        BUFFER["stamps"].scatter_nd_update(tf.reshape(count, [1, 1]), tf.reshape(tf.stack([start, end]), [1, 2]))
        count.assign_add(1)
        return out
    return train_step


def dump(path):
    count = int(BUFFER["count"].numpy())
    with open(path, "w") as f:
        json.dump(BUFFER["stamps"].numpy()[:count].tolist(), f)
"""

FIT = """
keras.Model.train_step = timed(keras.Model.train_step)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
size, batch, steps, model_name, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
base = getattr(keras.applications, model_name)(include_top=False, weights=None, input_shape=(size, size, 3))
x = keras.layers.GlobalAveragePooling2D()(base.output)
model = keras.Model(base.input, keras.layers.Dense(4, activation="softmax")(x))
model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy", ["accuracy"])
images = tf.random.uniform((batch, size, size, 3), -1, 1)
labels = tf.random.uniform((batch,), maxval=4, dtype=tf.int32)
data = tf.data.Dataset.from_tensors((images, labels)).cache().repeat()
model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
dump(out)
"""

TRAIN = """
from hvd_train.model import classifier
classifier.Classifier.train_step = timed(classifier.Classifier.train_step)
from hvd_train.cli import main
code = main(sys.argv[2:])
dump(sys.argv[1])
sys.exit(code)
"""


def write_images(folder: Path, count: int, size: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        cls = folder / f"class{i % 4}"
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(cls / f"{i}.png")


def measure(name: str, cmd: list[str], stamps: Path, env: dict) -> dict:
    proc = subprocess.run(["taskset", "-c", "0", *cmd], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    times = json.loads(stamps.read_text())[WARMUP:]
    gaps = [nxt[0] - cur[1] for cur, nxt in zip(times, times[1:])]
    busy = [end - start for start, end in times[:-1]]
    span = times[-1][0] - times[0][0]
    return {
        "gap_ms": 1000 * statistics.median(gaps),
        "step_ms": 1000 * statistics.median(busy),
        "share": sum(gaps) / span,
        "steps_per_s": len(gaps) / span,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="MobileNetV2")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300, help="timed steps (after 20 more)")
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--before", default="", help="source folder of an earlier hvd_train to compare with")
    parser.add_argument("--before-steps-per-call", type=int, help="--steps-per-call of the earlier one")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvd-train-host-share-"))
    steps = args.steps + WARMUP
    write_images(work / "data", steps * args.batch_size, args.image_size)
    train = ["--data", str(work / "data"), "--val-split", "0", "--model", args.model, "--weights", "none"]
    train += ["--image-size", str(args.image_size), "--batch-size", str(args.batch_size), "--epochs", "1"]
    train += ["--threads-per-rank", "1", "--no-tensorboard", "--check-images", "none", "--no-resume"]
    variants = {"fit": [sys.executable, "-c", STAMPS + FIT]}
    fit_args = [str(args.image_size), str(args.batch_size), str(steps), args.model]
    envs = {name: ENV for name in ("fit",)}
    for k in args.steps_per_call:
        variants[f"train {k}"] = [sys.executable, "-c", STAMPS + TRAIN]
        envs[f"train {k}"] = dict(ENV, PYTHONPATH=str(REPO))
    if args.before:
        variants["before"] = [sys.executable, "-c", STAMPS + TRAIN]
        envs["before"] = dict(ENV, PYTHONPATH=str(Path(args.before).resolve()))
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, cmd in variants.items():
            stamps = work / f"{name.replace(' ', '-')}-{repeat}.json"
            if name == "fit":
                full = [*cmd, *fit_args, str(stamps)]
            else:
                out = work / f"out-{name.replace(' ', '-')}-{repeat}"
                extra = ["--steps-per-call", name.split()[1]] if name.startswith("train") else []
                if name == "before" and args.before_steps_per_call:
                    extra = ["--steps-per-call", str(args.before_steps_per_call)]
                full = [*cmd, str(stamps), "train", *train, "--output", str(out), *extra]
            results[name].append(measure(name, full, stamps, envs[name]))
            print(name, json.dumps(results[name][-1]), file=sys.stderr, flush=True)
    print(
        f"\n{args.model} {args.image_size} px, batch {args.batch_size}, one core; {args.steps} steps timed; "
        f"medians of {args.repeats} alternating runs\n"
    )
    print("| variant | gap between steps (ms) | step (ms) | host share | steps/s | runs (share) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        shares = ", ".join(f"{r['share']:.3f}" for r in runs)
        print(
            f"| {name} | {med['gap_ms']:.2f} | {med['step_ms']:.2f} | {med['share']:.3f} | "
            f"{med['steps_per_s']:.1f} | {shares} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
