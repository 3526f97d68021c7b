"""`hvd-train bench --mode synthetic` against Horovod's own Keras synthetic benchmark.

    python benchmarks/vs_horovod.py --horovod-example PATH [--model MobileNetV2] [--batch-size 32]

PATH is examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py from a
checkout of https://github.com/horovod/horovod (it is not in Horovod's
package). Both run the same model (keras.applications, 1000 classes, from
random weights), image size, batch and iterations, on one core per rank:
np=1 under `taskset -c 0`, np=2 under `mpirun --bind-to core`. Horovod's
script imports `keras`, which must be Keras 2 here: it is started with
`keras` resolving to tf_keras; for an --image-size other than its fixed
224 px, its model and random batch are made at that size, nothing else
changed. hvd-train picks its own thread count (one per bound core) unless
--threads-per-rank is given.

The two alternate (Horovod's first in even repeats, ours first in odd
ones), --repeats times at np=1 and np=2. Prints Markdown with every run, the
medians and the ratio of the medians; benchmarks/RESULTS.md keeps the
recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
ENV = dict(
    os.environ,
    TF_USE_LEGACY_KERAS="1",
    HVD_TRAIN_KERAS="2",  # hvd_train on tf-keras, as the Horovod example it is compared with
    TF_CPP_MIN_LOG_LEVEL="3",
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    TF_NUM_INTRAOP_THREADS="1",
    TF_NUM_INTEROP_THREADS="2",
)
# Runs Horovod's script with `keras` resolving to tf_keras and, for an image size other than
# its fixed 224 px, its model and random batch at that size (HVD_BENCH_SIZE).
SHIM = """
import functools, os, runpy, sys
import tf_keras
sys.modules['keras'] = tf_keras
size = int(os.environ.get('HVD_BENCH_SIZE', '224'))
if size != 224:
    import tensorflow as tf
    for applications in (tf_keras.applications, tf.keras.applications):
        for name in dir(applications):
            if name[:1].isupper():
                model = functools.partial(getattr(applications, name), input_shape=(size, size, 3))
                setattr(applications, name, model)
    uniform = tf.random.uniform
    def sized(shape, *a, **k):
        if list(shape)[1:] == [224, 224, 3]:
            shape = [shape[0], size, size, 3]
        return uniform(shape, *a, **k)
    tf.random.uniform = sized
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def launcher(np_: int) -> list[str]:
    if np_ == 1:
        return ["taskset", "-c", "0"]
    return ["mpirun", "-np", str(np_), "--bind-to", "core", "--map-by", "core"] + [
        x for name in ENV if name.startswith(("TF_", "OMPI_")) or name == "PATH" for x in ("-x", name)
    ]


def horovods(example: str, np_: int, args) -> float:
    cmd = [*launcher(np_), sys.executable, "-c", SHIM, example, "--no-cuda", "--model", args.model]
    cmd += ["--batch-size", str(args.batch_size), "--num-batches-per-iter", "10", "--num-iters", str(args.iters)]
    env = dict(ENV, HVD_BENCH_SIZE=str(args.image_size))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"Total img/sec on \d+ CPU\(s\): ([0-9.]+)", out).group(1))


def ours(np_: int, args, work: Path) -> float:
    out = work / f"ours-{np_}.json"
    cmd = [*launcher(np_), str(BIN / "hvd-train"), "bench", "--mode", "synthetic", "--model", args.model]
    cmd += ["--image-size", str(args.image_size), "--batch-size", str(args.batch_size), "--classes", "1000"]
    cmd += ["--precision", "fp32", "--warmup-batches", "10", "--batches-per-iter", "10"]
    if args.threads_per_rank:
        cmd += ["--threads-per-rank", str(args.threads_per_rank)]
    if args.steps_per_call:
        cmd += ["--steps-per-call", str(args.steps_per_call)]
    cmd += ["--iters", str(args.iters - 1), "--json", str(out)]
    subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True)
    return json.loads(out.read_text())["results"]["synthetic"]["total"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--horovod-example", required=True, help="tensorflow2_keras_synthetic_benchmark.py")
    parser.add_argument("--model", default="MobileNetV2")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument(
        "--threads-per-rank", type=int, default=0, help="hvd-train's threads (0: its choice from its CPUs)"
    )
    parser.add_argument("--iters", type=int, default=10, help="Horovod's --num-iters (the first is its warm-up)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2], help="numbers of ranks to run")
    parser.add_argument("--steps-per-call", type=int, default=0, help="hvd-train's (0: its default)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvd-train-vs-"))
    results = {}
    for repeat in range(args.repeats):
        for np_ in args.np:
            order = ("horovod", "hvd-train") if repeat % 2 == 0 else ("hvd-train", "horovod")
            for who in order:
                rate = horovods(args.horovod_example, np_, args) if who == "horovod" else ours(np_, args, work)
                results.setdefault((who, np_), []).append(rate)
                print(who, np_, f"{rate:.1f}", file=sys.stderr, flush=True)
    what = f"{args.model} {args.image_size} px, batch {args.batch_size}, fp32"
    print(f"\n{what}, one core per rank; {args.repeats} alternating runs, images/s\n")
    print("| np | Horovod's runs | hvd-train's runs | pairs (ours / Horovod's) | median ratio |")
    print("|---|---|---|---|---:|")
    for np_ in args.np:
        theirs, mine = results[("horovod", np_)], results[("hvd-train", np_)]
        pairs = ", ".join(f"{m / t:.2f}" for m, t in zip(mine, theirs))
        ratio = statistics.median(mine) / statistics.median(theirs)
        runs = [", ".join(f"{x:.1f}" for x in r) for r in (theirs, mine)]
        print(f"| {np_} | {runs[0]} | {runs[1]} | {pairs} | **{ratio:.2f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
