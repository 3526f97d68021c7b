"""Who trains on which image, in which order: epochs, segments and ranks.

Everything here is plain numpy and depends only on the seed, the epoch and
the numbers of images, workers and batch, so every rank computes the same
plan without talking to the others, and a resumed run computes the plan of
the interrupted one.

* Each epoch has an **order**: a permutation of the training images drawn
  from ``(seed, epoch)`` (for a packed shard set: the records, shard after
  shard, in a shard order drawn from ``(seed, epoch)``). A *position* is an
  index into that order.
* A **segment** is a stretch of an epoch run by a fixed number of workers.
  It covers the positions still *pending* when it began (the whole epoch at
  first), padded by wrapping around to ``steps * batch * size`` so that
  every rank runs exactly ``steps`` full batches: Horovod allreduces once
  per step, and a rank with fewer steps would leave the others waiting.
* A **layout** deals the padded positions to the ranks: every ``size``-th
  one for image folders, contiguous runs (ranged reads) for shard sets.

A run that stops after ``k`` steps of a segment resumes in one of two ways.
With the same workers it continues the same segment at step ``k`` (same
data, same order, consumed images skipped). With another number of workers
(an elastic job that lost or gained one, or a rerun on another cluster) the
images not consumed yet become the pending positions of a new segment,
re-dealt to the new ranks with equal steps again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

Intervals = tuple[tuple[int, int], ...]
"""Sorted, disjoint ``[lo, hi)`` ranges of positions."""


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``n`` images in ``epoch``: a permutation drawn from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def to_intervals(positions: np.ndarray) -> Intervals:
    """Sorted unique positions as ``[lo, hi)`` ranges."""
    p = np.unique(np.asarray(positions, dtype=np.int64))
    if p.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [p.size]])
    return tuple((int(p[a]), int(p[b - 1]) + 1) for a, b in zip(starts, ends))


def from_intervals(intervals: Intervals) -> np.ndarray:
    """The positions of ``intervals``, in order."""
    if not intervals:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in intervals])


def count(intervals: Intervals) -> int:
    return sum(hi - lo for lo, hi in intervals)


class Layout:
    """How a segment's padded positions are dealt to the ranks.

    ``deal`` returns, for one rank, indices into the padded sequence in the
    order the rank consumes them; ``steps * batch`` of them.
    """

    def deal(self, segment: Segment, padded: np.ndarray, rank: int) -> np.ndarray:
        raise NotImplementedError


class Strided(Layout):
    """Rank ``r`` takes every ``size``-th padded position, starting at ``r``.

    After ``k`` steps the ranks together have consumed a prefix of the
    padded sequence.
    """

    def deal(self, segment: Segment, padded: np.ndarray, rank: int) -> np.ndarray:
        return np.arange(rank, padded.size, segment.size, dtype=np.int64)


@dataclass(frozen=True)
class Segment:
    """A stretch of epoch ``epoch`` run by ``size`` workers with equal steps.

    Attributes:
        epoch: the epoch, counted from 0.
        total: images in the epoch.
        pending: positions not consumed when the segment began.
        size: workers.
        batch: images per worker per step.
        accum: steps per optimizer update; ``steps`` is a multiple of it so
            that the segment ends on a full update.
        seed: the run's seed (layouts that mix records use it).
    """

    epoch: int
    total: int
    pending: Intervals
    size: int
    batch: int
    accum: int = 1
    seed: int = 0
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def whole(cls, epoch: int, total: int, size: int, batch: int, accum: int = 1, seed: int = 0) -> Segment:
        """The segment of a whole epoch."""
        return cls(epoch, total, ((0, total),) if total else (), size, batch, accum, seed)

    @property
    def pending_count(self) -> int:
        return count(self.pending)

    @property
    def done_before(self) -> int:
        """Images of the epoch consumed before this segment began."""
        return self.total - self.pending_count

    @property
    def steps(self) -> int:
        """Batches per rank: every pending image at least once, rounded up to whole updates."""
        m = self.pending_count
        if m == 0:
            return 0
        steps = math.ceil(m / (self.batch * self.size))
        return math.ceil(steps / self.accum) * self.accum

    def padded(self) -> np.ndarray:
        """Pending positions, wrapped around to ``steps * batch * size``."""
        if "padded" not in self._cache:
            pending = from_intervals(self.pending)
            self._cache["padded"] = np.resize(pending, self.steps * self.batch * self.size) if pending.size else pending
        return self._cache["padded"]

    def stream(self, layout: Layout, rank: int, start_step: int = 0) -> np.ndarray:
        """Positions rank ``rank`` consumes from step ``start_step`` on, in order."""
        padded = self.padded()
        if padded.size == 0:
            return padded
        order = layout.deal(self, padded, rank)
        return padded[order[start_step * self.batch :]]

    def consumed(self, steps: int) -> int:
        """About how many images of the epoch are consumed after ``steps`` steps (for the learning rate)."""
        return self.done_before + min(steps * self.batch * self.size, self.pending_count)

    def remaining(self, layout: Layout, steps: int) -> Intervals:
        """Positions no rank has consumed after ``steps`` steps of this segment.

        Padding (wrapped-around repeats) is left out: a repeat consumed or
        not changes nothing about which images the epoch still owes.
        """
        if steps >= self.steps:
            return ()
        padded = self.padded()
        real = self.pending_count
        left = [order[steps * self.batch :] for order in (layout.deal(self, padded, r) for r in range(self.size))]
        indices = np.concatenate(left)
        return to_intervals(padded[indices[indices < real]])

    def follow_on(self, layout: Layout, steps: int, size: int, batch: int, accum: int = 1) -> Segment:
        """The segment that runs what is left after ``steps`` steps, with ``size`` workers."""
        return Segment(self.epoch, self.total, self.remaining(layout, steps), size, batch, accum, self.seed)
