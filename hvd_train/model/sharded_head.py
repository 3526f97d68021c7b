"""The classification head sharded by class over a group of ranks (``--head-parallel G``).

Hybrid parallelism, as in Krizhevsky's "one weird trick" and Yadan et al.:
the backbone (much compute, few parameters) stays data-parallel, and the
head (a Dense softmax layer: few FLOPs, C x F parameters) is split. Rank
``j`` of a group holds classes ``[first, first + count)`` (``groups.shard_range``)
of the kernel and bias. One step of the head, on every rank of a group:

1. the group allgathers its features, labels and weights (``G B`` rows;
   a mixed batch's second labels with the labels, its shares with the weights);
2. each rank computes the logits of its classes for all ``G B`` rows;
3. the softmax cross-entropy is made exact across shards from one more
   allgather of five numbers a row and shard (six for a mixed batch): the shard's largest logit,
   its sum of ``exp(logit - largest)``, the label's logit (0 where the
   label is another shard's), the sum of the logits (label smoothing), and
   the shard's best class; under ``--mixup``/``--cutmix`` (two labels and
   the first's share a row, gathered with the rows), the second label's
   logit too. ``log sum exp``
   over all classes is then ``m + log sum_j s_j exp(m_j - m)`` with
   ``m = max_j m_j``, and the soft target's cross-entropy is that less the
   targets' shares of the two labels' logits;
4. the gradient of the logits is ``(softmax - target) w / B`` for a row of
   weight ``w`` from a rank of batch ``B``: each rank's loss is the mean of
   its own rows, as in the data-parallel step;
5. the gradients of the features are partial sums over the shards, summed
   and handed back to the rows' ranks by one reduce-scatter;
6. the head's gradients cover the group's rows: divided by G, and averaged
   over the shard's peers in the other groups (``peers_average``, once an
   update: after the passes ``--grad-accum`` adds up), they are exactly
   the data-parallel average over all ranks.

The backbone's gradients then come from its own tape with the features'
gradients as output gradients, and are averaged over all ranks as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvd_train.compat import tf
from hvd_train.distributed.groups import HeadGroups


@dataclass
class HeadStep:
    """What one step of the sharded head gives a rank.

    Attributes:
        loss: the group's loss (the mean of its ranks' losses), as every rank of the group sees it.
        d_features: the gradient of this rank's own features ([B, F], float32).
        d_kernel, d_bias: the gradients of this rank's shard from its group's rows (``peers_average``
            makes them the average over all ranks).
        predicted: the best class of each of this rank's rows, over all classes.
    """

    loss: tf.Tensor
    d_features: tf.Tensor
    d_kernel: tf.Tensor
    d_bias: tf.Tensor
    predicted: tf.Tensor


def head_step(
    features: tf.Tensor,
    labels: tf.Tensor,
    weights: tf.Tensor,
    kernel: tf.Tensor,
    bias: tf.Tensor,
    *,
    first: int,
    classes: int,
    groups: HeadGroups,
    smoothing: float = 0.0,
    mixed: tuple | None = None,
) -> HeadStep:
    """Loss and gradients of the softmax head sharded over ``groups.group``, for this rank's batch.

    Args:
        features: this rank's features [B, F] (any float type; the head computes in float32).
        labels: class indices [B] over all classes.
        weights: per-row weights [B] (0 for a stand-in image).
        kernel, bias: this rank's shard: [F, count] and [count], classes ``first ..``.
        classes: all classes of the head.
        smoothing: label smoothing (Keras's: ``1 - s`` on the label, ``s / classes`` on every class).
        mixed: ``(second, share)`` of a mixed batch (``mixing.Mixer``): each row's second label [B] and the
            share of its first, ``labels`` [B]; its target ``share`` on the first, ``1 - share`` on the second
            (then smoothed), as the data-parallel step's soft targets.
    """
    parallel = groups.parallel
    batch = tf.shape(features)[0]
    count = tf.shape(kernel)[1]
    second = None if mixed is None else mixed[0]
    rows, logits, local, mine, all_second = _group_logits(
        features, labels, kernel, bias, first, groups, "head_step", second
    )
    if mixed is None:
        all_weights = groups.gather(tf.cast(weights, tf.float32), "head_step.weights")
        share = tf.ones_like(all_weights)  # the first label's share of each row's target
    else:  # the shares gathered with the weights: one exchange
        paired = tf.stack([tf.cast(weights, tf.float32), tf.cast(mixed[1], tf.float32)], axis=1)
        all_weights, share = tf.unstack(groups.gather(paired, "head_step.weights_shares"), axis=1)
    largest = tf.reduce_max(logits, axis=1)
    summed = tf.reduce_sum(tf.exp(logits - largest[:, None]), axis=1)
    label_logit = tf.where(mine, tf.gather(logits, local, batch_dims=1), 0.0)
    best = tf.cast(tf.argmax(logits, axis=1, output_type=tf.int32) + first, tf.float64)
    columns = [largest, summed, label_logit, tf.reduce_sum(logits, axis=1)]
    if mixed is not None:
        local_b, mine_b = _in_shard(all_second, first, count)
        columns.append(tf.where(mine_b, tf.gather(logits, local_b, batch_dims=1), 0.0))
    stats = tf.stack([tf.cast(v, tf.float64) for v in columns] + [best], axis=1)
    every = tf.reshape(groups.gather(stats, "head_step.stats"), [parallel, -1, len(columns) + 1])
    top = tf.reduce_max(every[..., 0], axis=0)
    normalizer = top + tf.math.log(tf.reduce_sum(every[..., 1] * tf.exp(every[..., 0] - top), axis=0))
    labelled = tf.reduce_sum(every[..., 2], axis=0)
    if mixed is not None:  # the shares of the two labels' logits
        share_d = tf.cast(share, tf.float64)
        labelled = share_d * labelled + (1.0 - share_d) * tf.reduce_sum(every[..., 4], axis=0)
    row_loss = normalizer - (1.0 - smoothing) * labelled
    if smoothing:
        row_loss -= smoothing / classes * tf.reduce_sum(every[..., 3], axis=0)
    winner = tf.argmax(every[..., 0], axis=0, output_type=tf.int32)
    predicted = tf.cast(tf.gather(tf.transpose(every[..., -1]), winner, batch_dims=1), tf.int32)

    batch_f = tf.cast(batch, tf.float32)
    probs = tf.exp(logits - tf.cast(normalizer, tf.float32)[:, None])
    hot = tf.one_hot(local, count) * (share * tf.cast(mine, tf.float32))[:, None]
    if mixed is not None:
        hot += tf.one_hot(local_b, count) * ((1.0 - share) * tf.cast(mine_b, tf.float32))[:, None]
    target = (1.0 - smoothing) * hot + smoothing / classes
    d_logits = (probs - target) * (all_weights / batch_f)[:, None]
    d_kernel = tf.matmul(rows, d_logits, transpose_a=True) / parallel
    d_bias = tf.reduce_sum(d_logits, axis=0) / parallel
    d_rows = tf.matmul(d_logits, kernel, transpose_b=True)
    d_features = groups.scatter_sum(d_rows, "head_step.d_features")

    loss = tf.reduce_sum(tf.cast(row_loss, tf.float32) * all_weights) / (batch_f * parallel)
    own = tf.range(batch) + groups.shard * batch  # training batches are the same size on every rank
    return HeadStep(loss, d_features, d_kernel, d_bias, tf.gather(predicted, own))


def peers_average(grads: list, groups: HeadGroups) -> list:
    """The shard's gradients from ``head_step``, averaged over the ranks that hold the same shard in the
    other groups: the data-parallel average over all ranks (unchanged with one group)."""
    return groups.peers_average(grads, "head.peers")


def _group_logits(features, labels, kernel, bias, first: int, groups: HeadGroups, name: str, second=None):
    """The group's rows (float32), the logits of this rank's classes for them, where each row's label falls in
    this shard (``local``, valid where ``mine``), and the group's ``second`` labels of a mixed batch (gathered
    with the labels: one exchange), else None."""
    rows = tf.cast(groups.gather(features, f"{name}.features"), tf.float32)
    all_second = None
    if second is None:
        all_labels = groups.gather(tf.cast(labels, tf.int32), f"{name}.labels")
    else:
        pairs = tf.stack([tf.cast(labels, tf.int32), tf.cast(second, tf.int32)], axis=1)
        all_labels, all_second = tf.unstack(groups.gather(pairs, f"{name}.label_pairs"), axis=1)
    logits = tf.matmul(rows, kernel) + bias
    local, mine = _in_shard(all_labels, first, tf.shape(kernel)[1])
    return rows, logits, local, mine, all_second


def _in_shard(labels, first: int, count):
    """Where each of ``labels`` falls among this shard's ``count`` classes from ``first`` (0 where it does not),
    and whether it does."""
    local = labels - first
    mine = (local >= 0) & (local < count)
    return tf.where(mine, local, 0), mine


def head_scores(features, labels, kernel, bias, *, first: int, groups: HeadGroups, k: int = 5):
    """Exact held-out scores of this rank's rows over all classes: ``(loss, top-1 class, label in top k)``.

    The cross-entropy comes from each shard's largest logit, sum of
    exponentials and label logit, as in training; the top ``k`` from each
    shard's own top ``k`` (value and class), merged: of equal logits the
    lower class comes first, as ``evaluation.score_logits`` has it for the
    whole head. A row whose logits are not all finite on some shard has no
    best class (-1) and no hit. A row whose label is
    negative (a stand-in) gets a meaningless loss and no hit: the caller
    leaves it out. Every rank of the group must call this as often, with
    batches of any size (none at all included).
    """
    parallel = groups.parallel
    batch = tf.shape(features)[0]
    _, logits, local, mine, _ = _group_logits(features, labels, kernel, bias, first, groups, "head_scores")
    largest = tf.reduce_max(logits, axis=1)
    stats = tf.stack(
        [
            largest,
            tf.reduce_sum(tf.exp(logits - largest[:, None]), axis=1),
            tf.where(mine, tf.gather(logits, local, batch_dims=1), 0.0),
            tf.cast(tf.reduce_all(tf.math.is_finite(logits), axis=1), logits.dtype),
        ],
        axis=1,
    )
    every = tf.reshape(groups.gather(tf.cast(stats, tf.float64), "head_scores.stats"), [parallel, -1, 4])
    top = tf.reduce_max(every[..., 0], axis=0)
    normalizer = top + tf.math.log(tf.reduce_sum(every[..., 1] * tf.exp(every[..., 0] - top), axis=0))
    loss = normalizer - tf.reduce_sum(every[..., 2], axis=0)

    # Each shard's best k (fewer classes than k: padded with -inf), then the best k of those.
    shard_k = tf.minimum(k, tf.shape(logits)[1])
    values, indices = tf.math.top_k(logits, shard_k)
    pad = [[0, 0], [0, k - shard_k]]
    values = tf.pad(values, pad, constant_values=float("-inf"))
    indices = tf.pad(indices + first, pad, constant_values=-1)
    values = tf.reshape(groups.gather(values, "head_scores.values"), [parallel, -1, k])
    indices = tf.reshape(groups.gather(indices, "head_scores.indices"), [parallel, -1, k])
    values = tf.reshape(tf.transpose(values, [1, 0, 2]), [-1, parallel * k])
    indices = tf.reshape(tf.transpose(indices, [1, 0, 2]), [-1, parallel * k])
    _, best = tf.math.top_k(values, k)
    merged = tf.gather(indices, best, batch_dims=1)

    # A held-out batch may be shorter on some ranks (the last, or none): this rank's rows start after its
    # group's lower ranks' rows.
    sizes = groups.gather(tf.reshape(batch, [1]), "head_scores.sizes")
    own = tf.range(batch) + tf.reduce_sum(sizes[: groups.shard])
    labels = tf.cast(labels, tf.int32)
    finite = tf.gather(tf.reduce_min(every[..., 3], axis=0) > 0, own)
    top_k = tf.reduce_any(tf.equal(tf.gather(merged, own), labels[:, None]), axis=1) & finite
    return tf.gather(loss, own), tf.where(finite, tf.gather(merged[:, 0], own), -1), top_k
