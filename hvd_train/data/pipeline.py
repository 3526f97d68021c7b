"""The tf.data input pipeline: shard, read, decode, augment, preprocess, batch.

Sharding is by index, per epoch:

1. every rank draws the same permutation of the N training images from
   ``(seed, epoch)``;
2. the permutation is extended by wrapping around to ``steps * batch * size``
   indices, with ``steps >= N / (batch * size)``, so every image is seen at
   least once an epoch;
3. rank ``r`` takes every ``size``-th index starting at ``r``.

Every rank therefore runs exactly ``steps`` full batches per epoch: Horovod
allreduces once per step, and a rank with fewer steps would leave the others
waiting forever. Augmentation draws from stateless random ops seeded by
``(seed, epoch, image index)``, so a resumed run sees the same images the
same way as an uninterrupted one.

Evaluation shards without padding (rank ``r`` takes images ``r, r+size, …``)
and keeps the last partial batch: each held-out image is scored exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

from hvd_train.data.images import decode

Preprocess = Callable[[tf.Tensor], tf.Tensor]


@dataclass(frozen=True)
class TrainShard:
    """The training input of one rank.

    Attributes:
        dataset: batches of ``(images, labels)`` for epochs ``initial_epoch`` ... ``epochs - 1``.
        steps_per_epoch: batches per epoch, the same on every rank.
    """

    dataset: tf.data.Dataset
    steps_per_epoch: int


def train_dataset(
    paths: list[str],
    labels: list[int],
    *,
    rank: int,
    size: int,
    batch_size: int,
    image_size: int,
    augment: str,
    preprocess: Preprocess,
    seed: int,
    initial_epoch: int,
    epochs: int,
    steps: int,
    threads: int = 0,
) -> TrainShard:
    """Builds rank ``rank``'s training batches (see the module docstring).

    Args:
        steps: batches per epoch; ``steps * batch_size * size`` must be at
            least ``len(paths)`` (``config.make_plan`` computes it).
    """
    n = len(paths)
    padded = steps * batch_size * size
    paths_t = tf.constant(paths)
    labels_t = tf.constant(labels, dtype=tf.int32)
    flips = "flip" in augment
    crops = "crop" in augment

    def epoch_indices(epoch):
        perm = tf.random.experimental.stateless_shuffle(
            tf.range(n, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), epoch])
        )
        # Horovod: pad by wrapping around so every rank gets `steps` full batches.
        perm = tf.tile(perm, [math.ceil(padded / n)])[:padded]
        mine = perm[rank::size]
        return tf.data.Dataset.from_tensor_slices(mine).map(lambda i: (i, epoch))

    def load(index, epoch):
        image = decode(tf.io.read_file(paths_t[index]))
        key = tf.random.experimental.stateless_fold_in(tf.constant([seed, 0], tf.int64), epoch * n + index)
        crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        if crops:
            image = _random_crop(image, image_size, crop_key)
        else:
            image = _center_crop(image, image_size, 1.0)
        if flips:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        return preprocess(image), labels_t[index]

    ds = tf.data.Dataset.range(initial_epoch, epochs).flat_map(epoch_indices)
    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return TrainShard(_with_threads(ds, threads), steps)


def eval_dataset(
    paths: list[str],
    labels: list[int],
    *,
    rank: int,
    size: int,
    batch_size: int,
    image_size: int,
    crop_fraction: float,
    preprocess: Preprocess,
    threads: int = 0,
) -> tf.data.Dataset:
    """Builds rank ``rank``'s share of held-out images: no padding, no drops.

    Batches are ``(images, labels)``; the last batch may be smaller.
    """
    mine_paths = paths[rank::size]
    mine_labels = labels[rank::size]

    def load(path, label):
        image = _center_crop(decode(tf.io.read_file(path)), image_size, crop_fraction)
        return preprocess(image), label

    ds = tf.data.Dataset.from_tensor_slices(
        (tf.constant(mine_paths, dtype=tf.string), tf.constant(mine_labels, dtype=tf.int32))
    )
    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)
    return _with_threads(ds, threads)


def predict_dataset(
    paths: list[str], *, batch_size: int, image_size: int, crop_fraction: float, preprocess: Preprocess
) -> tf.data.Dataset:
    """Batches of preprocessed images in ``paths`` order, for prediction."""
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(paths, dtype=tf.string))
    ds = ds.map(
        lambda p: preprocess(_center_crop(decode(tf.io.read_file(p)), image_size, crop_fraction)),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _random_crop(image: tf.Tensor, image_size: int, key: tf.Tensor) -> tf.Tensor:
    """Random crop of 25-100% of the area, aspect 3/4-4/3, resized to the input size."""
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.zeros([1, 0, 4]),
        seed=key,
        min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.25, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, crop_size)
    return _resize(image, image_size)


def _center_crop(image: tf.Tensor, image_size: int, fraction: float) -> tf.Tensor:
    """The central square of side ``fraction * min(h, w)``, resized to the input size."""
    shape = tf.shape(image)
    h, w = shape[0], shape[1]
    side = tf.maximum(1, tf.cast(fraction * tf.cast(tf.minimum(h, w), tf.float32), tf.int32))
    top = (h - side) // 2
    left = (w - side) // 2
    image = tf.slice(image, tf.stack([top, left, 0]), tf.stack([side, side, 3]))
    return _resize(image, image_size)


def _resize(image: tf.Tensor, image_size: int) -> tf.Tensor:
    image = tf.image.resize(image, [image_size, image_size])  # bilinear, as Keras preprocessing
    image.set_shape([image_size, image_size, 3])
    return image  # float32 in [0, 255], what keras.applications preprocess_input expects


def _with_threads(ds: tf.data.Dataset, threads: int) -> tf.data.Dataset:
    options = tf.data.Options()
    if threads:
        options.threading.private_threadpool_size = threads
    return ds.with_options(options)
