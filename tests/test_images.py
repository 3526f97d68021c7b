import io
import logging

import numpy as np
import pytest
import tensorflow as tf  # noqa: E402  (after compat)
from PIL import Image

from hvd_train import compat  # noqa: F401
from hvd_train.data.images import decode, find_bad_images, report_bad_images
from hvd_train.errors import UserError


@pytest.fixture
def rgb():
    rng = np.random.default_rng(0)
    return (rng.random((20, 30, 3)) * 255).astype(np.uint8)


def _decoded(path):
    return decode(tf.io.read_file(str(path))).numpy()


@pytest.mark.parametrize(
    "mode, ext",
    [
        ("RGB", "jpg"),
        ("CMYK", "jpg"),
        ("L", "png"),
        ("RGBA", "png"),
        ("P", "png"),
        ("P", "gif"),
        ("LA", "png"),
        ("RGB", "bmp"),
        ("L", "bmp"),
        ("1", "png"),
    ],
)
def test_color_modes_decode_to_rgb(tmp_path, rgb, mode, ext):
    path = tmp_path / f"image.{ext}"
    Image.fromarray(rgb).convert(mode).save(path)
    image = _decoded(path)
    assert image.shape == (20, 30, 3) and image.dtype == np.uint8
    expected = np.asarray(Image.open(path).convert("RGB"))
    tolerance = 40 if ext == "jpg" else 1  # JPEG decoders may round differently
    assert np.abs(image.astype(int) - expected.astype(int)).mean() < tolerance


def test_sixteen_bit_png_is_scaled_to_eight_bits(tmp_path):
    values = np.linspace(0, 65535, 20 * 30).reshape(20, 30).astype(np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    image = _decoded(path)
    assert image.shape == (20, 30, 3)
    assert image[0, 0, 0] == 0 and image[-1, -1, 0] == 255


def test_bad_images_are_found_with_reasons(tmp_path, rgb):
    good = tmp_path / "good.png"
    Image.fromarray(rgb).save(good)
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    text = tmp_path / "text.png"
    text.write_text("not an image")
    Image.fromarray(rgb).save(tmp_path / "whole.jpg")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes((tmp_path / "whole.jpg").read_bytes()[:300])
    one_bit_bmp = tmp_path / "onebit.bmp"
    Image.fromarray(rgb).convert("1").save(one_bit_bmp)
    paths = [str(p) for p in (good, empty, text, truncated, one_bit_bmp)]
    bad = dict(find_bad_images(paths))
    assert set(bad) == {str(empty), str(text), str(truncated), str(one_bit_bmp)}
    assert bad[str(empty)] == "empty file (0 bytes)"
    assert "Unknown image file format" in bad[str(text)]
    assert "JPEG" in bad[str(truncated)]


def test_report_policy(caplog):
    bad = [("/d/a.jpg", "empty file (0 bytes)"), ("/d/b.jpg", "Unknown image file format")]
    with pytest.raises(UserError, match=r"cannot decode image /d/a.jpg: empty file \(0 bytes\) \(and 1 more\)"):
        report_bad_images(bad, "fail", "--data")
    logger = logging.getLogger("test_report")
    with caplog.at_level(logging.WARNING, logger="test_report"):
        report_bad_images(bad, "skip", "--data", logger)
    assert "skipping 2 image(s)" in caplog.text and "/d/b.jpg" in caplog.text


def jpeg_bytes(pixels, subsampling=0, progressive=False, mode="RGB"):
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(
        buf, "JPEG", quality=90, subsampling=subsampling, progressive=progressive
    )
    return tf.constant(buf.getvalue())


@pytest.mark.parametrize(
    "subsampling, progressive, mode", [(0, False, "RGB"), (2, False, "RGB"), (2, True, "RGB"), (0, False, "L")]
)
def test_decoding_only_the_crop_gives_the_pixels_of_a_whole_decode(subsampling, progressive, mode):
    from hvd_train.data.images import decode_window
    from hvd_train.data.pipeline import center_window, random_crop_window

    pixels = np.random.default_rng(1).integers(0, 255, (203, 317, 3), np.uint8)
    data = jpeg_bytes(pixels, subsampling, progressive, mode)
    for k in range(12):
        for window in (random_crop_window(tf.constant([k, 3], tf.int64)), center_window(0.875)):
            fused = decode_window(data, window, fused=True).numpy().astype(int)
            whole = decode_window(data, window, fused=False).numpy().astype(int)
            assert fused.shape == whole.shape
            # 4:2:0 chroma: the crop's first and last columns are upsampled without their outer neighbour.
            assert np.array_equal(fused[:, 1:-1], whole[:, 1:-1])
            if subsampling == 0:
                assert np.array_equal(fused, whole)


def test_a_large_crop_is_decoded_at_a_smaller_dct_scale_close_to_the_full_one():
    from hvd_train.data.images import decode_window
    from hvd_train.data.pipeline import _resize, center_window

    yy, xx = np.mgrid[0:1200, 0:1600]
    pixels = np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1).astype(np.uint8)  # smooth ramps
    data = jpeg_bytes(pixels)
    window = center_window(1.0)  # 1200 x 1200: decoded at 1/4 for a 224 px input
    fast = decode_window(data, window, min_side=224)
    assert fast.shape == (300, 300, 3)
    small = _resize(fast, 224).numpy()
    reference = _resize(decode_window(data, window, fused=False), 224).numpy()
    assert np.abs(small - reference).mean() < 6  # the same picture, sampled differently
    assert decode_window(data, window, min_side=700).shape == (1200, 1200, 3)  # not twice the side: full scale
