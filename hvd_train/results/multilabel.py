"""Held-out scores of a multi-label classifier, exact across ranks: counts at a threshold, and average precision.

Each rank scores its own share of the held-out images. Per class, the
true and false positives and the false negatives at the decision
``probability >= threshold`` are sums, so one all-reduce of counts gives
them exactly. Average precision is not a sum of per-rank parts: it ranks
every image of the class by score. It is made exact without gathering
every score:

1. every rank gathers the scores of the positives (one number an image
   and class it is labelled with: a few per image, not one per class);
2. for each class and each distinct score ``s`` of its positives, every
   rank counts its images scored ``>= s`` (a sort and a binary search);
3. one all-reduce of those counts gives, with the positives now known to
   all, precision at every recall step:

   AP = sum over distinct positive scores s of (positives at s / positives)
   * (positives >= s) / (images >= s)

which is scikit-learn's ``average_precision_score`` (steps, ties taken
together). Scores are logits, which rank as the probabilities do without
the float32 sigmoid's saturation at 1.0 (that would tie the most certain
images). A score that is not finite ranks last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Gather = Callable[[object], list]
ReduceSum = Callable[[np.ndarray], np.ndarray]


def one_rank() -> tuple[Gather, ReduceSum]:
    """The collectives of a job of one process."""
    return (lambda obj: [obj]), (lambda array: array)


@dataclass(frozen=True)
class Counts:
    """Per class, at one threshold: true positives, false positives, false negatives (int64 arrays)."""

    tp: np.ndarray
    fp: np.ndarray
    fn: np.ndarray

    @property
    def positives(self) -> np.ndarray:
        return self.tp + self.fn

    def precision(self) -> np.ndarray:
        """Per class; NaN where nothing was predicted."""
        return _ratio(self.tp, self.tp + self.fp)

    def recall(self) -> np.ndarray:
        """Per class; NaN where the class has no positive."""
        return _ratio(self.tp, self.tp + self.fn)

    def f1(self) -> np.ndarray:
        """Per class; NaN where the class is neither labelled nor predicted."""
        return _ratio(2 * self.tp, 2 * self.tp + self.fp + self.fn)

    def micro_f1(self) -> float:
        tp, fp, fn = int(self.tp.sum()), int(self.fp.sum()), int(self.fn.sum())
        return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else float("nan")


def counts(logits: np.ndarray, labels: np.ndarray, threshold: float, reduce_sum: ReduceSum) -> Counts:
    """Per-class counts of all ranks at ``probability >= threshold``.

    Args:
        logits: this rank's ``[N, C]`` scores (float32).
        labels: this rank's ``[N, C]`` multi-hot labels (0 or 1).
        threshold: the decision, a probability in (0, 1); compared on the
            logits (``log(t / (1 - t))``), as the sigmoid is monotone.
        reduce_sum: the sum of an array over all ranks.
    """
    cut = np.float32(np.log(threshold / (1.0 - threshold)))
    predicted = np.nan_to_num(np.asarray(logits, np.float32), nan=-np.inf) >= cut
    truth = np.asarray(labels) > 0
    local = np.stack([(predicted & truth).sum(0), (predicted & ~truth).sum(0), (~predicted & truth).sum(0)]).astype(
        np.float64
    )
    summed = np.rint(reduce_sum(local)).astype(np.int64)
    return Counts(*summed)


def average_precisions(logits: np.ndarray, labels: np.ndarray, gather: Gather, reduce_sum: ReduceSum) -> np.ndarray:
    """Per-class average precision over the images of all ranks; NaN for a class with no positive.

    Args:
        logits: this rank's ``[N, C]`` scores.
        labels: this rank's ``[N, C]`` multi-hot labels.
        gather: every rank's object, in rank order, on every rank.
        reduce_sum: the sum of an array over all ranks.
    """
    scores = np.nan_to_num(np.asarray(logits, np.float32), nan=-np.inf)
    classes = scores.shape[1]
    rows, cls = np.nonzero(np.asarray(labels) > 0)
    mine = (cls.astype(np.int32), scores[rows, cls])
    parts = gather(mine)
    all_cls = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
    all_scores = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.float32)
    # Per class: its positives' distinct scores, descending, and how many positives have each.
    steps = []
    for c in range(classes):
        values, at = np.unique(all_scores[all_cls == c], return_counts=True)
        steps.append((values[::-1], at[::-1]))
    # Every rank counts its images scored >= each step, in the same order; one sum gives all ranks' counts.
    local = [
        scores.shape[0] - np.searchsorted(np.sort(scores[:, c]), values, side="left")
        for c, (values, _) in enumerate(steps)
    ]
    flat = np.concatenate(local).astype(np.float64) if local else np.zeros(0)
    total = np.rint(reduce_sum(flat)).astype(np.int64)
    out = np.full(classes, np.nan)
    start = 0
    for c, (values, at) in enumerate(steps):
        end = start + values.size
        if values.size:
            positives_ge = np.cumsum(at)
            images_ge = total[start:end]
            out[c] = float(np.sum((at / positives_ge[-1]) * (positives_ge / images_ge)))
        start = end
    return out


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, numerator / np.maximum(denominator, 1), np.nan)
