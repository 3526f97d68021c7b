"""Mixup and CutMix inside the compiled step, and the training loss that takes their targets.

``--mixup ALPHA`` blends each training image with another of its batch,
``lam x image + (1 - lam) x other``, with ``lam`` drawn from Beta(alpha,
alpha) (Zhang et al., 2018). ``--cutmix ALPHA`` pastes a box of the other
image instead, of ``1 - lam`` of the area, and ``lam`` becomes the share of
the image left (Yun et al., 2019). The targets are mixed like the pixels:
``lam`` on the image's label, ``1 - lam`` on the other's. With both, each step
does one or the other, evenly (timm's ``Mixup``). The other image is the one
at the mirrored place of the batch (the batch reversed), as in timm.

The mixing runs in the step, on the preprocessed batch, so the input
pipeline, its order and its resumes stay as they are. Its random numbers are
drawn from ``(seed, rank, images seen before the step)``: a resumed run mixes
the same images the same way. An image that could not be decoded (a black
stand-in that weighs nothing) is never mixed into another: the image paired
with it stays whole.
"""

from __future__ import annotations

from typing import NamedTuple

from hvd_train.compat import keras, tf


class Mixed(NamedTuple):
    """A mixed batch's targets as two labels and a share a row: ``share`` on ``first``, the rest on ``second``
    (the data-parallel step makes them rows of class shares, ``Mixer.targets``; the sharded head takes them so,
    with no row of every class)."""

    first: tf.Tensor
    second: tf.Tensor
    share: tf.Tensor


class Mixer:
    """Mixes a batch: ``mix(images, labels, weights, key)`` gives images, their targets (``Mixed``), weights and
    labels.

    Args:
        mixup: Beta's alpha for mixup (0: never).
        cutmix: Beta's alpha for CutMix (0: never).
        classes: the number of classes (the targets' width).
    """

    def __init__(self, mixup: float, cutmix: float, classes: int):
        if not (mixup or cutmix):
            raise ValueError("a Mixer needs mixup or cutmix > 0")
        self.mixup = float(mixup)
        self.cutmix = float(cutmix)
        self.classes = int(classes)

    def mix(self, images, labels, weights, key):
        """Mixes each image with the batch's mirrored one.

        Args:
            images: the preprocessed batch, ``[batch, height, width, channels]``.
            labels: their classes, ``[batch]``.
            weights: their weights, ``[batch]`` (0: a stand-in for an undecodable image).
            key: a stateless seed, ``int64[2]``.

        Returns:
            ``(images, mixed, weights, labels)``: the mixed images, their
            targets (``Mixed``: each row's two labels and the first's share), their weights
            (mixed like the targets; 0 where the image itself weighs 0), and
            the label of the larger share of each (for the training accuracy).
        """
        choice_key, lam_key, box_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
        other_images = tf.reverse(images, [0])
        other_labels = tf.reverse(labels, [0])
        other_weights = tf.reverse(weights, [0])
        # A stand-in (no weight) is not mixed into the image it is paired with.
        mixable = other_weights > 0
        if self.mixup and self.cutmix:
            # One or the other, computed alone.
            mixed, lam = tf.cond(
                tf.random.stateless_uniform([], choice_key) < 0.5,
                lambda: self._cutmix(images, other_images, lam_key, box_key),
                lambda: self._mixup(images, other_images, lam_key),
            )
        elif self.cutmix:
            mixed, lam = self._cutmix(images, other_images, lam_key, box_key)
        else:
            mixed, lam = self._mixup(images, other_images, lam_key)
        lam = tf.where(mixable, lam, tf.ones_like(lam))  # [batch]
        images = tf.where(tf.reshape(mixable, [-1] + [1] * (images.shape.rank - 1)), mixed, images)
        mixed_targets = Mixed(tf.cast(labels, tf.int32), tf.cast(other_labels, tf.int32), lam)
        weights = tf.where(weights > 0, lam * weights + (1.0 - lam) * other_weights, tf.zeros_like(weights))
        labels = tf.where(lam >= 0.5, labels, other_labels)
        return images, mixed_targets, weights, labels

    def targets(self, mixed: Mixed):
        """``mixed`` as rows of class shares, ``[batch, classes]``, each summing to 1."""
        one_hot = tf.one_hot(mixed.first, self.classes, dtype=tf.float32)
        other_hot = tf.one_hot(mixed.second, self.classes, dtype=tf.float32)
        return mixed.share[:, None] * one_hot + (1.0 - mixed.share[:, None]) * other_hot

    def _beta(self, alpha: float, key):
        """A draw of Beta(alpha, alpha), as a ratio of two Gamma(alpha) draws."""
        first, second = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        a = tf.random.stateless_gamma([], first, alpha)
        b = tf.random.stateless_gamma([], second, alpha)
        total = a + b
        # Both draws can underflow to 0 with a small alpha: no mixing then.
        return tf.where(total > 0, a / tf.maximum(total, 1e-30), 1.0)

    def _mixup(self, images, others, key):
        lam = self._beta(self.mixup, key)
        mixed = tf.cast(lam, images.dtype) * images + tf.cast(1.0 - lam, images.dtype) * others
        return mixed, tf.fill(tf.shape(images)[:1], lam)

    def _cutmix(self, images, others, lam_key, box_key):
        """A box of ``1 - lam`` of the area at a uniform centre, clipped; ``lam``: the share left."""
        lam = self._beta(self.cutmix, lam_key)
        shape = tf.shape(images)
        height, width = shape[1], shape[2]
        ratio = tf.sqrt(1.0 - lam)
        box_h = tf.cast(tf.round(ratio * tf.cast(height, tf.float32)), tf.int32)
        box_w = tf.cast(tf.round(ratio * tf.cast(width, tf.float32)), tf.int32)
        centre = tf.random.stateless_uniform([2], box_key)
        cy = tf.cast(centre[0] * tf.cast(height, tf.float32), tf.int32)
        cx = tf.cast(centre[1] * tf.cast(width, tf.float32), tf.int32)
        top, bottom = tf.maximum(cy - box_h // 2, 0), tf.minimum(cy + box_h - box_h // 2, height)
        left, right = tf.maximum(cx - box_w // 2, 0), tf.minimum(cx + box_w - box_w // 2, width)
        rows = tf.range(height)
        cols = tf.range(width)
        inside = ((rows >= top) & (rows < bottom))[:, None] & ((cols >= left) & (cols < right))[None, :]
        mixed = tf.where(inside[None, :, :, None], others, images)
        area = tf.cast((bottom - top) * (right - left), tf.float32)
        left_share = 1.0 - area / tf.cast(height * width, tf.float32)
        return mixed, tf.fill(shape[:1], left_share)


def training_loss(smoothing: float, classes: int, soft_targets: bool = False) -> keras.losses.Loss:
    """Cross-entropy of the training step.

    Args:
        smoothing: label smoothing (0: none).
        classes: the number of classes.
        soft_targets: the targets are rows of class shares (mixup, CutMix),
            not class indices.
    """
    if soft_targets:
        return keras.losses.CategoricalCrossentropy(label_smoothing=smoothing)
    if not smoothing:
        return keras.losses.SparseCategoricalCrossentropy()
    return SmoothedCrossentropy(smoothing, classes)


class SmoothedCrossentropy(keras.losses.Loss):
    """Cross-entropy against ``1 - s`` on the label and ``s / classes`` on every class (``--label-smoothing``)."""

    def __init__(self, smoothing: float, classes: int, name: str = "smoothed_crossentropy"):
        super().__init__(name=name)
        self.smoothing = smoothing
        self.classes = classes

    def call(self, y_true, y_pred):
        onehot = tf.one_hot(tf.cast(tf.reshape(y_true, [-1]), tf.int32), self.classes, dtype=tf.float32)
        probs = tf.cast(y_pred, tf.float32)
        return keras.losses.categorical_crossentropy(onehot, probs, label_smoothing=self.smoothing)

    def get_config(self) -> dict:
        return {**super().get_config(), "smoothing": self.smoothing, "classes": self.classes}
