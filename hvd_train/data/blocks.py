"""Reading packed shard sets in blocks: which records a rank reads, and in which order.

Training (``BlockLayout``): an epoch's order is the records shard after
shard, in a shard order drawn from ``(seed, epoch)``. Each rank takes one
contiguous run of a segment's padded positions (so it reads its records
with a few ranged reads, not one request per image), cut into blocks of
about ``BLOCK_BYTES``. The blocks are taken in a random order, ``CYCLE`` at a
time, one record from each in turn, and the records of a block in a random
order: consecutive batches mix records of many shards. Every choice is
drawn from ``(seed, epoch, rank, position in the epoch)``, so the order is a
pure function of the plan: a resumed run skips the records already consumed
and reads the rest in the same order, without reading the skipped ones.

Evaluation (``eval_blocks``): the records in manifest order, cut into one
contiguous range per rank: every held-out image once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from hvd_train.data.packed import ShardSet
from hvd_train.data.sharding import Layout, Segment

BLOCK_BYTES = 4 << 20  # a ranged read: large enough for S3 throughput, small enough to mix
CYCLE = 16  # blocks read interleaved, one record from each in turn


@dataclass(frozen=True)
class Block:
    """Records ``first`` ... ``last - 1`` of shard ``shard`` (manifest index): one ranged read."""

    shard: int
    first: int
    last: int


def shard_order(shard_set: ShardSet, seed: int, epoch: int) -> np.ndarray:
    """Shards in the order epoch ``epoch`` reads them."""
    return np.random.default_rng([seed, epoch, 1]).permutation(len(shard_set.shards))


class BlockLayout(Layout):
    """Deals a segment of epoch ``epoch`` of a shard set to ranks (see the module docstring)."""

    def __init__(self, shard_set: ShardSet, seed: int, epoch: int, block_bytes: int = BLOCK_BYTES, cycle: int = CYCLE):
        self.shard_set = shard_set
        self.seed = seed
        self.epoch = epoch
        self.block_bytes = block_bytes
        self.cycle = cycle
        self.order = shard_order(shard_set, seed, epoch)
        sizes = np.array([shard_set.shards[s].images for s in self.order], np.int64)
        # Position p of the epoch is record p - begin[k] of the k-th shard of `order`.
        self._begin = np.concatenate([[0], np.cumsum(sizes)])
        # Byte offset of every record in its shard, in manifest order.
        self._offsets = np.concatenate([np.asarray(s.offsets, np.int64) for s in shard_set.shards])
        self._plans: dict[tuple, tuple[np.ndarray, np.ndarray, list[Block]]] = {}

    def record(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, record index in the shard)`` of each position."""
        k = np.searchsorted(self._begin, positions, side="right") - 1
        return self.order[k], positions - self._begin[k]

    def global_index(self, positions: np.ndarray) -> np.ndarray:
        """Each position's record index in manifest order (the key of its augmentation)."""
        shard, index = self.record(positions)
        return np.asarray(self.shard_set.starts)[shard] + index

    def deal(self, segment: Segment, padded: np.ndarray, rank: int) -> np.ndarray:
        return self.plan(segment, padded, rank)[0]

    def plan(self, segment: Segment, padded: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, list[Block]]:
        """Rank ``rank``'s consumption order (indices into ``padded``), each one's block, and the blocks."""
        key = (segment.epoch, segment.done_before, segment.size, segment.batch, rank, padded.size)
        if key in self._plans:
            return self._plans[key]
        length = segment.steps * segment.batch
        mine = np.arange(rank * length, (rank + 1) * length, dtype=np.int64)
        runs = self._blocks(padded[mine])
        rng = np.random.default_rng([self.seed, segment.epoch, rank, segment.done_before, 3])
        runs = [runs[i] for i in rng.permutation(len(runs))]
        runs = [(lo + rng.permutation(hi - lo)) for lo, hi in runs]
        picks, block_of = _interleave(runs, self.cycle)
        blocks = []
        for lo_hi in runs:
            first = padded[mine[lo_hi.min()]]
            shard, index = self.record(np.array([first]))
            blocks.append(Block(int(shard[0]), int(index[0]), int(index[0]) + len(lo_hi)))
        result = (mine[picks], block_of, blocks)
        self._plans[key] = result
        return result

    def reads(self, segment: Segment, rank: int, start_step: int = 0):
        """What rank ``rank`` reads from step ``start_step`` of ``segment`` on.

        Returns:
            ``(blocks, block_of, within, positions)``: the blocks, and for each
            record to consume in order, its block, its index in the block and
            its position in the epoch.
        """
        padded = segment.padded()
        if padded.size == 0:
            empty = np.zeros(0, np.int64)
            return [], empty, empty, empty
        order, block_of, blocks = self.plan(segment, padded, rank)
        skip = start_step * segment.batch
        order, block_of = order[skip:], block_of[skip:]
        positions = padded[order]
        _, index = self.record(positions)
        firsts = np.array([b.first for b in blocks], np.int64)
        return blocks, block_of, index - firsts[block_of], positions

    def _blocks(self, positions: np.ndarray) -> list[tuple[int, int]]:
        """``[lo, hi)`` index runs of ``positions`` that are consecutive records of one shard, up to a block."""
        if positions.size == 0:
            return []
        shard, index = self.record(positions)
        offset = self._offsets[np.asarray(self.shard_set.starts)[shard] + index]
        consecutive = (shard[1:] == shard[:-1]) & (index[1:] == index[:-1] + 1)
        run = np.concatenate([[0], np.cumsum(~consecutive)])
        run_start = np.concatenate([[0], np.flatnonzero(~consecutive) + 1])
        piece = (offset - offset[run_start][run]) // self.block_bytes
        starts = np.flatnonzero(np.concatenate([[True], (run[1:] != run[:-1]) | (piece[1:] != piece[:-1])]))
        ends = np.concatenate([starts[1:], [positions.size]])
        return list(zip(starts.tolist(), ends.tolist()))


def _interleave(runs: list[np.ndarray], cycle: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-robin over ``cycle`` runs at a time; a finished run's slot goes to the next run.

    Returns:
        The picked elements, and for each the index of the run it came from.
    """
    picks: list[int] = []
    origin: list[int] = []
    pending = iter(range(len(runs)))
    active = [[j, 0] for j in (next(pending, None) for _ in range(cycle)) if j is not None]
    while active:
        still = []
        for slot in active:
            j, i = slot
            picks.append(int(runs[j][i]))
            origin.append(j)
            if i + 1 < len(runs[j]):
                still.append([j, i + 1])
            else:
                nxt = next(pending, None)
                if nxt is not None:
                    still.append([nxt, 0])
        active = still
    return np.array(picks, np.int64), np.array(origin, np.int64)


def stream_records(plans: Iterable[tuple], fetch: Callable[[Block], list[bytes]], fetcher, cycle: int = CYCLE):
    """Yields ``(record, emission index, tag)`` plan after plan, fetching each block once.

    Args:
        plans: ``(blocks, block_of, within, tag)``: the blocks of a plan, and
            for each record to emit, in order, its block and its index in the
            block; ``tag`` is passed through with every record of the plan.
        fetch: reads one block's records.
        fetcher: a ``fetcher.Fetcher``: blocks are fetched in parallel, in
            the order of their first use, across plans.
        cycle: blocks in use at once; the fetcher reads ahead of them.
    """
    seen: list[tuple] = []

    def items():
        for plan in plans:
            seen.append(plan)
            block_of = plan[1]
            if block_of.size:
                used, first = np.unique(block_of, return_index=True)
                for j in used[np.argsort(first)].tolist():
                    yield len(seen) - 1, j

    fetched = fetcher.stream(items(), lambda item: fetch(seen[item[0]][0][item[1]]), window=fetcher.concurrency + cycle)
    loaded: dict[tuple[int, int], list[bytes]] = {}

    def pull() -> bool:
        item = next(fetched, None)
        if item is None:
            return False
        loaded[item[0]] = item[1]
        return True

    p = 0
    while p < len(seen) or pull():
        if p >= len(seen):
            continue
        blocks, block_of, within, tag = seen[p]
        left = np.bincount(block_of, minlength=len(blocks))
        for n, (j, w) in enumerate(zip(block_of.tolist(), within.tolist())):
            while (p, j) not in loaded:
                if not pull():
                    raise RuntimeError(f"block {j} of plan {p} was never fetched")
            yield loaded[(p, j)][w], n, tag
            left[j] -= 1
            if left[j] == 0:
                del loaded[(p, j)]
        p += 1


def eval_blocks(shard_set: ShardSet, rank: int, size: int) -> list[Block]:
    """Rank ``rank``'s contiguous share of the records in manifest order, as blocks."""
    bounds = np.linspace(0, len(shard_set), size + 1).astype(np.int64)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    out = []
    starts = shard_set.starts
    for s in range(len(shard_set.shards)):
        a, b = max(lo, int(starts[s])), min(hi, int(starts[s + 1]))
        if a < b:
            out.extend(_split(shard_set, s, a - int(starts[s]), b - int(starts[s])))
    return out


def _split(shard_set: ShardSet, shard: int, first: int, last: int) -> list[Block]:
    """Records ``first`` ... ``last - 1`` of a shard as blocks of about ``BLOCK_BYTES``."""
    offsets = shard_set.shards[shard].offsets
    out = []
    while first < last:
        end = first + 1
        while end < last and offsets[end] - offsets[first] < BLOCK_BYTES:
            end += 1
        out.append(Block(shard, first, end))
        first = end
    return out
