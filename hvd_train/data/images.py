"""Decoding images, and finding the ones that cannot be decoded.

Training and the check use the same decoder, so an image that passes the
check cannot fail mid-epoch. That matters under Horovod: a rank whose
pipeline drops or fails on an image runs fewer steps than the others, and
the others wait for it forever.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator

from hvd_train.compat import tf
from hvd_train.data import storage
from hvd_train.data.fetcher import Fetcher
from hvd_train.errors import UserError, first_line

# --alpha-background: what transparent pixels are composited over.
ALPHA_BACKGROUNDS = {"white": 255, "black": 0, "gray": 128}
DEFAULT_ALPHA_BACKGROUND = "white"

# Every function this package hands to tf.data is graph code already (tf.cond,
# tf.switch_case; Python branches only on static values), so AutoGraph has
# nothing to convert: skipping it saves ~2.5 s of each process's start.
plain = tf.autograph.experimental.do_not_convert


def decode(contents: tf.Tensor, background: str = DEFAULT_ALPHA_BACKGROUND, portable: bool = False) -> tf.Tensor:
    """Decodes JPEG/PNG/GIF/BMP bytes to an RGB uint8 tensor of shape (h, w, 3).

    Grayscale, palette, RGBA, CMYK and 16-bit images come out as 8-bit RGB;
    an animated GIF gives its first frame. Images with transparency (RGBA
    or gray+alpha PNGs, palette PNGs with a transparent colour, 32-bit BMPs,
    GIFs) are composited over ``background`` (``white``, ``black`` or
    ``gray``) first: dropping the alpha channel would leave whatever colour
    the file happens to store under its transparent pixels.

    ``portable``: TensorFlow operations only, for graphs saved to run
    elsewhere (exports): a GIF's transparent pixels come out black, as
    TensorFlow's GIF decoder paints them, instead of composited by Pillow.
    """
    value = ALPHA_BACKGROUNDS[background]

    def plain():
        return tf.io.decode_image(contents, channels=3, expand_animations=False, dtype=tf.uint8)

    def composited(zero_alpha_is_opaque: bool = False):
        def decode_rgba():
            rgba = tf.io.decode_image(contents, channels=4, expand_animations=False, dtype=tf.uint8)
            alpha = rgba[..., 3]
            transparent = tf.reduce_any(alpha < 255)
            if zero_alpha_is_opaque:
                transparent &= tf.reduce_any(alpha > 0)
            return tf.cond(transparent, lambda: _composite(rgba, value), lambda: rgba[..., :3])

        return decode_rgba

    def gif():  # TensorFlow's GIF decoder paints transparent pixels black: Pillow knows them
        image = tf.numpy_function(lambda b: _gif_over(b, value), [contents], tf.uint8, stateful=False)
        return tf.ensure_shape(image, [None, None, 3])

    def png():  # libpng expands gray+alpha and palette transparency to RGBA
        return tf.cond(_png_has_alpha(contents), composited(), plain)

    # A 32-bit BMP whose fourth byte is 0 everywhere has no alpha (X8R8G8B8), as browsers read it.
    bmp = composited(zero_alpha_is_opaque=True)

    # One switch on the kind: control flow costs a function call an image in tf.data, each cond one more.
    image = tf.switch_case(image_kind(contents), [png, gif if not portable else plain, bmp, plain])
    image.set_shape([None, None, 3])
    return image


KINDS = ("png", "gif", "bmp", "other")


def image_kind(contents: tf.Tensor) -> tf.Tensor:
    """The index in ``KINDS`` of the image's format, from the file's first bytes (no control flow)."""
    kind = tf.constant(3)
    for index, magic in reversed(list(enumerate((b"\x89PNG\r\n\x1a\n", b"GIF", b"BM")))):
        kind = tf.where(tf.equal(tf.strings.substr(contents, 0, len(magic)), magic), index, kind)
    return kind


def _png_has_alpha(contents: tf.Tensor) -> tf.Tensor:
    """Whether a PNG has an alpha channel (colour type 4 or 6) or a tRNS chunk (before its first IDAT).

    libpng's filler alpha is wrong for gray images of 1, 2 or 4 bits, so
    images without either must not be read through their 4th channel.
    """
    colour_type = tf.strings.substr(tf.strings.join([tf.strings.substr(contents, 0, 26), b"\0" * 26]), 25, 1)
    typed = tf.equal(colour_type, b"\x04") | tf.equal(colour_type, b"\x06")
    header = tf.strings.split(contents, "IDAT", maxsplit=1)[0]
    return typed | (tf.size(tf.strings.split(header, "tRNS", maxsplit=1)) > 1)


def _composite(rgba: tf.Tensor, value: int) -> tf.Tensor:
    """``rgba`` over a plain background of grey level ``value``, as 8-bit RGB."""
    rgb = tf.cast(rgba[..., :3], tf.float32)
    alpha = tf.cast(rgba[..., 3:], tf.float32) / 255.0
    return tf.cast(tf.round(rgb * alpha + value * (1.0 - alpha)), tf.uint8)


def _gif_over(contents: bytes, value: int):
    import io

    import numpy as np
    from PIL import Image

    if isinstance(contents, np.ndarray):  # a 0-d array from tf.numpy_function
        contents = contents.item()
    with Image.open(io.BytesIO(contents)) as im:
        im.seek(0)
        rgba = im.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (value, value, value, 255))
    return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"), dtype=np.uint8)


def flatten_alpha(contents: bytes, background: str = DEFAULT_ALPHA_BACKGROUND) -> bytes | None:
    """PNG bytes of the image composited over ``background``, or None when it has no transparent pixel.

    Used when packing shards, so that the shards hold what training sees.
    """
    if not contents.startswith((b"\x89PNG", b"BM", b"GIF")):
        return None
    over = {b: decode(tf.constant(contents), b) for b in ("white", "black")}
    if bool(tf.reduce_all(over["white"] == over["black"])):
        return None  # no pixel shows its background
    flat = over.get(background)
    return tf.io.encode_png(decode(tf.constant(contents), background) if flat is None else flat).numpy()


Window = Callable[[tf.Tensor], tf.Tensor]
"""``f(height_width) -> [top, left, height, width]``: the part of an image to keep."""


def decode_window(
    contents: tf.Tensor,
    window: Window,
    fused: bool = True,
    min_side: int = 0,
    background: str = DEFAULT_ALPHA_BACKGROUND,
    portable: bool = False,
) -> tf.Tensor:
    """Decodes the part of an image that ``window`` picks, as RGB uint8.

    A JPEG is decoded only inside the window (``decode_and_crop_jpeg``, as
    TF Model Garden does), and, where the window is at least twice
    ``min_side`` on its shorter side, at 1/2, 1/4 or 1/8 scale straight
    from the DCT coefficients: a crop of a 12-megapixel photo that ends up
    224 pixels wide never exists at full size. Other formats are decoded
    whole, then cropped, then reduced by the same factor with an r x r box
    average (``reduce_crop``), which is what the DCT scaling amounts to: a
    large image of any format is shrunk without aliasing before the
    bilinear resize. The window depends only on the image's height and
    width, so every way cuts the same part of the image.

    Args:
        fused: False decodes JPEGs whole too (the reference for benchmarks and tests).
        min_side: the side the crop will be resized to (0: decode at full scale).
        background: what transparent pixels are composited over (see ``decode``).
        portable: TensorFlow operations only (see ``decode``).
    """

    def whole():
        image = decode(contents, background, portable)
        top, left, height, width = tf.unstack(window(tf.shape(image)[:2]))
        return tf.slice(image, tf.stack([top, left, 0]), tf.stack([height, width, 3]))

    if not fused:
        return whole()

    def jpeg():
        top, left, height, width = tf.unstack(window(tf.image.extract_jpeg_shape(contents)[:2]))
        scale = reduction(tf.minimum(height, width), min_side)

        def at(r):
            def decode_scaled():
                scaled = tf.stack([top // r, left // r, tf.maximum(1, height // r), tf.maximum(1, width // r)])
                return tf.image.decode_and_crop_jpeg(contents, scaled, channels=3, ratio=r)

            return decode_scaled

        image = tf.switch_case(scale, [at(1), at(2), at(4), at(8)])
        image.set_shape([None, None, 3])
        return image

    def other():
        return reduce_crop(whole(), min_side)

    return tf.cond(tf.io.is_jpeg(contents), jpeg, other)


REDUCTIONS = (1, 2, 4, 8)


def reduction(shorter: tf.Tensor, min_side: int) -> tf.Tensor:
    """The index in ``REDUCTIONS`` of the largest factor r that keeps a crop's ``shorter`` side >= ``min_side``."""
    scale = tf.constant(0)
    if min_side:
        for i, r in enumerate(REDUCTIONS[1:], start=1):
            scale = tf.where(shorter >= r * min_side, i, scale)
    return scale


def reduce_crop(image: tf.Tensor, min_side: int) -> tf.Tensor:
    """``image`` (uint8 [h, w, 3] or [b, h, w, 3]) shrunk by ``reduction``'s factor with an r x r box average.

    What a JPEG's DCT scaling does, for pixels already decoded: each output
    pixel is the mean of an r x r block (a partial block at the edge is
    dropped, as ``height // r`` does), rounded back to uint8.
    """
    if not min_side:
        return image
    batched = image if image.shape.rank == 4 else image[None]
    scale = reduction(tf.minimum(tf.shape(batched)[1], tf.shape(batched)[2]), min_side)

    def by(r):
        def reduce():
            if r == 1:
                return batched
            pooled = tf.nn.avg_pool2d(tf.cast(batched, tf.float32), r, r, "VALID")
            return tf.cast(tf.round(pooled), tf.uint8)

        return reduce

    reduced = tf.switch_case(scale, [by(r) for r in REDUCTIONS])
    reduced.set_shape([None, None, None, 3])
    return reduced if image.shape.rank == 4 else reduced[0]


def find_bad_images(paths: list[str], threads: int = 0, s3=None, ticker=None) -> list[tuple[str, str]]:
    """Decodes every image once and returns the ones that fail, with the reason.

    Args:
        paths: image files (or ``s3://`` URLs) to check.
        threads: decoding threads (0: TensorFlow's choice).
        s3: ``storage.S3Options`` for ``s3://`` URLs.
        ticker: a ``log.Ticker`` whose count follows the images checked.

    Returns:
        ``(path, reason)`` for each unreadable image, in input order.

    Raises:
        UserError: when S3 fails (after retries); naming bucket and key.
    """
    if not paths:
        return []
    if storage.is_s3(paths[0]):
        options = s3 or storage.S3Options()
        fetcher = Fetcher(options.concurrency)
        stream = fetcher.stream(range(len(paths)), lambda i: storage.read_url(paths[i], options))
        bad = []
        for i, _, reason in sort_out(stream):
            if reason is not None:
                bad.append((paths[i], reason))
            if ticker is not None:
                ticker.count = i + 1
        return bad

    def probe(path):
        image = decode(tf.io.read_file(path))
        return path, tf.shape(image)

    names = tf.constant([storage.os_bytes(p) for p in paths], tf.string)
    ds = tf.data.Dataset.from_tensor_slices(names).map(plain(probe), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.ignore_errors()
    if threads:
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        ds = ds.with_options(options)
    good = set()
    for p, shape in ds.as_numpy_iterator():
        if shape[0] > 0 and shape[1] > 0:
            good.add(p.decode("utf-8", "surrogateescape"))
        if ticker is not None:
            ticker.count += 1
    return [(p, _reason(p)) for p in paths if p not in good]


def why_undecodable(paths: list[str], s3=None) -> list[str]:
    """Why each of a few images (files or ``s3://`` URLs) cannot be decoded, in a few words."""
    reasons = []
    for path in paths:
        if storage.is_s3(path):
            try:
                reasons.append(reason_for(tf.constant(storage.read_url(path, s3 or storage.S3Options()))))
            except UserError as e:
                reasons.append(str(e))
        else:
            reasons.append(_reason(path))
    return reasons


def _reason(path: str) -> str:
    """Why one image fails to decode, in a few words."""
    try:
        contents = tf.io.read_file(storage.os_bytes(path))
    except tf.errors.OpError as e:
        return first_line(e.message) or "unreadable"
    return reason_for(contents)


def reason_for(contents) -> str:
    """Why these image bytes fail to decode, in a few words."""
    if int(tf.strings.length(contents)) == 0:
        return "empty file (0 bytes)"
    try:
        image = decode(contents)
    except Exception as e:  # TensorFlow's errors, and Pillow's own for a GIF
        return first_line(getattr(e, "message", "") or str(e)) or "unreadable"
    if 0 in image.shape[:2]:
        return "image has no pixels"
    return "unreadable"


def sort_out(stream: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes, str | None]]:
    """Decodes images as they stream by, in parallel, keeping their order.

    Args:
        stream: ``(index, encoded image)`` pairs.

    Yields:
        ``(index, encoded image, None)`` for an image that decodes, and
        ``(index, encoded image, reason)`` for one that does not.
    """
    pending: collections.OrderedDict[int, bytes] = collections.OrderedDict()
    lock = threading.Lock()
    failed: list[BaseException] = []

    def gen():
        try:
            for i, contents in stream:
                with lock:
                    pending[i] = contents
                yield i, contents
        except BaseException as e:  # reading failed (e.g. S3): not an image problem
            failed.append(e)

    def probe(i, contents):
        return i, tf.shape(decode(contents))

    def take(i: int):
        """Pops ``i`` after the images before it, which failed to decode."""
        while True:
            with lock:
                first, contents = pending.popitem(last=False)
            if first == i:
                return contents
            yield first, contents, reason_for(contents)

    ds = tf.data.Dataset.from_generator(
        gen, output_signature=(tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string))
    )
    # A decode error drops the element; the gap in the indices says which.
    ds = ds.map(plain(probe), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
    for i, shape in ds.prefetch(16).as_numpy_iterator():
        if failed:
            raise failed[0]
        i = int(i)
        contents = yield from take(i)
        yield i, contents, (None if shape[0] > 0 and shape[1] > 0 else "image has no pixels")
    if failed:
        raise failed[0]
    while pending:
        first, contents = pending.popitem(last=False)
        yield first, contents, reason_for(contents)


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
