"""The confusion of a classifier over held-out images, kept as its non-zero cells.

A dense matrix has one cell per pair of classes: 800 MB of counts at
10,000 classes, 80 GB at 100,000. Held-out images fill at most one cell
each, so ``Confusion`` keeps only ``(true class, predicted class, images)``
for the cells that have any, and gives what the outputs need: the images
and right answers of every class, each class's most frequent mistake, the
most confused pairs, and the dense matrix where a picture can show it.

An image whose scores were not all finite (a diverged model) has no
predicted class: it is kept with the predicted class -1, counts among its
class's images, is never right, and is in no cell of the dense matrix nor
among the mistakes between classes (``unanswered`` counts it).
"""

from __future__ import annotations

import numpy as np


class Confusion:
    """Image counts by ``(true class, predicted class)`` over ``classes`` classes.

    Args:
        classes: the number of classes.
        true, predicted: one entry per image (or per cell, with ``counts``); a predicted class of -1:
            no answer (the image's scores were not finite).
        counts: images per entry (default 1 each).
    """

    def __init__(self, classes: int, true=(), predicted=(), counts=None):
        self.classes = int(classes)
        true = np.asarray(true, np.int64).ravel()
        predicted = np.asarray(predicted, np.int64).ravel()
        counts = np.ones(true.size, np.int64) if counts is None else np.asarray(counts, np.int64).ravel()
        # One cell per (true, predicted) pair, -1 (no answer) among the predicted classes.
        stride = self.classes + 1
        cells, where = np.unique(true * stride + predicted + 1, return_inverse=True)
        summed = np.bincount(where, weights=counts, minlength=cells.size).astype(np.int64) if cells.size else counts
        kept = summed > 0
        self.true, self.predicted = cells[kept] // stride, cells[kept] % stride - 1
        self.counts = summed[kept]

    @classmethod
    def of_dense(cls, matrix) -> Confusion:
        matrix = np.asarray(matrix, np.int64)
        t, p = np.nonzero(matrix)
        return cls(matrix.shape[0], t, p, matrix[t, p])

    def __add__(self, other: Confusion) -> Confusion:
        return Confusion(
            self.classes,
            np.concatenate([self.true, other.true]),
            np.concatenate([self.predicted, other.predicted]),
            np.concatenate([self.counts, other.counts]),
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, Confusion) and self.classes == other.classes and self.cells() == other.cells()

    def cells(self) -> list[list[int]]:
        """``[true, predicted, images]`` of every non-zero cell, in class order."""
        return np.stack([self.true, self.predicted, self.counts], axis=1).tolist() if self.counts.size else []

    def sum(self) -> int:
        """All images counted."""
        return int(self.counts.sum())

    def trace(self) -> int:
        """Images whose prediction was right."""
        return int(self.counts[self.true == self.predicted].sum())

    def totals(self) -> np.ndarray:
        """Images of each true class."""
        return np.bincount(self.true, weights=self.counts, minlength=self.classes).astype(np.int64)

    def right(self) -> np.ndarray:
        """Images of each class predicted right."""
        hit = self.true == self.predicted
        return np.bincount(self.true[hit], weights=self.counts[hit], minlength=self.classes).astype(np.int64)

    def unanswered(self) -> int:
        """Images with no predicted class (scores not finite)."""
        return int(self.counts[self.predicted < 0].sum())

    def dense(self) -> np.ndarray:
        """The whole matrix (rows true, columns predicted; images with no answer left out): only for few classes."""
        matrix = np.zeros((self.classes, self.classes), np.int64)
        answered = self.predicted >= 0
        matrix[self.true[answered], self.predicted[answered]] = self.counts[answered]
        return matrix

    def mistakes(self, top: int | None = None) -> list[tuple[int, int, int]]:
        """Off-diagonal cells ``(true, predicted, images)``, most images first (then in class order)."""
        off = (self.true != self.predicted) & (self.predicted >= 0)
        t, p, n = self.true[off], self.predicted[off], self.counts[off]
        order = np.lexsort((p, t, -n))[:top]
        return [(int(t[i]), int(p[i]), int(n[i])) for i in order]

    def most_taken_for(self) -> dict[int, tuple[int, int]]:
        """For each class with mistakes: the class it is most often taken for, and how often."""
        taken: dict[int, tuple[int, int]] = {}
        for t, p, n in self.mistakes():  # most images first: the first seen for a class is its largest
            taken.setdefault(t, (p, n))
        return taken
