"""Each image's set of labels, for multi-label sets: one array of class indices and where each image's end.

A dense images x classes matrix of 1.28 million images and 1,000 classes
takes 1.3 GB a rank; the sets take 4 bytes a label and 8 an image (a few MB),
in two arrays that pickle as they are (the shape ``PathList`` has for paths).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class LabelSets:
    """The class indices of each image, sorted, without repeats (an image may have none)."""

    def __init__(self, indices: np.ndarray, ends: np.ndarray):
        self.indices = np.asarray(indices, np.int32).reshape(-1)
        self.ends = np.asarray(ends, np.int64).reshape(-1)

    @classmethod
    def of(cls, sets: Iterable[Iterable[int]]) -> LabelSets:
        rows = [sorted(set(s)) for s in sets]
        ends = np.cumsum([len(r) for r in rows], dtype=np.int64)
        flat = [i for r in rows for i in r]
        return cls(np.asarray(flat, np.int32), ends)

    def __len__(self) -> int:
        return int(self.ends.size)

    def starts(self) -> np.ndarray:
        return np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def row(self, i: int) -> np.ndarray:
        start = int(self.ends[i - 1]) if i > 0 else 0
        return self.indices[start : int(self.ends[i])]

    def rows(self) -> list[list[int]]:
        return [r.tolist() for r in np.split(self.indices, self.ends[:-1])] if len(self) else []

    def take(self, positions) -> LabelSets:
        """The sets at ``positions``, in that order."""
        positions = np.asarray(positions, np.int64)
        starts, ends = self.starts()[positions], self.ends[positions]
        parts = [self.indices[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return LabelSets(flat, np.cumsum(ends - starts, dtype=np.int64))

    def counts(self, classes: int) -> list[int]:
        """Images labelled with each class."""
        return np.bincount(self.indices.astype(np.int64), minlength=classes).tolist()

    def first(self) -> np.ndarray:
        """Each image's lowest class index, -1 for an image with none."""
        out = np.full(len(self), -1, np.int32)
        sizes = self.ends - self.starts()
        out[sizes > 0] = self.indices[self.starts()[sizes > 0]]
        return out

    @property
    def nbytes(self) -> int:
        return int(self.indices.nbytes + self.ends.nbytes)

    def __eq__(self, other) -> bool:
        if not isinstance(other, LabelSets):
            return NotImplemented
        return np.array_equal(self.indices, other.indices) and np.array_equal(self.ends, other.ends)


def split_keys(sets: LabelSets, classes: int) -> np.ndarray:
    """The key a multi-label set is held out by: each image's rarest class (so every class, the rare ones first,
    gives its share), ``classes`` for an image with no label."""
    counts = np.asarray(sets.counts(classes))
    keys = np.full(len(sets), classes, np.int64)
    for i, row in enumerate(sets.rows()):
        if row:
            keys[i] = row[int(np.argmin(counts[row]))]
    return keys


def every_class_trained(sets: LabelSets, classes: int, train: list[int], held: list[int]) -> tuple[list, list]:
    """``(train, held)`` with, for each class none of whose images is in ``train``, the first of its held-out
    images moved to ``train``: a split by rarest class can hold out every image of a class that is never an
    image's rarest (as {a, y} and {b, y}, each in a group of two); it would then be scored and never trained."""
    if not len(sets):
        return train, held
    image_of = np.repeat(np.arange(len(sets)), np.diff(np.concatenate([[0], sets.ends])))
    in_train = np.zeros(len(sets), bool)
    in_train[np.asarray(train, np.int64)] = True
    trained = np.zeros(classes, bool)
    trained[sets.indices[in_train[image_of]]] = True
    moved = set()
    for c in np.flatnonzero(~trained & (np.asarray(sets.counts(classes)) > 0)):
        if trained[c]:  # an image moved for an earlier class has it
            continue
        first = int(image_of[(sets.indices == c) & ~in_train[image_of]].min())
        in_train[first] = True
        trained[sets.row(first)] = True
        moved.add(first)
    if not moved:
        return train, held
    return sorted([*train, *moved]), [i for i in held if i not in moved]
