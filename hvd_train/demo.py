"""The demo data set: labelled patterns drawn by numpy, nothing downloaded.

Five classes of texture -- checkerboard, dots, diagonal, horizontal and
vertical stripes -- each at a random scale, phase and pair of colours, with
noise. Textures suit a network that starts from random weights (no weights
can be downloaded everywhere): local filters tell them apart within a few
epochs. Stripes' orientation survives left-right flips. The same seed gives
the same files byte for byte. Half the images are PNG and half JPEG, and
some sit in nested sub-folders, as real data sets do.
"""

from __future__ import annotations

import os

import numpy as np

CLASSES = ("checkerboard", "dots", "stripes_diagonal", "stripes_horizontal", "stripes_vertical")


def draw(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """One RGB uint8 image of shape (size, size, 3) showing pattern ``kind``.

    Period, phase, the two colours and the noise are random, so only the
    pattern's geometry tells the classes apart.
    """
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    period = rng.uniform(6, 14)
    phase_y, phase_x = rng.uniform(0, period, 2)
    y, x = (yy + phase_y) / period, (xx + phase_x) / period
    if kind == "stripes_horizontal":
        on = (y % 1) < 0.5
    elif kind == "stripes_vertical":
        on = (x % 1) < 0.5
    elif kind == "stripes_diagonal":
        on = ((x + y * rng.choice([-1, 1])) % 1) < 0.5
    elif kind == "checkerboard":
        on = ((np.floor(x) + np.floor(y)) % 2) < 1
    else:  # dots
        on = ((x % 1 - 0.5) ** 2 + (y % 1 - 0.5) ** 2) < 0.09
    background = rng.uniform(0, 255, 3)
    foreground = (background + rng.choice([-1, 1], 3) * rng.uniform(70, 150, 3)) % 256
    image = np.where(on[..., None], foreground, background) + rng.normal(0, 20, (size, size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_demo_data(root: str, per_class: int = 150, size: int = 64, seed: int = 0) -> str:
    """Writes ``root/<class>/[part-k/]shape-NNNN.{png,jpg}``; returns ``root``.

    Existing complete output (same files) is left alone, so calling it twice
    is cheap.
    """
    from hvd_train.compat import tf

    marker = os.path.join(root, f".complete-{per_class}-{size}-{seed}")
    if os.path.exists(marker):
        return root
    rng = np.random.default_rng(seed)
    for label in CLASSES:
        for i in range(per_class):
            image = draw(label, size, rng)
            folder = os.path.join(root, label, f"part-{i % 3}") if i % 4 == 0 else os.path.join(root, label)
            os.makedirs(folder, exist_ok=True)
            if i % 2:
                data, ext = tf.io.encode_jpeg(image, quality=90), "jpg"
            else:
                data, ext = tf.io.encode_png(image), "png"
            with open(os.path.join(folder, f"shape-{i:04d}.{ext}"), "wb") as f:
                f.write(data.numpy())
    open(marker, "w").close()
    return root
