"""Exact evaluation: every held-out image counted once, across all ranks.

Each rank scores its own share of the images (see ``data.pipeline.eval_dataset``:
no padding, no sampling) and keeps sums: images, loss, top-1 and top-k hits,
and each image's true and predicted class. One allreduce adds the sums of
all ranks, and one allgather joins the confusion's non-zero cells
(``confusion.Confusion``: no classes x classes matrix, which would be 80 GB
at 100,000 classes). There is no collective inside the loop, so ranks with
one batch more than others do not wait for each other.

Scores come from the head's logits, in float32, the same way in either
layout of the head (``score_logits`` here, ``sharded_head.head_scores`` for
the head sharded by class): the cross-entropy from the logits; the best class
and the top k by ``top_k``, where of classes with equal logits the lower
class comes first (probabilities would tie at 0 for every class a sure
model rules out, and a tie would put every class in the top k); and an
image whose logits are not all finite (a diverged model) is a miss, with no
predicted class.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from hvd_train.compat import keras, tf
from hvd_train.distributed.context import Context
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.results.confusion import Confusion

TOP_K = 5


@dataclass(frozen=True)
class EvalResult:
    """Sums over every held-out image of every rank.

    Attributes:
        count: images scored.
        loss_sum: summed cross-entropy.
        top1: images whose top class is right.
        topk: images whose right class is among the ``k`` most probable.
        k: the ``k`` of ``topk``: 5, or the number of classes when fewer.
        confusion: image counts by true and predicted class.
        skipped: indices (into the held-out images) of images that could not
            be decoded and were not scored.
        seconds: how long this rank took to score its share.
    """

    count: int
    loss_sum: float
    top1: int
    topk: int
    k: int
    confusion: Confusion
    skipped: tuple[int, ...] = ()
    seconds: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.count)

    @property
    def accuracy(self) -> float:
        return self.top1 / max(1, self.count)

    @property
    def top5(self) -> float:
        return self.topk / max(1, self.count)

    def per_class_accuracy(self) -> list[float | None]:
        """Accuracy of each true class; None for a class with no images."""
        totals, right = self.confusion.totals(), self.confusion.right()
        return [float(r / t) if t else None for r, t in zip(right, totals)]


def score_logits(logits, labels, k: int):
    """Per row: the cross-entropy, the best class (-1 where a logit is not finite) and whether the label is in
    the top ``k`` (never where a logit is not finite); of equal logits, the lower class comes first."""
    logits = tf.cast(logits, tf.float32)
    labels = tf.cast(labels, tf.int32)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    finite = tf.reduce_all(tf.math.is_finite(logits), axis=1)
    top = tf.math.top_k(logits, k).indices
    best = tf.where(finite, top[:, 0], -1)
    hits = tf.reduce_any(tf.equal(top, labels[:, None]), axis=1) & finite
    return loss, best, hits


def _make_step(model, k: int):
    head = model.get_layer(HEAD_LAYER)
    features = keras.Model(model.inputs, head.input)

    @tf.function(reduce_retracing=True, autograph=False)  # no control flow: nothing to convert
    def step(images, labels):
        """Per image: the loss, the best class and whether the label is in the top ``k`` (``score_logits``)."""
        rows = tf.cast(features(images, training=False), tf.float32)
        logits = tf.matmul(rows, tf.cast(head.kernel, tf.float32)) + tf.cast(head.bias, tf.float32)
        labels = tf.maximum(tf.cast(labels, tf.int32), 0)  # a stand-in's (negative) label: not scored
        return score_logits(logits, labels, k)

    return step


class _Tally:
    """One rank's sums over its held-out batches; a negative label marks a stand-in for an image that could not
    be decoded: counted as skipped, not scored."""

    def __init__(self):
        self.count, self.loss_sum, self.top1, self.topk = 0, 0.0, 0, 0
        self.skipped: list[int] = []
        self.true: list[np.ndarray] = []
        self.predicted: list[np.ndarray] = []
        self.started = time.perf_counter()

    def add(self, labels, loss, best, hits) -> None:
        labels, best = labels.numpy(), best.numpy()
        scored = labels >= 0
        self.skipped.extend((-1 - labels[~scored]).tolist())
        self.count += int(scored.sum())
        self.loss_sum += float(loss.numpy()[scored].astype(np.float64).sum())
        self.top1 += int((best == labels)[scored].sum())
        self.topk += int(hits.numpy()[scored].sum())
        self.true.append(labels[scored])
        self.predicted.append(best[scored])

    def total(self, ctx: Context, name: str, num_classes: int, k: int) -> EvalResult:
        """These sums added over every rank, with the skipped images and the confusion gathered."""
        skipped = self.skipped
        local = np.array([self.count, self.loss_sum, self.top1, self.topk, len(skipped)], np.float64)
        # Horovod: one sum over ranks; float64 holds exact counts up to 2**53.
        total = ctx.allreduce_sum(local, name=name)
        if total[4] > 0:  # every rank sees the same sum, so all take part in the gather or none
            skipped = sorted(i for part in ctx.allgather_object(skipped, name=f"{name}.skipped") for i in part)
        mine = Confusion(num_classes, np.concatenate([[], *self.true]), np.concatenate([[], *self.predicted]))
        confusion = Confusion(num_classes)
        for part in ctx.allgather_object((mine.true, mine.predicted, mine.counts), name=f"{name}.confusion"):
            confusion += Confusion(num_classes, *part)
        return EvalResult(
            count=int(round(total[0])),
            loss_sum=float(total[1]),
            top1=int(round(total[2])),
            topk=int(round(total[3])),
            k=k,
            confusion=confusion,
            skipped=tuple(skipped),
            seconds=time.perf_counter() - self.started,
        )


def evaluate(model, dataset: tf.data.Dataset, num_classes: int, ctx: Context, name: str = "eval") -> EvalResult:
    """Scores this rank's share of held-out images and sums over all ranks.

    Every rank must call this (it ends in one allreduce).

    Args:
        model: a Keras model whose head (``catalogue.HEAD_LAYER``) is a softmax Dense layer.
        dataset: this rank's ``(images, labels)`` batches.
        num_classes: number of classes.
        ctx: the job.
        name: a name for the allreduce, unique per call site.

    Returns:
        The sums of all ranks.
    """
    k = min(TOP_K, num_classes)
    cache = model.__dict__.setdefault("_hvd_train_eval_steps", {})
    step = cache.get(k)
    if step is None:
        step = cache[k] = _make_step(model, k)
        # Traced once for batches of any size: the last, smaller batch would trace it again.
        step.get_concrete_function(*dataset.element_spec)
    tally = _Tally()
    for images, labels in dataset:
        tally.add(labels, *step(images, labels))
    return tally.total(ctx, name, num_classes, k)


def evaluate_sharded(net, dataset: tf.data.Dataset, num_classes: int, ctx: Context, name: str = "eval") -> EvalResult:
    """``evaluate`` for a head sharded by class (``ShardedNet``): the same sums, each batch scored by its group.

    The ranks of a group score their batches together (``head_scores``), so
    before each batch they agree whether any of them has one left; a rank
    whose share is done joins with an empty batch. The step is traced once
    for batches of any size: a rank that traced it again alone, for a
    shorter batch, hung its group in Horovod.
    """
    k = min(TOP_K, num_classes)
    specs = dataset.element_spec
    step = tf.function(lambda images, labels: net.score_batch(images, labels, k), autograph=False)
    step.get_concrete_function(*specs)
    empty = tuple(tf.zeros([0, *s.shape[1:]], s.dtype) for s in specs)
    tally = _Tally()
    batches = iter(dataset)
    for i in itertools.count():
        batch = next(batches, None)
        left = net.head.group_sum(tf.constant(batch is not None, tf.int32), f"{name}.left.{i}")
        if not int(left):
            break
        images, labels = batch if batch is not None else empty
        tally.add(labels, *step(images, labels))
    return tally.total(ctx, name, num_classes, k)
