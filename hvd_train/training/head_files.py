"""The sharded head on disk: each of its arrays whole, in one ``.npy`` file, whatever the layout.

A head split by class (``--head-parallel``) is written so that any job can
read it back: one file per array (kernel, bias, each optimizer slot), the
columns in class order, as if one rank had held the whole head. Rank 0
writes the file memory-mapped and the ranks of its group send it their
columns a chunk at a time (``gather_into``), so no rank ever holds the
whole head in memory: rank 0 holds its own shard, one chunk of each rank
and the file's pages. A job of any world size and any G reads the columns
of its own classes (``read_columns``), memory-mapped: each rank reads
only its part. This is the re-split on restore.
"""

from __future__ import annotations

import os

import numpy as np

from hvd_train.distributed.groups import HeadGroups, shard_range
from hvd_train.errors import UserError

# Bytes of columns each rank sends in one round of the gather.
CHUNK_BYTES = 64 * 2**20


def path_of(folder: str, name: str) -> str:
    return os.path.join(folder, f"head.{name}.npy")


def read_columns(folder: str, name: str, first: int, count: int, classes: int) -> np.ndarray:
    """Columns ``first .. first + count`` of head array ``name`` (the last axis is the classes).

    Raises:
        UserError: the file is missing, or holds another number of classes.
    """
    path = path_of(folder, name)
    try:
        whole = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the head's {name} from {path} ({e}); the checkpoint is incomplete.") from None
    if whole.shape[-1] != classes:
        raise UserError(
            f"{path} holds a head of {whole.shape[-1]} classes, this run has {classes}: the data's classes "
            "changed; use a new --output, or --no-resume to start over."
        )
    return np.array(whole[..., first : first + count])


def gather_into(folder: str | None, name: str, shard: np.ndarray, groups: HeadGroups, classes: int) -> None:
    """Writes head array ``name`` whole to ``folder`` (rank 0) from the shards of the first group.

    Every rank of the first group must call this (the others return at
    once). ``shard``: this rank's columns, the classes on the last axis.
    ``folder``: where rank 0 writes (the others pass anything).
    """
    import horovod.tensorflow as hvd

    if groups.layout.group_of(groups.rank) != 0:
        return
    parallel = groups.parallel
    rows_shape = shard.shape[:-1]
    rows = int(np.prod(rows_shape)) if rows_shape else 1
    columns = np.ascontiguousarray(np.reshape(shard, (rows, -1)).T)  # [count, rows]: a column per row of the send
    ranges = [shard_range(classes, parallel, j) for j in range(parallel)]
    chunk = max(1, CHUNK_BYTES // max(1, rows * shard.itemsize))
    rounds = -(-max(count for _, count in ranges) // chunk)
    out = None
    if groups.rank == 0:
        out = np.lib.format.open_memmap(
            path_of(folder, name), mode="w+", dtype=shard.dtype, shape=(*rows_shape, classes)
        )
    for k in range(rounds):
        part = columns[k * chunk : (k + 1) * chunk]
        every = hvd.allgather(part, process_set=groups.group, name=f"head_gather.{name}.{k}").numpy()
        if out is None:
            continue
        at = 0
        for first, count in ranges:
            n = max(0, min(chunk, count - k * chunk))
            start = first + k * chunk
            out[..., start : start + n] = np.reshape(every[at : at + n].T, (*rows_shape, n))
            at += n
    if out is not None:
        out.flush()
        del out
