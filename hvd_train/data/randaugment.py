"""RandAugment (Cubuk et al., 2020) on one decoded image, drawn from a stateless key.

``--augment randaugment`` applies, after the random crop and flip, ``ops``
operations picked uniformly (with repeats) from ``OPS``, each at the one
global ``--augment-magnitude M`` (0 to 10, as in TF Model Garden and timm;
timm's ``rand-m9`` is 9). Geometric operations and the blends pick their
direction at random; at magnitude 0 every operation but ``auto_contrast`` and
``equalize`` leaves the image as it is.

Why not a library's: Keras 3's ``RandAugment`` layer draws from a stateful
``SeedGenerator`` that a key cannot drive, and TF Model Garden's (and
timm's, for PyTorch) cannot come along with our pinned TensorFlow. Here every
draw comes from the image's key, ``(seed, epoch x images + image)``: a resumed
run augments each image exactly as the run it continues.

Images are float32 ``[height, width, 3]`` in [0, 255], what ``pipeline``
hands on to the model's preprocessing.
"""

from __future__ import annotations

import math

from hvd_train.compat import tf

MAX_MAGNITUDE = 10.0
FILL = 128.0  # what geometric operations bring in from outside the image (timm's and Model Garden's gray)

OPS = (
    "identity",
    "auto_contrast",
    "equalize",
    "rotate",
    "solarize",
    "color",
    "posterize",
    "contrast",
    "brightness",
    "sharpness",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
)


def rand_augment(image, key, magnitude: float, ops: int = 2):
    """``ops`` operations of ``OPS`` at ``magnitude``, picked and signed from ``key`` (``int64[2]``)."""
    level = float(magnitude) / MAX_MAGNITUDE
    keys = tf.random.experimental.stateless_split(key, 2 * ops)
    for n in range(ops):
        which = tf.random.stateless_uniform([], keys[2 * n], 0, len(OPS), dtype=tf.int32)
        sign = tf.where(tf.random.stateless_uniform([], keys[2 * n + 1]) < 0.5, -1.0, 1.0)
        branches = [_branch(name, image, level, sign) for name in OPS]
        image = tf.switch_case(which, branches)
    return image


def apply(name: str, image, magnitude: float, sign: float = 1.0):
    """One operation of ``OPS`` at ``magnitude`` (0 to 10); ``sign`` -1 turns a geometry or a blend the other way."""
    return _branch(name, image, float(magnitude) / MAX_MAGNITUDE, tf.constant(float(sign)))()


def _branch(name: str, image, level: float, sign):
    op = globals()[f"_{name}"]
    return lambda: tf.clip_by_value(op(image, level, sign), 0.0, 255.0)


def _identity(image, level, sign):
    return image


def _auto_contrast(image, level, sign):
    """Each channel stretched to [0, 255] (a flat channel is left)."""
    low = tf.reduce_min(image, axis=[0, 1])
    high = tf.reduce_max(image, axis=[0, 1])
    scale = tf.where(high > low, 255.0 / tf.maximum(high - low, 1e-6), 1.0)
    offset = tf.where(high > low, low, 0.0)
    return (image - offset) * scale


def _equalize(image, level, sign):
    """Each channel's histogram equalised (PIL's ``ImageOps.equalize``)."""
    channels = []
    for c in range(3):
        values = tf.cast(tf.clip_by_value(tf.round(image[:, :, c]), 0, 255), tf.int32)
        histogram = tf.math.bincount(tf.reshape(values, [-1]), minlength=256, maxlength=256)
        nonzero = tf.boolean_mask(histogram, histogram > 0)
        # PIL: the step leaves out the last level present; a channel of one or two levels stays.
        step = (tf.reduce_sum(nonzero) - nonzero[-1]) // 255
        lut = (tf.cumsum(histogram) - histogram + step // 2) // tf.maximum(step, 1)
        lut = tf.cast(tf.clip_by_value(lut, 0, 255), tf.float32)
        equalised = tf.gather(lut, values)
        channels.append(tf.where(step > 0, equalised, image[:, :, c]))
    return tf.stack(channels, axis=-1)


def _rotate(image, level, sign):
    """Up to 30 degrees about the centre."""
    angle = sign * level * 30.0 * math.pi / 180.0
    height, width = _size(image)
    cy, cx = (height - 1) / 2, (width - 1) / 2
    cos, sin = tf.cos(angle), tf.sin(angle)
    # The output pixel (x, y) comes from the input at the inverse rotation about the centre.
    return _transform(image, [cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy])


def _shear_x(image, level, sign):
    return _transform(image, [1.0, sign * level * 0.3, 0.0, 0.0, 1.0, 0.0])


def _shear_y(image, level, sign):
    return _transform(image, [1.0, 0.0, 0.0, sign * level * 0.3, 1.0, 0.0])


def _translate_x(image, level, sign):
    """Up to 45% of the width (timm's relative translation)."""
    _, width = _size(image)
    return _transform(image, [1.0, 0.0, sign * level * 0.45 * width, 0.0, 1.0, 0.0])


def _translate_y(image, level, sign):
    height, _ = _size(image)
    return _transform(image, [1.0, 0.0, 0.0, 0.0, 1.0, sign * level * 0.45 * height])


def _solarize(image, level, sign):
    """Pixels at or above the threshold inverted; the threshold falls from 256 to 0 with the magnitude."""
    threshold = 256.0 - level * 256.0
    return tf.where(image >= threshold, 255.0 - image, image)


def _posterize(image, level, sign):
    """Keeps the top ``8 - 4 x level`` bits of each value."""
    shift = 2.0 ** int(level * 4)
    return tf.floor(image / shift) * shift


def _color(image, level, sign):
    """Saturation: blended with the image's gray by ``1 +/- 0.9 x level``."""
    gray = tf.image.grayscale_to_rgb(tf.image.rgb_to_grayscale(image))
    return _blend(gray, image, 1.0 + sign * 0.9 * level)


def _contrast(image, level, sign):
    """Blended with the mean gray by ``1 +/- 0.9 x level``."""
    mean = tf.reduce_mean(tf.image.rgb_to_grayscale(image))
    return _blend(tf.fill(tf.shape(image), mean), image, 1.0 + sign * 0.9 * level)


def _brightness(image, level, sign):
    return _blend(tf.zeros_like(image), image, 1.0 + sign * 0.9 * level)


def _sharpness(image, level, sign):
    """Blended with PIL's smoothed image (a 3 x 3 kernel, the border kept) by ``1 +/- 0.9 x level``."""
    kernel = tf.constant([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
    kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
    smooth = tf.nn.depthwise_conv2d(image[None], kernel, [1, 1, 1, 1], "VALID")[0]
    smooth = tf.pad(smooth, [[1, 1], [1, 1], [0, 0]])
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    inner = tf.pad(tf.ones([height - 2, width - 2, 3]), [[1, 1], [1, 1], [0, 0]]) > 0
    return _blend(tf.where(inner, smooth, image), image, 1.0 + sign * 0.9 * level)


def _blend(degenerate, image, factor):
    return degenerate + factor * (image - degenerate)


def _size(image):
    shape = tf.shape(image)
    return tf.cast(shape[0], tf.float32), tf.cast(shape[1], tf.float32)


def _transform(image, affine):
    """``image`` with each output pixel ``(x, y)`` read at ``(a0 x + a1 y + a2, b0 x + b1 y + b2)``."""
    transform = tf.cast(tf.stack([*affine, 0.0, 0.0]), tf.float32)[None]
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None],
        transforms=transform,
        output_shape=tf.shape(image)[:2],
        fill_value=FILL,
        interpolation="BILINEAR",
        fill_mode="CONSTANT",
    )[0]
