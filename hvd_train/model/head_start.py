"""The classification head's starting values, the same whatever the layout.

The kernel is Glorot-uniform over the whole head (Keras's Dense default)
and the bias zero, as a Dense layer starts. The kernel is drawn in blocks
of ``HEAD_BLOCK`` classes, each from its own key ``(seed, block)``, so a
rank that holds a shard of the head (``--head-parallel``) draws exactly
its columns of the head an unsharded run starts from: runs of every layout
start alike, and a sharded run can be checked against a data-parallel one.
"""

from __future__ import annotations

import math

import numpy as np

from hvd_train.compat import tf

# The head is drawn in blocks of this many classes, each from its own key: any shard takes its columns.
HEAD_BLOCK = 1024


def _blocks(features: int, classes: int, first: int, count: int, seed: int):
    """``(column in the shard, values)`` of each block's part in classes ``first .. first + count``."""
    limit = math.sqrt(6.0 / (features + classes))
    for block in range(first // HEAD_BLOCK, (first + count - 1) // HEAD_BLOCK + 1):
        start, end = max(first, block * HEAD_BLOCK), min(first + count, (block + 1) * HEAD_BLOCK)
        key = tf.constant([seed, block], tf.int64)
        values = tf.random.stateless_uniform([features, HEAD_BLOCK], key, -limit, limit)
        yield start - first, values[:, start - block * HEAD_BLOCK : end - block * HEAD_BLOCK]


def initial_columns(features: int, classes: int, first: int, count: int, seed: int) -> np.ndarray:
    """Columns ``first ..`` of the whole head's starting kernel, ``features`` x ``count``."""
    return np.concatenate([v.numpy() for _, v in _blocks(features, classes, first, count, seed)], axis=1)


def start_head(kernel: tf.Variable, bias: tf.Variable, first: int, classes: int, seed: int) -> None:
    """Sets ``kernel`` and ``bias``, classes ``first ..`` of a head of ``classes``, to their starting values
    (a block at a time: a large head is never drawn twice in memory)."""
    features, count = (int(d) for d in kernel.shape)
    for column, values in _blocks(features, classes, first, count, seed):
        kernel[:, column : column + int(values.shape[1])].assign(values)
    bias.assign(tf.zeros_like(bias))
