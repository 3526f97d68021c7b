"""Launched under horovodrun by the tests: an elastic job's commit of the sharded head and its re-split.

Usage: python elastic_head_check.py OUT_DIR
Four ranks hold a head of 11 classes in groups of 2 (``Layout(4, 2)``:
shards of 5 and 6 columns), then in one group of 4, and commit it
(``elastic_head.commit``: each rank keeps its shard and the next one's;
``agree``). Then, as after a reset, some ranks play workers that were
lost and came back empty (new workers, who hold nothing); the others say
what they hold, ``plan`` picks the senders and ``respread`` gives each
rank its columns in a new layout of 1, 2 or 4 ranks a group. Last, a
commit that a lost worker cut short: two ranks made it, one only got its
part; and one rank that holds two commits of the same images and layout.
A kernel, a bias and one optimizer slot, each with values of its
own, so that an array taken for another shows. Rounds of 5 kernel
columns: the shard of 5 sends nothing in the second round of 2. Each rank
writes the largest differences from the head it should hold to
OUT_DIR/rank{R}.json.
"""

import json
import os
import sys

import numpy as np

from hvd_train.distributed import start
from hvd_train.distributed.groups import Layout, register, shard_range
from hvd_train.errors import UserError

out_dir = sys.argv[1]
ctx = start.init(threads_per_rank=1, process_sets=True)

import tensorflow as tf  # noqa: E402

from hvd_train.model import sharded_files  # noqa: E402
from hvd_train.training import elastic_head  # noqa: E402

CLASSES, FEATURES = 11, 6
sharded_files.CHUNK_BYTES = 5 * FEATURES * 4  # five kernel columns a round
rng = np.random.default_rng(0)
WHOLE = {
    "kernel": rng.normal(size=(FEATURES, CLASSES)).astype("float32"),
    "bias": rng.normal(size=(CLASSES,)).astype("float32"),
    "slot-m-predictions-kernel": rng.normal(size=(FEATURES, CLASSES)).astype("float32"),
}
# Every rank registers every layout's process sets, in the same order (as after a reset, in the new world).
registered = {g: register(Layout(ctx.size, g), ctx.rank) for g in (2, 1, 4)}


class Head:
    """What ``elastic_head`` uses of a ``ShardedNet``: its groups, classes, columns and head arrays."""

    def __init__(self, groups, filled: bool):
        """``filled``: with its columns of the head (a commit's layout); else zeros (a new layout, to fill)."""
        self.head, self.classes = groups, CLASSES
        self.first, self.count = shard_range(CLASSES, groups.parallel, groups.shard)
        self.arrays = {
            name: tf.Variable(
                whole[..., self.first : self.first + self.count]
                if filled
                else np.zeros((*whole.shape[:-1], self.count), whole.dtype)
            )
            for name, whole in WHOLE.items()
        }

    def head_arrays(self):
        return self.arrays


def largest_difference(head) -> float:
    return max(
        float(np.max(np.abs(variable.numpy() - WHOLE[name][..., head.first : head.first + head.count])))
        for name, variable in head.head_arrays().items()
    )


def resplit(key, lost, offered, commits):
    """As after a reset: the ranks in ``lost`` came back empty, the others offer ``offered``; the head re-split into
    groups of 1, 2 and 4 from ``commits`` (this rank's), each checked; or the plan's refusal."""
    mine = () if ctx.rank in lost else offered
    holders = ctx.allgather_object(mine, name=f"held.{key}")
    try:
        chosen = elastic_head.plan(holders)
    except UserError as e:
        results[key] = {"refused": str(e)}
        return
    for g in (1, 2, 4):
        new = Head(registered[g], filled=False)
        elastic_head.respread(new, [] if ctx.rank in lost else commits, chosen)
        results[f"{key},G'={g}"] = {
            "difference": largest_difference(new),
            "root": chosen.root,
            "key": chosen.key,
            "sources": chosen.sources,
        }


results = {}
commits = {}
# Lost and back empty, with groups of 2 (each rank holds both shards of its group): one worker; both of a
# group; both holders of shard 0's own copy; three of four (one survivor holds the head). With one group of 4
# (a rank holds its shard and the next): shard 0 from the copy of rank 3 alone; two apart; two neighbours,
# whose shard 1 no one holds.
CASES = {2: ([0], [0, 1], [0, 2], [1, 2, 3]), 4: ([0], [1, 3], [0, 1])}
for progress, (old_g, losses) in enumerate(CASES.items(), start=1):
    head = Head(registered[old_g], filled=True)
    saved = commits[old_g] = elastic_head.commit(head, 100 * progress)
    elastic_head.agree(head)
    nxt = (saved.shard + 1) % old_g
    first, count = shard_range(CLASSES, old_g, nxt)
    results[f"G={old_g}"] = {
        "next": max(
            float(np.max(np.abs(array - WHOLE[name][..., first : first + count])))
            for name, array in zip(WHOLE, saved.next, strict=True)
        ),
        "held": sorted(saved.held()),
    }
    for lost in losses:
        resplit(f"G={old_g},lost={lost}", lost, elastic_head.offers(saved, None), [saved])
# Rank 3 lost during the commit in groups of 4 (at 200): ranks 0 and 1 made it, rank 2 only got its part and
# offers it beside its last commit (groups of 2, at 100).
made = ctx.rank in (0, 1)
offered = elastic_head.offers(commits[4], None) if made else elastic_head.offers(commits[2], commits[4])
resplit("partial", [3], offered, [commits[4]] if made else [commits[2], commits[4]])
# Rank 0 holds its commit in the group of 4 (shards 0 and 1) and, as the one it was making under another rank
# number (a worker replaced), shards 2 and 3 of the same images and layout; the others came back empty.
other = elastic_head.HeadCommit(
    200,
    Layout(4, 4),
    2,
    list(WHOLE),
    [whole[..., 5:8] for whole in WHOLE.values()],  # shards of 11 over 4: 0-1, 2-4, 5-7, 8-10
    [whole[..., 8:] for whole in WHOLE.values()],
)
offered = elastic_head.offers(commits[4], other) if ctx.rank == 0 else ()
resplit("two of one rank", [1, 2, 3], offered, [commits[4], other] if ctx.rank == 0 else [])
with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
    json.dump(results, f)
