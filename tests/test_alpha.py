"""Transparent images: composited over --alpha-background before anything else.

Every image here hides a colour under its transparent pixels (pure red),
as clip art and icons often do; dropping the alpha channel would show it.
"""

import io
import json

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from hvd_train import compat  # noqa: F401
from hvd_train.data import packed
from hvd_train.data.folder import ImageSet
from hvd_train.data.images import ALPHA_BACKGROUNDS, decode
from hvd_train.data.pipeline import eval_dataset, predict_dataset, train_input
from hvd_train.data.sharding import Segment
from hvd_train.data.storage import S3Options

HIDDEN = (255, 0, 0)  # the colour stored under transparent pixels
SHOWN = (0, 0, 255)  # the opaque half


def _bytes(image: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kw)
    return out.getvalue()


def transparent_images() -> dict[str, bytes]:
    """8x8 images whose top half is transparent (hiding red) and bottom half opaque blue."""
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:4, :, :3] = HIDDEN
    rgba[4:, :, :3] = SHOWN
    rgba[4:, :, 3] = 255
    gray_alpha = np.zeros((8, 8, 2), np.uint8)
    gray_alpha[:4, :, 0] = 200  # hidden light gray
    gray_alpha[4:, :, 0] = 30
    gray_alpha[4:, :, 1] = 255
    palette = Image.new("P", (8, 8))
    palette.putpalette([*HIDDEN, *SHOWN] + [0] * 762)
    palette.putdata([0] * 32 + [1] * 32)
    return {
        "rgba.png": _bytes(Image.fromarray(rgba, "RGBA"), "PNG"),
        "gray-alpha.png": _bytes(Image.fromarray(gray_alpha, "LA"), "PNG"),
        "palette-trns.png": _bytes(palette, "PNG", transparency=0),
        "transparent.gif": _bytes(palette, "GIF", transparency=0),
        "rgba.bmp": _bytes(Image.fromarray(rgba, "RGBA"), "BMP"),
    }


def shown(name: str) -> tuple[int, int, int]:
    return (30, 30, 30) if name.startswith("gray") else SHOWN


@pytest.mark.parametrize("name", sorted(transparent_images()))
@pytest.mark.parametrize("background", sorted(ALPHA_BACKGROUNDS))
def test_transparent_pixels_show_the_background_not_the_hidden_colour(name, background):
    image = decode(tf.constant(transparent_images()[name]), background).numpy()
    value = ALPHA_BACKGROUNDS[background]
    assert image.shape == (8, 8, 3)
    assert (image[:4] == value).all(), image[0, 0]
    assert (image[4:] == shown(name)).all(), image[7, 7]


def test_half_transparent_pixels_are_blended():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[..., 3] = 51  # 20% opaque
    image = decode(tf.constant(_bytes(Image.fromarray(rgba, "RGBA"), "PNG")), "black").numpy()
    assert (image[..., 0] == 40).all() and (image[..., 1:] == 0).all()
    image = decode(tf.constant(_bytes(Image.fromarray(rgba, "RGBA"), "PNG")), "white").numpy()
    assert (image[..., 0] == 244).all() and (image[..., 1:] == 204).all()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP", "GIF"])
def test_opaque_images_are_unchanged(fmt):
    rgb = (np.random.default_rng(0).random((10, 12, 3)) * 255).astype(np.uint8)
    image = Image.fromarray(rgb)
    if fmt == "GIF":
        image = image.convert("P")
    data = _bytes(image, fmt)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for background in ALPHA_BACKGROUNDS:
        got = decode(tf.constant(data), background).numpy()
        tolerance = 3 if fmt == "JPEG" else 0  # JPEG decoders may round differently
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= tolerance, (fmt, background)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("alpha")
    for i, (name, data) in enumerate(sorted(transparent_images().items())):
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        (root / f"c{i % 2}" / name).write_bytes(data)
    opaque = root / "c0" / "opaque.png"
    Image.fromarray(np.full((8, 8, 3), 77, np.uint8)).save(opaque)
    return root


def _top_left_values(batches) -> list[float]:
    """The first pixel of every image: it lies in the transparent half (or is the opaque image's 77)."""
    return sorted(float(images[i, 0, 0, 1]) for images, *_ in batches for i in range(len(images)))


@pytest.mark.parametrize("background", ["white", "gray"])
def test_training_evaluation_and_prediction_composite(folder, background):
    paths = sorted(str(p) for p in folder.rglob("*.*"))
    images = ImageSet(paths, [0] * len(paths), ["c0"])
    value, n = float(ALPHA_BACKGROUNDS[background]), len(paths)
    expected = sorted([value] * (n - 1) + [77.0])
    # the green channel of the top rows is 0 in every hidden colour: the background shows
    kw = dict(image_size=8, preprocess=lambda x: x, alpha_background=background)
    ds = eval_dataset(images, rank=0, size=1, batch_size=4, crop_fraction=1.0, **kw).dataset
    assert _top_left_values(ds.as_numpy_iterator()) == expected
    ds = predict_dataset(paths, batch_size=4, crop_fraction=1.0, **kw)
    assert _top_left_values((b,) for b in ds.as_numpy_iterator()) == expected
    segment = Segment.whole(0, n, 1, n, 1, 5)
    made = train_input(images, [(segment, 0)], rank=0, augment="none", seed=5, **kw)
    assert _top_left_values(made.dataset.take(1).as_numpy_iterator()) == expected


def test_pack_stores_composited_pngs_and_leaves_opaque_images_byte_for_byte(folder, tmp_path):
    manifest = packed.pack(
        str(folder),
        str(tmp_path / "s"),
        shard_size=1 << 20,
        on_bad_image="fail",
        seed=1,
        s3=S3Options(),
        alpha_background="black",
    )[str(tmp_path / "s")]
    assert manifest["alpha_background"] == "black" and manifest["composited"] == len(transparent_images())
    on_disk = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert on_disk["alpha_background"] == "black"
    shard_set = packed.load(str(tmp_path / "s"), "--data")
    assert shard_set.alpha_background == "black"
    opaque = (folder / "c0" / "opaque.png").read_bytes()
    seen = 0
    parse = shard_set.features.parser()
    for record in tf.data.TFRecordDataset(str(tmp_path / "s" / "shard-00000.tfrecord")):
        contents, _ = parse(record)
        data = contents.numpy()
        if data == opaque:
            continue
        seen += 1
        assert data.startswith(b"\x89PNG")
        with Image.open(io.BytesIO(data)) as im:
            assert im.mode == "RGB"  # no alpha left to drop
            top = np.asarray(im)[:4]
        assert (top == 0).all()
    assert seen == len(transparent_images())
    ds = eval_dataset(
        shard_set,
        rank=0,
        size=1,
        batch_size=3,
        image_size=8,
        crop_fraction=1.0,
        preprocess=lambda x: x,
        alpha_background="white",
    ).dataset  # the pack's choice stays
    assert _top_left_values(ds.as_numpy_iterator()).count(0.0) == len(transparent_images())


def test_a_bmp_whose_fourth_byte_is_zero_everywhere_is_opaque():
    # 32-bit BMPs often leave the fourth byte 0 (X8R8G8B8): browsers read them as opaque, and so do we
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., :3] = SHOWN
    image = decode(tf.constant(_bytes(Image.fromarray(rgba, "RGBA"), "BMP")), "white").numpy()
    assert (image == SHOWN).all()


def test_low_bit_depth_gray_pngs_are_not_read_through_a_filler_alpha():
    # libpng's filler alpha is 1, not 255, for 1-bit gray images without transparency
    bits = np.zeros((4, 8), bool)
    bits[:, ::2] = True
    image = decode(tf.constant(_bytes(Image.fromarray(bits).convert("1"), "PNG")), "gray").numpy()
    assert (image[:, ::2] == 255).all() and (image[:, 1::2] == 0).all()
