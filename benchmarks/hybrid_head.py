"""The classification head data-parallel against sharded by class (hybrid parallelism), at many classes.

For each class count, two jobs of ``--np`` ranks (one core each, ``mpirun
--bind-to core``) train a small backbone (``tanh(x A)``, F x F) and a
softmax head of F x C with SGD and momentum, ``--steps`` timed steps after
two warm-up ones:

- ``data``: every rank holds the whole head; its gradients are averaged
  over all ranks with the backbone's (one grouped allreduce);
- ``sharded``: the head is split over the ranks (``model/sharded_head.py``,
  ``--head-parallel`` = np): features and labels are allgathered, the
  loss's partial sums too, and the features' gradients reduce-scattered.

Each rank counts the bytes it hands to each collective, and the table
gives what a ring moves per rank for them: an allreduce of S bytes
2(n-1)/n S, an allgather or a reduce-scatter of S bytes in all (n-1)/n S.
Peak memory is the rank's largest resident set (``ru_maxrss``).

    python benchmarks/hybrid_head.py [--np 2] [--classes 1000 10000 100000 1000000] [--features 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BATCH, LR, MOMENTUM = 32, 0.01, 0.9


def worker(layout: str, classes: int, features: int, steps: int, out: str) -> None:
    """One rank of one job (run under mpirun)."""
    import resource

    import numpy as np

    from hvd_train.distributed import start
    from hvd_train.distributed.groups import Layout, register, shard_range

    ctx = start.init(threads_per_rank=1, process_sets=layout == "sharded")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvd_train.model.sharded_head import head_step

    n = ctx.size
    ring = (n - 1) / n
    sent = {"allreduce": 0.0, "allgather": 0.0, "reducescatter": 0.0}
    rng = np.random.default_rng(ctx.rank)
    a = tf.Variable((rng.normal(size=(features, features)) / np.sqrt(features)).astype("float32"))
    if layout == "sharded":
        groups = register(Layout(n, n), ctx.rank)
        first, count = shard_range(classes, n, groups.shard)
    else:
        groups, first, count = None, 0, classes
    kernel = tf.Variable(tf.zeros([features, count]))
    bias = tf.Variable(tf.zeros([count]))
    slots = [tf.Variable(tf.zeros_like(v)) for v in (a, kernel, bias)]

    def update(grads):
        for v, s, g in zip((a, kernel, bias), slots, grads):
            s.assign(MOMENTUM * s + g)
            v.assign_sub(LR * s)

    @tf.function(autograph=False)
    def data_step(x, y):
        with tf.GradientTape() as tape:
            logits = tf.matmul(tf.tanh(tf.matmul(x, a)), kernel) + bias
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        grads = hvd.grouped_allreduce(tape.gradient(loss, [a, kernel, bias]), op=hvd.Average)
        update(grads)
        return loss

    @tf.function(autograph=False)
    def sharded_step(x, y):
        with tf.GradientTape() as tape:
            feats = tf.tanh(tf.matmul(x, a))
        step = head_step(feats, y, tf.ones([BATCH]), kernel, bias, first=first, classes=classes, groups=groups)
        (d_a,) = hvd.grouped_allreduce([tape.gradient(feats, a, output_gradients=step.d_features)], op=hvd.Average)
        update([d_a, step.d_kernel, step.d_bias])
        return step.loss

    step = sharded_step if layout == "sharded" else data_step
    if layout == "sharded":  # what each rank hands to the group's collectives in one step
        rows = n * BATCH
        gathered = (BATCH * features + 2 * BATCH) * 4  # features, labels, weights: gathered from every rank
        stats = rows * 5 * 8  # the loss's partial sums: five float64 a row of the group
        sent["allgather"] = gathered + stats
        sent["reducescatter"] = rows * features * 4
        sent["allreduce"] = features * features * 4
        wire = ring * n * (gathered + stats) + ring * sent["reducescatter"] + 2 * ring * sent["allreduce"]
    else:
        sent["allreduce"] = (features * features + features * classes + classes) * 4
        wire = 2 * ring * sent["allreduce"]
    times = []
    for i in range(steps + 2):
        x = tf.constant(rng.normal(size=(BATCH, features)).astype("float32"))
        y = tf.constant(rng.integers(0, classes, size=BATCH).astype("int32"))
        started = time.perf_counter()
        float(step(x, y))
        if i >= 2:
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {"step": float(np.median(times)), "wire": wire, "handed": sent, "peak": peak, "head": count * features}
    with open(os.path.join(out, f"{layout}-{classes}-rank{ctx.rank}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--classes", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", nargs=4, metavar=("LAYOUT", "CLASSES", "FEATURES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        layout, classes, features, out = args.worker
        worker(layout, int(classes), int(features), args.steps, out)
        return
    out = tempfile.mkdtemp(prefix="hybrid-head-")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="3")
    rows = []
    for classes in args.classes:
        for layout in ("data", "sharded"):
            command = ["mpirun", "-np", str(args.np), "--bind-to", "core", "--map-by", "core", "-x", "PATH"]
            command += ["-x", "TF_CPP_MIN_LOG_LEVEL", sys.executable, os.path.abspath(__file__)]
            command += ["--steps", str(args.steps), "--worker", layout, str(classes), str(args.features), out]
            started = time.time()
            subprocess.run(command, check=True, env=env, capture_output=True, text=True)
            ranks = []
            for r in range(args.np):
                with open(os.path.join(out, f"{layout}-{classes}-rank{r}.json")) as f:
                    ranks.append(json.load(f))
            rows.append((classes, layout, ranks, time.time() - started))
            print(f"{classes} {layout}: {max(r['step'] for r in ranks):.3f} s/step", file=sys.stderr, flush=True)
    print(f"np={args.np}, one core per rank, F={args.features}, batch {BATCH} per rank, SGD with momentum\n")
    print("| classes | layout | head parameters per rank | MB sent per rank and step | step (s) | peak MB per rank |")
    print("|---:|---|---:|---:|---:|---:|")
    for classes, layout, ranks, _ in rows:
        wire = max(r["wire"] for r in ranks) / 1e6
        step = max(r["step"] for r in ranks)
        peak = max(r["peak"] for r in ranks) / 2**20
        print(f"| {classes:,} | {layout} | {ranks[0]['head']:,} | {wire:.2f} | {step:.3f} | {peak:,.0f} |")


if __name__ == "__main__":
    main()
