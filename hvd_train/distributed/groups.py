"""Groups of ranks for the sharded head (``--head-parallel G``), as Horovod process sets.

A job of N ranks is cut into N / G groups of G consecutive ranks. Each
group holds one whole classification head, sharded by class: rank ``k G + j``
holds shard ``j``. Within a group the ranks exchange features and partial
sums (``sharded_head``); across groups, the ranks that hold the same shard
(its *peers*: ``j, G + j, 2 G + j, ...``) average that shard's gradients,
as data parallelism averages everything else over all N ranks.

Horovod needs every process set registered on every rank in the same
order; ``register`` does that after ``hvd.init`` in dynamic mode
(``start.init(process_sets=True)``), and an elastic job again after each
reset, from the new world (``nearest_parallel``: the G it can have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hvd_train.errors import UserError


@dataclass(frozen=True)
class Layout:
    """Which rank holds which part of the head.

    Attributes:
        size: ranks in the job.
        parallel: ranks per group (G): the shards of one head.
    """

    size: int
    parallel: int

    @property
    def groups(self) -> int:
        return self.size // self.parallel

    def group_of(self, rank: int) -> int:
        return rank // self.parallel

    def shard_of(self, rank: int) -> int:
        return rank % self.parallel

    def group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.parallel, (group + 1) * self.parallel))

    def peer_ranks(self, shard: int) -> list[int]:
        return list(range(shard, self.size, self.parallel))


def shard_range(classes: int, parallel: int, shard: int) -> tuple[int, int]:
    """``(first class, number of classes)`` of ``shard``: as even as ``classes`` allows, in class order."""
    first = shard * classes // parallel
    return first, (shard + 1) * classes // parallel - first


def check(parallel: int, size: int, classes: int | None = None) -> None:
    """Refuses a ``--head-parallel`` that cannot shard the head over this job.

    Raises:
        UserError: one line naming the value and the fix.
    """
    if parallel < 1:
        raise UserError(f"--head-parallel {parallel}: use a whole number >= 1 (the ranks that share one head).")
    if parallel > size:
        raise UserError(
            f"--head-parallel {parallel} is more than the {size} workers of this job: use at most {size}, "
            "or start more workers."
        )
    if size % parallel:
        fits = [g for g in range(1, size + 1) if size % g == 0]
        raise UserError(
            f"--head-parallel {parallel} does not divide the {size} workers of this job into groups: "
            f"use one of {', '.join(map(str, fits))}."
        )
    if classes is not None and classes < parallel:
        raise UserError(
            f"--head-parallel {parallel} is more than the {classes} classes of the data: each rank needs a class "
            f"of its own; use at most {classes}."
        )


def nearest_parallel(asked: int, size: int, classes: int) -> int:
    """The G nearest ``asked`` that divides ``size`` workers into groups and whose shards are no larger: the
    smallest such G from ``asked`` up, else the whole world (fewer workers than ``asked``); at most ``classes``,
    else the largest G that fits them. An elastic job's new world may not divide by the G it started with; its
    shards must still fit each worker's memory, as the G asked made them."""
    fits = [g for g in range(1, size + 1) if size % g == 0 and g <= classes]
    return next((g for g in fits if g >= min(asked, size)), fits[-1])


@dataclass
class HeadGroups:
    """This rank's process sets for the sharded head.

    Attributes:
        layout: the split of the job.
        rank: this process's global rank.
        group: the process set of this rank's group (Horovod's global set when there is one group; None for
            groups of one rank, which an elastic job may fall back to: its exchanges are then the tensor itself).
        peers: the process set of this shard's holders in every group (None with one group).
    """

    layout: Layout
    rank: int
    group: Any
    peers: Any

    @property
    def shard(self) -> int:
        return self.layout.shard_of(self.rank)

    @property
    def parallel(self) -> int:
        return self.layout.parallel

    # The sharded head's exchanges: its maths calls these, never Horovod, so a stand-in of one process
    # (the tests') can take their place.

    def gather(self, tensor, name: str):
        """``tensor`` of every rank of the group, in rank order, along the first axis."""
        if self.group is None:
            return _local(tensor)
        import horovod.tensorflow as hvd

        return hvd.allgather(tensor, process_set=self.group, name=name)

    def scatter_sum(self, tensor, name: str):
        """The group's sum of ``tensor``, cut along the first axis into equal parts: this rank's part."""
        if self.group is None:
            return _local(tensor)
        import horovod.tensorflow as hvd

        return hvd.reducescatter(tensor, op=hvd.Sum, process_set=self.group, name=name)

    def group_sum(self, tensor, name: str):
        """The group's sum of ``tensor``."""
        if self.group is None:
            return _local(tensor)
        import horovod.tensorflow as hvd

        return hvd.allreduce(tensor, op=hvd.Sum, process_set=self.group, name=name)

    def job_sum(self, tensor, name: str):
        """The sum of ``tensor`` over every rank of the job: the same bits on every rank, whatever the group."""
        import horovod.tensorflow as hvd

        return hvd.allreduce(tensor, op=hvd.Sum, name=name)

    def peers_average(self, tensors: list, name: str) -> list:
        """Each of ``tensors`` averaged over the ranks that hold this shard in every group (as they are with one)."""
        if self.peers is None:
            return list(tensors)
        import horovod.tensorflow as hvd

        return hvd.grouped_allreduce(list(tensors), op=hvd.Average, process_set=self.peers, name=name)

    def broadcast(self, array, name: str, root: int = 0):
        """Rank ``root``'s ``array`` on every rank of the job (every rank calls this)."""
        import horovod.tensorflow as hvd

        return hvd.broadcast(array, root_rank=root, name=name)

    def pass_back(self, rows, name: str):
        """``rows`` sent to the rank of the group before this one (the last rank's to the first): what the
        next one sent. Every rank of the group calls this; a group of one rank keeps its own."""
        if self.group is None:
            return _local(rows)
        import horovod.tensorflow as hvd

        splits = [0] * self.parallel
        splits[(self.shard - 1) % self.parallel] = int(rows.shape[0])
        received, _ = hvd.alltoall(rows, splits=splits, name=name, process_set=self.group)
        return received


def _local(tensor):
    """An exchange within a group of one rank: the tensor itself, as a tensor (as Horovod's ops give it)."""
    from hvd_train.compat import tf

    return tf.identity(tensor)


def register(layout: Layout, rank: int) -> HeadGroups:
    """Adds the groups' and the peers' process sets (every rank, same order) and gives this rank's.

    Needs Horovod started with dynamic process sets. A group of the whole job
    is Horovod's global set (a duplicate set would be refused), and a group
    of one rank none (an elastic job's fallback: its exchanges are local); a
    shard held by one group has no peers to average with, and a shard held by
    every rank has the global set for peers.
    """
    import horovod.tensorflow as hvd

    def process_set(ranks: list[int]):
        if len(ranks) == layout.size:
            return hvd.global_process_set
        if len(ranks) == 1:
            return None
        try:
            return hvd.add_process_set(ranks)
        except ValueError as e:  # a worker lost while the sets were made: as any collective that failed with it
            if "shutting down" not in str(e):
                raise
            from horovod.common.exceptions import HorovodInternalError

            raise HorovodInternalError(e) from None

    groups = [process_set(layout.group_ranks(g)) for g in range(layout.groups)]
    peers = [None if layout.groups == 1 else process_set(layout.peer_ranks(j)) for j in range(layout.parallel)]
    return HeadGroups(layout, rank, groups[layout.group_of(rank)], peers[layout.shard_of(rank)])
