"""What a sharded head costs an elastic job: each commit's exchange, and the re-split after a reset.

For each class count, one job of ``--np`` ranks (``horovodrun --gloo``, as
elastic jobs run) holds a head of F x C sharded over all of them
(``--head-parallel`` = np), with one momentum slot for the kernel and one
for the bias, as SGD with momentum has. It times:

- ``commit``: ``elastic_head.commit`` (each rank keeps its shard and the
  next rank's) and ``agree``, the median of ``--repeats``;
- ``re-split``: as after rank 0 was lost and came back empty, ``plan`` and
  ``respread`` of that commit over the same ranks, the slowest rank's.

Bytes are what a rank sends in the commit's exchange (its shard of every
array). Peak memory is the rank's largest resident set (``ru_maxrss``).

    python benchmarks/elastic_head.py [--np 2] [--classes 20000 100000] [--features 1280]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def worker(classes: int, features: int, repeats: int, out: str) -> None:
    """One rank (run under horovodrun)."""
    import resource
    import statistics

    import numpy as np

    from hvd_train.distributed import start
    from hvd_train.distributed.groups import Layout, register, shard_range

    ctx = start.init(threads_per_rank=1, process_sets=True)
    import tensorflow as tf

    from hvd_train.training import elastic_head

    class Head:
        """What ``elastic_head`` uses of a ``ShardedNet``."""

        def __init__(self, groups, seed):
            self.head, self.classes = groups, classes
            self.first, self.count = shard_range(classes, groups.parallel, groups.shard)
            rng = np.random.default_rng(seed)
            self.arrays = {
                name: tf.Variable(rng.standard_normal(shape, dtype=np.float32))
                for name, shape in (
                    ("kernel", (features, self.count)),
                    ("bias", (self.count,)),
                    ("slot-momentum-predictions-kernel", (features, self.count)),
                    ("slot-momentum-predictions-bias", (self.count,)),
                )
            }

        def head_arrays(self):
            return self.arrays

    groups = register(Layout(ctx.size, ctx.size), ctx.rank)
    head = Head(groups, ctx.rank)
    seconds = []
    for k in range(repeats + 1):
        began = time.perf_counter()
        saved = elastic_head.commit(head, 100 * k)
        elastic_head.agree(head)
        seconds.append(time.perf_counter() - began)
    commit = statistics.median(seconds[1:])  # the first of them warms the collectives up
    mine = () if ctx.rank == 0 else elastic_head.offers(saved, None)
    holders = ctx.allgather_object(mine, name="held")
    began = time.perf_counter()
    elastic_head.respread(Head(groups, 1000 + ctx.rank), [] if ctx.rank == 0 else [saved], elastic_head.plan(holders))
    resplit = max(ctx.allgather_object(time.perf_counter() - began, name="resplit"))
    sent = sum(int(v.numpy().nbytes) for v in head.head_arrays().values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"commit": commit, "resplit": resplit, "sent_mb": sent / 1e6, "peak_mb": peak}
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--classes", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--features", type=int, default=1280)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.features, args.repeats, args.worker[1])
        return
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    print(f"{args.np} ranks (horovodrun --gloo), a head of {args.features} x C, kernel, bias and their momentum\n")
    print("| classes | head MB | MB sent per rank and commit | commit (s) | re-split (s) | peak MB per rank |")
    print("|---:|---:|---:|---:|---:|---:|")
    for classes in args.classes:
        with tempfile.TemporaryDirectory() as out:
            command = [horovodrun, "--gloo", "-np", str(args.np), sys.executable, __file__]
            command += ["--features", str(args.features), "--repeats", str(args.repeats)]
            subprocess.run([*command, "--worker", str(classes), out], check=True, capture_output=True)
            ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.np)]
        whole = 2 * (args.features + 1) * classes * 4 / 1e6
        print(
            f"| {classes:,} | {whole:,.0f} | {max(r['sent_mb'] for r in ranks):,.0f} "
            f"| {max(r['commit'] for r in ranks):.2f} | {ranks[0]['resplit']:.2f} "
            f"| {max(r['peak_mb'] for r in ranks):,.0f} |"
        )


if __name__ == "__main__":
    main()
