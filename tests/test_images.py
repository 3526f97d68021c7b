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
