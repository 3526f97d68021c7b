"""Exact evaluation: every held-out image counted once, across all ranks.

Each rank scores its own share of the images (see ``data.pipeline.eval_dataset``:
no padding, no sampling) and keeps sums: images, loss, top-1 and top-k hits,
and each image's true and predicted class. One allreduce adds the sums of
all ranks, and one allgather joins the confusion's non-zero cells
(``confusion.Confusion``: no classes x classes matrix, which would be 80 GB
at 100,000 classes). There is no collective inside the loop, so ranks with
one batch more than others do not wait for each other.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from hvd_train.compat import tf
from hvd_train.distributed.context import Context
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


def _make_step(model, num_classes: int, k: int):
    @tf.function(reduce_retracing=True, autograph=False)  # no control flow: nothing to convert
    def step(images, labels):
        probs = tf.cast(model(images, training=False), tf.float32)
        labels = tf.cast(labels, tf.int32)
        # A negative label marks a stand-in for an image that could not be decoded: not scored.
        scored = labels >= 0
        weight = tf.cast(scored, tf.int64)
        labels = tf.maximum(labels, 0)
        loss = tf.keras.losses.sparse_categorical_crossentropy(labels, probs)
        predicted = tf.argmax(probs, axis=1, output_type=tf.int32)
        hits_k = tf.math.in_top_k(labels, probs, k)
        return (
            tf.reduce_sum(tf.where(scored, tf.cast(loss, tf.float64), 0.0)),
            tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.int64) * weight),
            tf.reduce_sum(tf.cast(hits_k, tf.int64) * weight),
            predicted,
        )

    return step


def evaluate(model, dataset: tf.data.Dataset, num_classes: int, ctx: Context, name: str = "eval") -> EvalResult:
    """Scores this rank's share of held-out images and sums over all ranks.

    Every rank must call this (it ends in one allreduce).

    Args:
        model: a Keras model whose outputs are class probabilities.
        dataset: this rank's ``(images, labels)`` batches.
        num_classes: number of classes.
        ctx: the job.
        name: a name for the allreduce, unique per call site.

    Returns:
        The sums of all ranks.
    """
    k = min(TOP_K, num_classes)
    cache = model.__dict__.setdefault("_hvd_train_eval_steps", {})
    step = cache.get((num_classes, k))
    if step is None:
        step = cache[(num_classes, k)] = _make_step(model, num_classes, k)
        # Traced once for batches of any size: the last, smaller batch would trace it again.
        step.get_concrete_function(*dataset.element_spec)
    count, loss_sum, top1, topk = 0, 0.0, 0, 0
    skipped: list[int] = []
    true, predicted = [], []
    started = time.perf_counter()
    for images, labels in dataset:
        batch_loss, batch_top1, batch_topk, batch_predicted = step(images, labels)
        values = labels.numpy()
        stand_ins = values[values < 0]
        skipped.extend((-1 - stand_ins).tolist())
        count += int(values.size - stand_ins.size)
        loss_sum += float(batch_loss)
        top1 += int(batch_top1)
        topk += int(batch_topk)
        true.append(values[values >= 0])
        predicted.append(batch_predicted.numpy()[values >= 0])
    return _total(ctx, name, num_classes, k, (count, loss_sum, top1, topk), skipped, true, predicted, started)


def evaluate_sharded(net, dataset: tf.data.Dataset, num_classes: int, ctx: Context, name: str = "eval") -> EvalResult:
    """``evaluate`` for a head split by class (``ShardedNet``): the same sums, each batch scored by its group.

    The ranks of a group score their batches together (``head_scores``), so
    before each batch they agree whether any of them has one left; a rank
    whose share is done joins with an empty batch. The step is traced once
    for batches of any size: a rank that traced it again alone, for a
    shorter batch, hung its group in Horovod.
    """
    import horovod.tensorflow as hvd

    k = min(TOP_K, num_classes)
    specs = dataset.element_spec
    step = tf.function(lambda images, labels: net.score_batch(images, labels, k), autograph=False)
    step.get_concrete_function(*specs)
    empty = tuple(tf.zeros([0, *s.shape[1:]], s.dtype) for s in specs)
    count, loss_sum, top1, topk = 0, 0.0, 0, 0
    skipped: list[int] = []
    true, predicted = [], []
    started = time.perf_counter()
    batches = iter(dataset)
    for i in itertools.count():
        batch = next(batches, None)
        left = hvd.allreduce(
            tf.constant(batch is not None, tf.int32), op=hvd.Sum, process_set=net.head.group, name=f"{name}.left.{i}"
        )
        if not int(left):
            break
        images, labels = batch if batch is not None else empty
        loss, best, hits = step(images, labels)
        values = labels.numpy()
        scored = values >= 0
        skipped.extend((-1 - values[~scored]).tolist())
        count += int(scored.sum())
        loss_sum += float(loss.numpy()[scored].sum())
        top1 += int((best.numpy() == values)[scored].sum())
        topk += int(hits.numpy()[scored].sum())
        true.append(values[scored])
        predicted.append(best.numpy()[scored])
    return _total(ctx, name, num_classes, k, (count, loss_sum, top1, topk), skipped, true, predicted, started)


def _total(ctx, name, num_classes, k, sums, skipped, true, predicted, started) -> EvalResult:
    """This rank's sums, added over every rank, with the skipped images and the confusion gathered."""
    count, loss_sum, top1, topk = sums
    local = np.array([count, loss_sum, top1, topk, len(skipped)], np.float64)
    # Horovod: one sum over ranks; float64 holds exact counts up to 2**53.
    total = ctx.allreduce_sum(local, name=name)
    if total[4] > 0:  # every rank sees the same sum, so all take part in the gather or none
        skipped = sorted(i for part in ctx.allgather_object(skipped, name=f"{name}.skipped") for i in part)
    mine = Confusion(num_classes, np.concatenate([[], *true]), np.concatenate([[], *predicted]))
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
        seconds=time.perf_counter() - started,
    )
