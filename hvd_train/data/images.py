"""Decoding images, and finding the ones that cannot be decoded.

Training and the check use the same decoder, so an image that passes the
check cannot fail mid-epoch. That matters under Horovod: a rank whose
pipeline drops or fails on an image runs fewer steps than the others, and
the others wait for it forever.
"""

from __future__ import annotations

import tensorflow as tf

from hvd_train.errors import UserError


def decode(contents: tf.Tensor) -> tf.Tensor:
    """Decodes JPEG/PNG/GIF/BMP bytes to an RGB uint8 tensor of shape (h, w, 3).

    Grayscale, palette, RGBA, CMYK and 16-bit images come out as 8-bit RGB;
    an animated GIF gives its first frame.
    """
    image = tf.io.decode_image(contents, channels=3, expand_animations=False, dtype=tf.uint8)
    image.set_shape([None, None, 3])
    return image


def find_bad_images(paths: list[str], threads: int = 0) -> list[tuple[str, str]]:
    """Decodes every image once and returns the ones that fail, with the reason.

    Args:
        paths: image files to check.
        threads: decoding threads (0: TensorFlow's choice).

    Returns:
        ``(path, reason)`` for each unreadable image, in input order.
    """
    if not paths:
        return []

    def probe(path):
        image = decode(tf.io.read_file(path))
        return path, tf.shape(image)

    ds = tf.data.Dataset.from_tensor_slices(paths).map(probe, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.ignore_errors()
    if threads:
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        ds = ds.with_options(options)
    good = {p.decode() for p, shape in ds.as_numpy_iterator() if shape[0] > 0 and shape[1] > 0}
    return [(p, _reason(p)) for p in paths if p not in good]


def _reason(path: str) -> str:
    """Why one image fails to decode, in a few words."""
    try:
        contents = tf.io.read_file(path)
    except tf.errors.OpError as e:
        return _first_line(e.message)
    if int(tf.strings.length(contents)) == 0:
        return "empty file (0 bytes)"
    try:
        image = decode(contents)
    except tf.errors.OpError as e:
        return _first_line(e.message)
    if 0 in image.shape[:2]:
        return "image has no pixels"
    return "unreadable"


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "unreadable"
    # TensorFlow prefixes errors with the op's function node; keep the reason.
    line = line.split("}}", 1)[-1].strip()
    return line.split(" [Op:", 1)[0].strip() or "unreadable"


def report_bad_images(bad: list[tuple[str, str]], policy: str, flag: str, log=None) -> None:
    """Applies ``--on-bad-image``: lists skipped images (to ``log``), or fails on the first.

    Raises:
        UserError: with ``policy == "fail"`` and at least one bad image.
    """
    if not bad:
        return
    if policy == "fail":
        path, reason = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(
            f"cannot decode image {path}: {reason}{more}; fix or remove it, or pass --on-bad-image skip ({flag})."
        )
    if log is None:
        return
    log.warning("skipping %d image(s) that cannot be decoded (%s):", len(bad), flag)
    for path, reason in bad:
        log.warning("  skipped %s: %s", path, reason)
