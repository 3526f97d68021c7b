"""The classification head's cost per step: data-parallel against sharded by class (``--head-parallel``).

Both layouts do the same arithmetic (the sharded head computes ``G B`` rows
for ``C / G`` classes instead of ``B`` rows for ``C``); they differ in what
crosses the wire and what each rank holds. Per rank and step, for ``n``
workers, groups of ``G``, batch ``B``, ``F`` features and ``C`` classes,
4-byte values:

- data-parallel: the head's gradients join the backbone's in the ring
  allreduce, ``2 (n-1)/n x 4 (F C + C)`` bytes more;
- sharded: the group's features, labels and weights are allgathered
  (``(G-1) B (F+2) 4``), then five float64 partial sums a row
  (``(G-1) G B 5 x 8``), and the features' gradients are reduce-scattered
  (``(G-1) B F 4``): three rounds one after the other, each paying a
  Horovod cycle and ``G-1`` hops. With several groups, each shard's
  gradients are allreduced over its ``n/G`` peers.

A group on one host talks over the link within it; the data-parallel
allreduce crosses hosts as soon as there are several. The sharded head
moves fewer bytes once ``C`` is above about ``G B`` classes, and wins in
time once those bytes outweigh its extra rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvd_train.perf.planner import Link, ring_allreduce_seconds

SHARDED_ROUNDS = 3  # features gathered, partial sums gathered, features' gradients scattered


@dataclass(frozen=True)
class HeadCost:
    """One layout's head, per rank and step.

    Attributes:
        wire_bytes: bytes the rank sends (what a ring moves per rank).
        seconds: the head's communication time.
        memory_bytes: the head's weights, gradients and optimizer slots, and its logits.
    """

    wire_bytes: float
    seconds: float
    memory_bytes: float


@dataclass(frozen=True)
class Head:
    """The head and the job: ``classes`` x ``features``, ``batch`` per worker, ``slots`` per weight
    (1 for SGD with momentum, 2 for Adam)."""

    classes: int
    features: int
    batch: int
    slots: int = 1


def data_parallel(head: Head, workers: int, link: Link, fusion: float, cycle: float) -> HeadCost:
    """The head's share of the gradients' allreduce: its bytes, and the latency of the fused buffers it
    fills alone (a head smaller than a buffer rides in the backbone's, whose latency is paid anyway)."""
    size = 4.0 * (head.features * head.classes + head.classes)
    n = workers
    wire = 2 * (n - 1) / n * size if n > 1 else 0.0
    seconds = wire / link.bandwidth + (size // fusion) * (2 * (n - 1) * link.latency + cycle) if n > 1 else 0.0
    logits = 4.0 * head.batch * head.classes * 2  # logits and their gradient
    return HeadCost(wire, seconds, size * (2 + head.slots) + logits)


def sharded(head: Head, workers: int, parallel: int, group_link: Link, peer_link: Link, fusion: float, cycle: float):
    """The head sharded over groups of ``parallel`` ranks (``group_link`` within a group, ``peer_link`` across)."""
    g, b, f = parallel, head.batch, head.features
    gathered = (g - 1) * (b * (f + 2) * 4 + g * b * 5 * 8)
    scattered = (g - 1) * b * f * 4
    hops = SHARDED_ROUNDS * (cycle + (g - 1) * group_link.latency)
    shard = 4.0 * (f + 1) * math.ceil(head.classes / g)
    peers = workers // g
    peer_wire = 2 * (peers - 1) / peers * shard if peers > 1 else 0.0
    seconds = (gathered + scattered) / group_link.bandwidth + hops
    seconds += ring_allreduce_seconds(shard, peers, peer_link, fusion, cycle)
    logits = 4.0 * g * b * math.ceil(head.classes / g) * 2
    return HeadCost(gathered + scattered + peer_wire, seconds, shard * (2 + head.slots) + logits)


def links(workers: int, parallel: int, workers_per_host: int, intra: Link, inter: Link) -> tuple[Link, Link, Link]:
    """The links of the data-parallel allreduce, of a group and of a shard's peers."""
    across = inter if workers > workers_per_host else intra
    return across, intra if parallel <= workers_per_host else inter, across


def crossover(
    head: Head, workers: int, parallel: int, workers_per_host: int, intra: Link, inter: Link, fusion, cycle
) -> int | None:
    """The fewest classes (to 1 %) from which the sharded head's communication is the shorter; None below 100 M."""
    data_link, group_link, peer_link = links(workers, parallel, workers_per_host, intra, inter)

    def wins(classes: int) -> bool:
        h = Head(classes, head.features, head.batch, head.slots)
        split = sharded(h, workers, parallel, group_link, peer_link, fusion, cycle)
        return split.seconds < data_parallel(h, workers, data_link, fusion, cycle).seconds

    low, high = max(parallel, 1), 100_000_000
    if not wins(high):
        return None
    if wins(low):
        return low
    while high > low * 1.01 + 1:
        middle = int(math.sqrt(low * high))
        low, high = (low, middle) if wins(middle) else (middle, high)
    return high
