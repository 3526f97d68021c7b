"""RandAugment's operations, each against PIL's where PIL has one (the pipeline's use: test_pipeline)."""

import numpy as np
import pytest
from PIL import Image, ImageOps

from hvd_train.compat import tf
from hvd_train.data.randaugment import FILL, OPS, apply, rand_augment

RNG = np.random.default_rng(3)
PHOTO = RNG.integers(0, 256, size=(20, 24, 3)).astype(np.uint8)
# A narrow range of values, as a dull photo has: what auto_contrast and equalize act on.
DULL = (60 + RNG.integers(0, 40, size=(48, 64, 3))).astype(np.uint8)  # step >= 2 in PIL's equalize: its rounding shows


def op(name, image, magnitude, sign=1.0):
    return apply(name, tf.constant(image, tf.float32), magnitude, sign).numpy()


@pytest.mark.parametrize("name", [n for n in OPS if n not in ("auto_contrast", "equalize")])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_operation_but_the_two_without_magnitude_is_identity_at_magnitude_0(name, sign):
    assert np.allclose(op(name, PHOTO, 0, sign), PHOTO, atol=1e-3)


@pytest.mark.parametrize("image", [PHOTO, DULL], ids=["photo", "dull"])
def test_equalize_is_pils(image):
    assert np.array_equal(op("equalize", image, 5), np.asarray(ImageOps.equalize(Image.fromarray(image))))


def test_auto_contrast_stretches_each_channel_as_pil_does():
    ours = op("auto_contrast", DULL, 5)
    assert np.allclose(ours.min(axis=(0, 1)), 0) and np.allclose(ours.max(axis=(0, 1)), 255)
    pil = np.asarray(ImageOps.autocontrast(Image.fromarray(DULL))).astype(float)
    assert np.max(np.abs(ours - pil)) <= 1.0  # PIL rounds its table to whole values


@pytest.mark.parametrize("magnitude, threshold", [(5, 128), (10, 0)])
def test_solarize_is_pils_with_a_threshold_falling_with_the_magnitude(magnitude, threshold):
    pil = np.asarray(ImageOps.solarize(Image.fromarray(PHOTO), threshold))
    assert np.array_equal(op("solarize", PHOTO, magnitude), pil)


@pytest.mark.parametrize("magnitude, bits", [(5, 6), (10, 4)])
def test_posterize_is_pils_keeping_fewer_bits_with_the_magnitude(magnitude, bits):
    assert np.array_equal(
        op("posterize", PHOTO, magnitude), np.asarray(ImageOps.posterize(Image.fromarray(PHOTO), bits))
    )


def test_translate_moves_by_up_to_45_percent_and_fills_with_gray():
    shifted = op("translate_x", PHOTO, 10)  # 0.45 x 24 = 10.8 pixels: bilinear between 10 and 11
    expected = 0.2 * PHOTO[:, 10:23] + 0.8 * PHOTO[:, 11:24]
    assert np.allclose(shifted[:, :13], expected, atol=1e-3)
    assert np.allclose(shifted[:, 14:], FILL)
    down = op("translate_y", PHOTO, 10, -1.0)  # 0.45 x 20 = 9 pixels the other way
    assert np.allclose(down[9:], PHOTO[:11], atol=1e-3) and np.allclose(down[:9], FILL)


def test_shear_moves_each_row_by_its_height():
    sheared = op("shear_x", PHOTO, 10 / 3)  # 0.1 x y pixels: row 10 reads one pixel to the right
    assert np.allclose(sheared[0], PHOTO[0], atol=1e-3)
    assert np.allclose(sheared[10, :-1], PHOTO[10, 1:], atol=1e-3)


def test_rotate_turns_about_the_centre():
    square = RNG.integers(0, 256, size=(21, 21, 3)).astype(np.uint8)
    quarter = op("rotate", square, 10 * 90 / 30)  # 90 degrees: magnitude 30 of 10, past the range on purpose
    assert np.allclose(quarter, np.rot90(square, k=-1), atol=1e-3) or np.allclose(quarter, np.rot90(square), atol=1e-3)
    assert np.allclose(op("rotate", square, 10)[10, 10], square[10, 10], atol=1e-3)  # 30 degrees: the centre stays


def test_the_blends_go_towards_their_degenerate_image_with_the_magnitude():
    image = PHOTO.astype(float)
    assert np.allclose(op("brightness", PHOTO, 10, -1.0), image * 0.1, atol=1e-3)
    gray = op("color", PHOTO, 10, -1.0)
    spread = lambda x: np.mean(np.std(x, axis=2))  # noqa: E731  how far apart the channels are
    assert spread(gray) < 0.2 * spread(image)
    flat = op("contrast", PHOTO, 10, -1.0)
    assert np.std(flat) < 0.2 * np.std(image)
    sharp = op("sharpness", PHOTO, 10)
    assert np.array_equal(sharp[0], image[0]) and not np.allclose(sharp[5:15, 5:15], image[5:15, 5:15])


def test_rand_augment_is_drawn_from_its_key():
    image = tf.constant(PHOTO, tf.float32)
    first = rand_augment(image, tf.constant([1, 2], tf.int64), 9).numpy()
    again = rand_augment(image, tf.constant([1, 2], tf.int64), 9).numpy()
    others = [rand_augment(image, tf.constant([1, k], tf.int64), 9).numpy() for k in range(3, 23)]
    assert np.array_equal(first, again)
    assert len({o.tobytes() for o in others}) > 15
    assert all(o.min() >= 0 and o.max() <= 255 for o in others)
