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
images). A NaN score ranks last.

A decision is the one ``predict`` and the exports make (``decide``): the
float32 probability against the float32 threshold, ``p >= t``.
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


def decide(probabilities, threshold: float) -> np.ndarray:
    """Which labels apply: each float32 probability ``>= threshold`` (as float32), as ``predict``, the exports'
    ``over_threshold`` and ``evaluate`` take them (NaN: no label)."""
    return np.asarray(probabilities, np.float32) >= np.float32(threshold)


def tally(probabilities: np.ndarray, labels: np.ndarray, threshold: float) -> np.ndarray:
    """This rank's ``[3, C]`` true positives, false positives and false negatives at ``decide``."""
    predicted = decide(probabilities, threshold)
    truth = np.asarray(labels) > 0
    return np.stack([(predicted & truth).sum(0), (predicted & ~truth).sum(0), (~predicted & truth).sum(0)])


def counts(probabilities: np.ndarray, labels: np.ndarray, threshold: float, reduce_sum: ReduceSum) -> Counts:
    """Per-class counts of all ranks at ``decide(probabilities, threshold)``.

    Args:
        probabilities: this rank's ``[N, C]`` sigmoid outputs (float32).
        labels: this rank's ``[N, C]`` multi-hot labels (0 or 1).
        threshold: the decision, a probability in (0, 1).
        reduce_sum: the sum of an array over all ranks.
    """
    return summed_counts(tally(probabilities, labels, threshold), reduce_sum)


def summed_counts(local: np.ndarray, reduce_sum: ReduceSum) -> Counts:
    """The ``Counts`` of every rank's ``tally`` (summed: exact below 2**53)."""
    return Counts(*np.rint(reduce_sum(np.asarray(local, np.float64))).astype(np.int64))


def average_precisions(logits: np.ndarray, labels: np.ndarray, gather: Gather, reduce_sum: ReduceSum) -> np.ndarray:
    """Per-class average precision over the images of all ranks; NaN for a class with no positive.

    Args:
        logits: this rank's ``[N, C]`` scores.
        labels: this rank's ``[N, C]`` multi-hot labels.
        gather: every rank's object, in rank order, on every rank.
        reduce_sum: the sum of an array over all ranks.
    """
    scores = np.asarray(logits, np.float32)
    rows, cls = np.nonzero(np.asarray(labels) > 0)
    return ranked(scores, cls, scores[rows, cls], gather, reduce_sum)


def ranked(logits: np.ndarray, cls: np.ndarray, positive: np.ndarray, gather: Gather, reduce_sum: ReduceSum):
    """``average_precisions`` of this rank's ``[N, C]`` scores, its positives given as their classes ``cls`` and
    scores ``positive`` (an image's labels: a few numbers an image, where a dense matrix of labels is C)."""
    scores = np.nan_to_num(np.asarray(logits, np.float32), nan=-np.inf)
    classes = scores.shape[1]
    mine = (np.asarray(cls, np.int32), np.nan_to_num(np.asarray(positive, np.float32), nan=-np.inf))
    parts = gather(mine)
    all_cls = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
    all_scores = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.float32)
    # Per class: its positives' distinct scores, descending, and how many positives have each (one sort by class).
    order = np.argsort(all_cls, kind="stable")
    bounds = np.searchsorted(all_cls[order], np.arange(1, classes))
    steps = []
    for mine_c in np.split(all_scores[order], bounds):
        values, at = np.unique(mine_c, return_counts=True)
        steps.append((values[::-1], at[::-1]))
    # Every rank counts its images scored >= each step, in the same order; one sum gives all ranks' counts.
    local = [
        scores.shape[0] - np.searchsorted(np.sort(scores[:, c]), values, side="left")
        for c, (values, _) in enumerate(steps)
    ]
    flat = np.concatenate(local).astype(np.float64) if local else np.zeros(0)
    # The same length on every rank (the positives are all ranks'); none at all: nothing to sum.
    total = np.rint(reduce_sum(flat)).astype(np.int64) if flat.size else np.zeros(0, np.int64)
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


@dataclass(frozen=True)
class MultiLabelResult:
    """The held-out scores of a multi-label classifier, of all ranks (``evaluate_multi``)."""

    count: int
    loss_sum: float
    counts: Counts
    ap: np.ndarray
    threshold: float
    skipped: tuple[int, ...] = ()
    seconds: float = 0.0

    @property
    def loss(self) -> float:
        """The mean over images of the binary cross-entropy averaged over classes (NaN where a score was)."""
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def map(self) -> float:
        """The mean average precision over the classes with a positive."""
        scored = self.ap[~np.isnan(self.ap)]
        return float(scored.mean()) if scored.size else float("nan")

    @property
    def f1(self) -> float:
        return self.counts.micro_f1()


def evaluate_multi(model, dataset, ctx, threshold: float, name: str = "eval") -> MultiLabelResult:
    """Scores this rank's share of held-out images, ``(images, multi-hot rows, ids)`` batches (a negative id: a
    stand-in for an image that could not be decoded, not scored), and sums over all ranks: exact counts and
    average precision (the module's docstring). Every rank must call it."""
    import time

    from hvd_train.compat import keras, tf
    from hvd_train.model.catalogue import HEAD_LAYER

    started = time.perf_counter()
    head = model.get_layer(HEAD_LAYER)
    step = model.__dict__.get("_hvd_train_multi_step")  # one trace a model, not one an epoch
    if step is None:
        both = keras.Model(model.inputs, [head.input, head.output])

        @tf.function(reduce_retracing=True, autograph=False)
        def step(images):
            # The probabilities of the head's own call, as predict and the SavedModel compute them (its fused
            # matmul, bias and sigmoid: a separate sum differs by an ulp, which can cross the threshold); the
            # logits, which rank them without the sigmoid's saturation.
            rows, probabilities = both(images, training=False)
            rows = tf.cast(rows, tf.float32)
            logits = tf.matmul(rows, tf.cast(head.kernel, tf.float32)) + tf.cast(head.bias, tf.float32)
            return logits, tf.cast(probabilities, tf.float32)

        model.__dict__["_hvd_train_multi_step"] = step

    classes = int(head.kernel.shape[-1])
    # Kept per image: its scores (C float32); of its labels, only the positives. Counts and loss are summed.
    logits, cls, positive, skipped = [np.zeros((0, classes), np.float32)], [], [], []
    local, images_seen, loss_sum = np.zeros((3, classes), np.int64), 0, 0.0
    for images, rows, ids in dataset:
        ids = ids.numpy()
        keep = ids >= 0
        skipped += (-1 - ids[~keep]).tolist()
        x, p = (t.numpy()[keep] for t in step(images))
        truth = rows.numpy()[keep]
        local += tally(p, truth, threshold)
        at, c = np.nonzero(truth > 0)
        cls.append(c.astype(np.int32))
        positive.append(x[at, c])
        logits.append(x)
        images_seen += len(x)
        z = x.astype(np.float64)  # a NaN score makes its image's loss NaN, as the training loss would be
        loss_sum += float((np.maximum(z, 0) - z * truth + np.log1p(np.exp(-np.abs(z)))).mean(axis=1).sum())
    scores = np.concatenate(logits)
    total = ctx.allreduce_sum(np.array([images_seen, loss_sum, len(skipped)], np.float64), name=f"{name}.sums")
    if total[2] > 0:  # every rank sees the same sum: all take part in the gather or none
        skipped = sorted(i for part in ctx.allgather_object(skipped, name=f"{name}.skipped") for i in part)

    def reduce_sum(tag):
        return lambda array: ctx.allreduce_sum(np.asarray(array, np.float64), name=f"{name}.{tag}")

    found = summed_counts(local, reduce_sum("counts"))
    gather = lambda obj: ctx.allgather_object(obj, name=f"{name}.positives")  # noqa: E731
    cls = np.concatenate(cls) if cls else np.zeros(0, np.int32)
    positive = np.concatenate(positive) if positive else np.zeros(0, np.float32)
    ap = ranked(scores, cls, positive, gather, reduce_sum("ranked"))
    return MultiLabelResult(
        int(round(total[0])), float(total[1]), found, ap, threshold, tuple(skipped), time.perf_counter() - started
    )


def scores(result: MultiLabelResult, classes: list[str]) -> dict:
    """The held-out scores of ``result`` as JSON: counts and ratios per class (named by ``classes``), micro
    precision, recall and F1 at the threshold, mAP and the loss; None where a ratio has no denominator."""

    def number(x) -> float | None:
        return None if np.isnan(x) else float(x)

    c = result.counts
    precision, recall, f1 = c.precision(), c.recall(), c.f1()
    per_class = {
        name: {
            "positives": int(c.positives[i]),
            "tp": int(c.tp[i]),
            "fp": int(c.fp[i]),
            "fn": int(c.fn[i]),
            "precision": number(precision[i]),
            "recall": number(recall[i]),
            "f1": number(f1[i]),
            "ap": number(result.ap[i]),
        }
        for i, name in enumerate(classes)
    }
    tp, fp, fn = int(c.tp.sum()), int(c.fp.sum()), int(c.fn.sum())
    return {
        "threshold": result.threshold,
        "images": result.count,
        "loss": number(result.loss),
        "map": number(result.map),
        "f1": number(result.f1),
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / (tp + fn) if tp + fn else None,
        "per_class": per_class,
        "seconds": round(result.seconds, 3),
    }


def multi_label_summary(result: MultiLabelResult, classes: list[str]) -> dict:
    """``summary.json``'s held-out fields of a multi-label run: ``scores`` as ``val_*``, and the task."""
    found = scores(result, classes)
    return {"task": "multi_label", "threshold": found.pop("threshold"), **{f"val_{k}": v for k, v in found.items()}}
