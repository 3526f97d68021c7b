"""The sharded head (``--head-parallel``) in an elastic job: what a commit keeps of it, and its re-split after a reset.

A worker lost takes its shard of the head with it, and the new world may
split the head otherwise (``groups.nearest_parallel``). So a commit keeps,
on each rank, its own shard and a copy of the next rank's in its group (one
exchange a commit, ``HeadGroups.pass_back``): each shard is then held twice
in every group, and once more in each other group by its peers. A rank
holds two shards of a commit, four while it makes the next, never the whole
head: the head may be far larger than one rank's memory (the reason to
shard it). A worker lost during the exchange leaves some ranks with their
part of the new commit and some without; one allreduce after it
(``agree``) makes the commit, and a rank that fails there still offers
the new commit's head beside its last commit.

After a reset every rank says what it holds (``offers``); ``plan`` picks
the latest commit that some rank holds whole and of which every shard is
held, and a holder of each shard; ``respread`` has each holder broadcast
its shard a chunk at a time, and each rank of the new layout keeps the
columns of its own classes. Only when every holder of a shard is lost at
once (in every group, two neighbours) is the commit gone: the job then
ends saying so, and starts again from its last checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvd_train.distributed.groups import HeadGroups, Layout, shard_range
from hvd_train.errors import UserError
from hvd_train.model import kerases
from hvd_train.model.sharded_files import as_rows, broadcast_into, columns_per_chunk


@dataclass
class HeadCommit:
    """A rank's part of the head at a commit: its arrays (``ShardedNet.head_arrays``' order) and its next's.

    Attributes:
        progress: the images seen at the commit.
        layout: the split the commit was made in.
        shard: this rank's shard in it.
        names: the arrays' names (``sharded_files``' names), in their order.
        own: this rank's arrays of its shard.
        next: the next rank's arrays of its group (shard ``shard + 1`` mod G); None in groups of one rank.
    """

    progress: int
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

    @property
    def key(self) -> tuple[int, int, int]:
        return self.progress, self.layout.size, self.layout.parallel

    def offer(self, whole: bool) -> Held:
        """What this rank says it holds of this commit; ``whole``: the rest of the commit (weights, state) too."""
        return Held(*self.key, tuple(sorted(self.held())), whole)


@dataclass(frozen=True)
class Held:
    """A commit of the head as a rank says it holds it after a reset.

    Attributes:
        progress, size, parallel: the images seen at the commit, and its layout (``key``).
        shards: the shards of it the rank holds.
        whole: the rank holds the rest of that commit (the backbone, the optimizer, the state), not the head's
            arrays alone (an exchange of the head that ended before the job agreed it was made: ``agree``).
    """

    progress: int
    size: int
    parallel: int
    shards: tuple[int, ...]
    whole: bool = True

    @property
    def key(self) -> tuple[int, int, int]:
        return self.progress, self.size, self.parallel


@dataclass(frozen=True)
class Plan:
    """The commit a job goes on from (``key``), the rank that sends the rest of it, and each shard's sender."""

    root: int
    key: tuple[int, int, int]
    sources: dict[int, int]

    @property
    def parallel(self) -> int:
        return self.key[2]


def commit(net, progress: int) -> HeadCommit:
    """This rank's shard of ``net``'s head and a copy of the next rank's (every rank of the group calls this).

    Each rank holds the copy once the exchange is done here, which is not yet
    a commit: a worker lost meanwhile leaves some ranks with it and some
    without. ``agree`` says when every rank has it.
    """
    arrays = net.head_arrays()
    own = [variable.numpy() for variable in arrays.values()]
    groups: HeadGroups = net.head
    following = None
    if groups.parallel > 1:
        nxt = (groups.shard + 1) % groups.parallel
        count = shard_range(net.classes, groups.parallel, nxt)[1]
        counts = [shard_range(net.classes, groups.parallel, j)[1] for j in range(groups.parallel)]
        following = [_pass_back(array, count, max(counts), groups, f"head_commit.{i}") for i, array in enumerate(own)]
    return HeadCommit(progress, groups.layout, groups.shard, list(arrays), own, following)


def agree(net) -> None:
    """Returns once every rank of the job has made its part of the commit (``commit``); a lost worker fails it.

    A rank that returns knows every other had its copy: a rank that fails
    here still holds its part and offers it after the reset (``Held.whole``
    false), so the commit some ranks made is never lost to the others."""
    net.head.job_sum(np.ones(1, np.float32), "head_commit.agreed")


def _pass_back(shard: np.ndarray, count: int, most: int, groups: HeadGroups, name: str) -> np.ndarray:
    """The next rank's array (``count`` columns) for this rank's ``shard``, in rounds of ``CHUNK_BYTES``."""
    chunk = columns_per_chunk(shard)
    rows_shape, columns = as_rows(shard)
    parts = [
        groups.pass_back(columns[start : start + chunk], f"{name}.{k}").numpy()
        for k, start in enumerate(range(0, most, chunk))
    ]
    received = np.concatenate(parts) if parts else np.zeros((0, columns.shape[1]), shard.dtype)
    assert received.shape[0] == count, (received.shape, count)
    return np.reshape(received.T, (*rows_shape, count))


def offers(saved: HeadCommit | None, pending: HeadCommit | None) -> tuple[Held, ...]:
    """What this rank says it holds after a reset: its last commit (``saved``), and the head of the commit it
    was making when the job failed (``pending``), if any."""
    return tuple(c.offer(whole=c is saved) for c in (saved, pending) if c is not None)


def plan(holders: list[tuple[Held, ...]]) -> Plan:
    """The commit the job goes on from, the rank that sends the rest of it, and each of its shards' senders.

    The latest commit of which the ranks hold every shard and some rank the
    rest (at the same images, in this layout or another: a reset's own
    commit that failed on some ranks); among its holders of a shard, the
    first rank.
    ``holders``: each rank's ``offers``, in rank order (empty: a new worker).

    Raises:
        UserError: no commit is held whole: every holder of a shard was lost.
    """
    known = [(rank, h) for rank, held in enumerate(holders) for h in held]
    if not known:
        raise ValueError("no rank holds a commit of the head")
    missing: list[int] = []
    for key in sorted({h.key for _, h in known}, reverse=True):
        at = [(rank, h) for rank, h in known if h.key == key]
        # The rest of a commit (backbone, state) is the same at the same images in any layout.
        roots = sorted({rank for rank, h in known if h.whole and h.progress == key[0]})
        if not roots:
            continue
        sources = {}
        for shard in range(key[2]):
            holding = [rank for rank, h in at if shard in h.shards]
            if holding:
                sources[shard] = holding[0]
        if len(sources) == key[2]:
            return Plan(roots[0], key, sources)
        missing = missing or sorted(set(range(key[2])) - set(sources))
    raise UserError(
        f"elastic: every worker that held shard(s) {', '.join(map(str, missing))} of the head (--head-parallel) was "
        "lost at once, so the last commit cannot be rebuilt; run the job again: it resumes from its last checkpoint."
    )


def respread(net, commits: list[HeadCommit | None], chosen: Plan) -> None:
    """Each rank of ``net`` (the new layout) takes its classes of the ``chosen`` commit's head from its senders.

    Every rank of the job calls this. ``commits``: this rank's commits (its
    last and the one it was making; None for what it lacks, as on a new
    worker). Each shard goes by from its sender in chunks of ``CHUNK_BYTES``.
    """
    groups: HeadGroups = net.head
    mine = [c for c in commits if c is not None and c.key == chosen.key]  # its last and the one it was making
    held = {shard: values for c in reversed(mine) for shard, values in c.held().items()}
    arrays = net.head_arrays()
    if groups.rank in chosen.sources.values() and list(arrays) != mine[0].names:  # the same arrays, in that order
        raise AssertionError(f"the head's arrays were {mine[0].names} at the commit and are {list(arrays)} now")
    for i, variable in enumerate(arrays.values()):
        target = np.empty(tuple(variable.shape), kerases.numpy_dtype(variable))
        for shard, source in sorted(chosen.sources.items()):
            first, count = shard_range(net.classes, chosen.parallel, shard)
            whole = held[shard][i] if groups.rank == source else None
            broadcast_into(target, net.first, whole, first, count, groups, f"head_respread.{i}.{shard}", root=source)
        variable.assign(target)


def restore(net, saved: HeadCommit) -> None:
    """``net``'s own shard back to ``saved`` where ``net`` has the commit's layout (after a reset the head is
    split again from the commits the ranks hold anyway: ``respread``)."""
    if (net.head.layout, net.head.shard) != (saved.layout, saved.shard):
        return
    for variable, value in zip(net.head_arrays().values(), saved.own, strict=True):
        variable.assign(value)
