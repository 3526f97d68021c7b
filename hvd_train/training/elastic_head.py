"""The sharded head (``--head-parallel``) in an elastic job: what a commit keeps of it, and its re-split after a reset.

A worker lost takes its shard of the head with it, and the new world may
split the head otherwise (``groups.nearest_parallel``). So a commit keeps,
on each rank, its own shard and a copy of the next rank's in its group (one
exchange a commit, ``HeadGroups.pass_back``): each shard is then held twice
in every group, and once more in each other group by its peers. No rank
holds more than two shards: the head may be far larger than one rank's
memory (the reason to shard it).

After a reset every rank says what it holds (``Held``); ``plan`` picks, for
the latest commit that some rank holds whole, a holder of each of its
shards; ``respread`` has each holder broadcast its shard a chunk at a time,
and each rank of the new layout keeps the columns of its own classes.
Only when every holder of a shard is lost at once (the two neighbours of a
group of every group) is the commit gone: the job then ends with that
said, and starts again from its last checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvd_train.distributed.groups import HeadGroups, Layout, shard_range
from hvd_train.errors import UserError
from hvd_train.model import kerases
from hvd_train.model.sharded_files import columns_per_chunk


@dataclass
class HeadCommit:
    """A rank's part of the head at a commit: its arrays (``ShardedNet.head_arrays``' order) and its next's.

    Attributes:
        layout: the split the commit was made in.
        shard: this rank's shard in it.
        names: the arrays' names (``sharded_files``' names), in their order.
        own: this rank's arrays of its shard.
        next: the next rank's arrays of its group (shard ``shard + 1`` mod G); None in groups of one rank.
    """

    layout: Layout
    shard: int
    names: list[str]
    own: list[np.ndarray]
    next: list[np.ndarray] | None

    def held(self) -> dict[int, list[np.ndarray]]:
        """The shards this rank holds, by number."""
        held = {self.shard: self.own}
        if self.next is not None:
            held.setdefault((self.shard + 1) % self.layout.parallel, self.next)
        return held


@dataclass(frozen=True)
class Held:
    """What a rank says it holds after a reset: the images seen at its commit, its layout and its shards."""

    progress: int
    size: int
    parallel: int
    shards: tuple[int, ...]


def commit(net) -> HeadCommit:
    """This rank's shard of ``net``'s head and a copy of the next rank's (every rank of the group calls this)."""
    arrays = net.head_arrays()
    own = [variable.numpy() for variable in arrays.values()]
    groups: HeadGroups = net.head
    following = None
    if groups.parallel > 1:
        nxt = (groups.shard + 1) % groups.parallel
        count = shard_range(net.classes, groups.parallel, nxt)[1]
        counts = [shard_range(net.classes, groups.parallel, j)[1] for j in range(groups.parallel)]
        following = [_pass_back(array, count, max(counts), groups, f"head_commit.{i}") for i, array in enumerate(own)]
    return HeadCommit(groups.layout, groups.shard, list(arrays), own, following)


def _pass_back(shard: np.ndarray, count: int, most: int, groups: HeadGroups, name: str) -> np.ndarray:
    """The next rank's array (``count`` columns) for this rank's ``shard``, in rounds of ``CHUNK_BYTES``."""
    rows_shape, chunk = shard.shape[:-1], columns_per_chunk(shard)
    rows = int(np.prod(rows_shape)) if rows_shape else 1
    columns = np.ascontiguousarray(np.reshape(shard, (rows, -1)).T)  # a row per class
    parts = [
        groups.pass_back(columns[start : start + chunk], f"{name}.{k}").numpy()
        for k, start in enumerate(range(0, most, chunk))
    ]
    received = np.concatenate(parts) if parts else np.zeros((0, rows), shard.dtype)
    assert received.shape[0] == count, (received.shape, count)
    return np.reshape(received.T, (*rows_shape, count))


def held(saved: HeadCommit | None, progress: int) -> Held | None:
    """What this rank says it holds: the shards of its last commit (``saved``), at ``progress`` images."""
    if saved is None:
        return None
    return Held(progress, saved.layout.size, saved.layout.parallel, tuple(sorted(saved.held())))


def plan(holders: list[Held | None]) -> tuple[int, dict[int, int]]:
    """The rank whose commit the job goes on from, and for each shard of that commit the rank that sends it.

    The latest commit of which the ranks hold every shard; among its
    holders of a shard, the first rank. ``holders``: each rank's ``Held``
    in rank order (None: a new worker).

    Raises:
        UserError: no commit is held whole: every holder of a shard was lost.
    """
    known = [(rank, h) for rank, h in enumerate(holders) if h is not None]
    if not known:
        raise ValueError("no rank holds a commit of the head")
    missing: list[int] = []
    for progress in sorted({h.progress for _, h in known}, reverse=True):
        at = [(rank, h) for rank, h in known if h.progress == progress]
        parallel = at[0][1].parallel
        sources = {}
        for shard in range(parallel):
            holding = [rank for rank, h in at if shard in h.shards]
            if holding:
                sources[shard] = holding[0]
        if len(sources) == parallel:
            return at[0][0], sources
        missing = missing or sorted(set(range(parallel)) - set(sources))
    raise UserError(
        f"elastic: every worker that held shard(s) {', '.join(map(str, missing))} of the head (--head-parallel) was "
        "lost at once, so the last commit cannot be rebuilt; run the job again: it resumes from its last checkpoint."
    )


def respread(net, saved: HeadCommit | None, holders: list[Held | None], sources: dict[int, int]) -> None:
    """Each rank of ``net`` (the new layout) takes its classes of the committed head from the shards' senders.

    Every rank of the job calls this. ``saved``: this rank's commit (None on a
    new worker); ``sources``: ``plan``'s senders; ``holders``: ``plan``'s input.
    Each shard goes by from its sender in chunks of ``CHUNK_BYTES``.
    """
    groups: HeadGroups = net.head
    old = next(holders[rank] for rank in sources.values())
    last = net.first + net.count
    mine = saved.held() if saved is not None else {}
    arrays = net.head_arrays()
    if groups.rank in sources.values() and list(arrays) != saved.names:  # the same arrays, in the same order
        raise AssertionError(f"the head's arrays were {saved.names} at the commit and are {list(arrays)} now")
    for i, variable in enumerate(arrays.values()):
        target = np.empty(tuple(variable.shape), kerases.numpy_dtype(variable))
        rows_shape, chunk = target.shape[:-1], columns_per_chunk(target)
        for shard, source in sorted(sources.items()):
            first, count = shard_range(net.classes, old.parallel, shard)
            whole = mine[shard][i] if groups.rank == source else None
            for k, start in enumerate(range(0, count, chunk)):
                end = min(count, start + chunk)
                part = (
                    np.ascontiguousarray(whole[..., start:end])
                    if whole is not None
                    else np.zeros((*rows_shape, end - start), target.dtype)
                )
                part = groups.broadcast(part, f"head_respread.{i}.{shard}.{k}", root=source).numpy()
                low, high = max(first + start, net.first), min(first + end, last)  # classes of both
                if low < high:
                    at = first + start  # the class of the part's first column
                    target[..., low - net.first : high - net.first] = part[..., low - at : high - at]
        variable.assign(target)


def restore(net, saved: HeadCommit) -> None:
    """``net``'s own shard back to ``saved`` (the layout is the commit's until the reset)."""
    for variable, value in zip(net.head_arrays().values(), saved.own, strict=True):
        variable.assign(value)
