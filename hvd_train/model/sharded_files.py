"""The sharded head on disk: each of its arrays whole, in one ``.npy`` file, whatever the layout.

A head sharded by class (``--head-parallel``) is written so that any job can
read it back: one file per array (kernel, bias, each optimizer slot), the
columns in class order, as if one rank had held the whole head. Rank 0
writes the file memory-mapped and the ranks of its group send it their
columns a chunk at a time (``gather_into``), so no rank ever holds the
whole head in memory: rank 0 holds its own shard, one chunk of each rank
and the file's pages. On a resume of any world size and any G, rank 0
reads the file a chunk at a time and broadcasts it, and each rank keeps
the columns of its own classes (``broadcast_columns``): the re-split. No
other rank needs to see rank 0's files. ``read_columns`` reads one range.
"""

from __future__ import annotations

import os

import numpy as np

from hvd_train.distributed.groups import HeadGroups, shard_range
from hvd_train.errors import UserError

# Bytes of columns each rank sends in one round of the gather (and rank 0 in one of the broadcast). Each
# round must pass within Horovod's Gloo timeout (30 s) even on a slow link: a 51 MB round once stalled
# for minutes on a loopback connection whose send buffer had shrunk to one 64 KB segment (about 1.5 MB/s,
# each segment waiting for a delayed ACK), where rounds of 2 MB took at most 2.2 s.
CHUNK_BYTES = 2 * 2**20


def columns_per_chunk(shard: np.ndarray) -> int:
    """Columns of ``shard``'s kind (the classes on the last axis) in ``CHUNK_BYTES``, at least one."""
    rows = int(np.prod(shard.shape[:-1])) if shard.ndim > 1 else 1
    return max(1, CHUNK_BYTES // max(1, rows * shard.itemsize))


def as_rows(shard: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """``shard``'s shape but its classes (the last axis), and its columns as rows: ``[count, rows]``, a column per
    row, contiguous (what an exchange sends a chunk at a time)."""
    rows_shape = shard.shape[:-1]
    rows = int(np.prod(rows_shape)) if rows_shape else 1
    return rows_shape, np.ascontiguousarray(np.reshape(shard, (rows, -1)).T)


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


def load_whole(layer, folder: str) -> None:
    """A Dense layer's kernel and bias set to the whole head saved in ``folder``, read memory-mapped."""
    for variable, name in ((layer.kernel, "kernel"), (layer.bias, "bias")):
        variable.assign(np.load(path_of(folder, name), mmap_mode="r"))


def has_head(folder: str) -> bool:
    """Whether checkpoint ``folder`` was written by a sharded run (its head in files)."""
    return os.path.exists(path_of(folder, "kernel"))


def check(folder: str, names, classes: int) -> None:
    """Refuses a checkpoint without the head's files, or with a head of other classes (rank 0, before a restore)."""
    for name in names:
        if not os.path.exists(path_of(folder, name)):
            raise UserError(
                f"checkpoint {folder} holds no {os.path.basename(path_of(folder, name))}: it was written with "
                "another --optimizer, or is incomplete; resume with the run's options, or pass --no-resume."
            )
        read_columns(folder, name, 0, 0, classes)


def gather_into(folder: str | None, name: str, shard: np.ndarray, groups: HeadGroups, classes: int) -> None:
    """Writes head array ``name`` whole to ``folder`` (rank 0) from the shards of the first group.

    Every rank of the first group must call this (the others return at
    once). ``shard``: this rank's columns, the classes on the last axis.
    ``folder``: where rank 0 writes (the others pass anything).
    """
    if groups.layout.group_of(groups.rank) != 0:
        return
    parallel, chunk = groups.parallel, columns_per_chunk(shard)
    rows_shape, columns = as_rows(shard)
    ranges = [shard_range(classes, parallel, j) for j in range(parallel)]
    rounds = -(-max(count for _, count in ranges) // chunk)
    out = None
    if groups.rank == 0:
        out = np.lib.format.open_memmap(
            path_of(folder, name), mode="w+", dtype=shard.dtype, shape=(*rows_shape, classes)
        )
    for k in range(rounds):
        part = columns[k * chunk : (k + 1) * chunk]
        every = groups.gather(part, f"head_gather.{name}.{k}").numpy()
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


def broadcast_columns(
    folder: str | None, name: str, shard: np.ndarray, first: int, classes: int, groups: HeadGroups
) -> np.ndarray:
    """This rank's columns of head array ``name``, read by rank 0 (``folder``; None elsewhere) and sent to all.

    Every rank of the job calls this. The whole array goes by in chunks of
    ``CHUNK_BYTES``, each broadcast from rank 0, and each rank keeps the
    part of its classes: no rank holds more than its shard and a chunk, and
    no other rank needs to see rank 0's files.

    Args:
        shard: an array of this rank's shape and type (the classes on the last axis).
    """
    whole = np.load(path_of(folder, name), mmap_mode="r") if folder is not None else None  # checked (``check``)
    out = np.empty_like(shard)
    broadcast_into(out, first, whole, 0, classes, groups, f"head_restore.{name}")
    return out


def broadcast_into(
    out: np.ndarray, first: int, whole, at: int, columns: int, groups: HeadGroups, name: str, root: int = 0
) -> None:
    """Classes ``at .. at + columns`` of a head array, ``whole`` on rank ``root`` (None elsewhere), broadcast to
    every rank of the job in chunks of ``CHUNK_BYTES``; each rank writes those of its classes (``first ..``, as
    many as ``out`` has columns) into ``out``. Every rank calls this, with ``out`` of its shape and type."""
    rows_shape, chunk, last = out.shape[:-1], columns_per_chunk(out), first + out.shape[-1]
    for k, start in enumerate(range(0, columns, chunk)):
        end = min(columns, start + chunk)
        part = (
            np.ascontiguousarray(whole[..., start:end])
            if whole is not None
            else np.zeros((*rows_shape, end - start), out.dtype)
        )
        part = groups.broadcast(part, f"{name}.{k}", root=root).numpy()
        low, high = max(at + start, first), min(at + end, last)  # classes of both
        if low < high:
            out[..., low - first : high - first] = part[..., low - at - start : high - at - start]
