"""The learning-rate range test: ``hvd-train lr-find`` and ``--base-lr auto``."""

import csv
import json

import numpy as np
import pytest
from PIL import Image

from hvd_train.training.lr_find import centred_average, suggest

from conftest import HVD_TRAIN, TINY, TINY_MODEL, cli, output_of, read_json, run_at_once, write_images

SWEEP = ["--steps", "60", "--start-lr", "1e-5", "--end-lr", "10"]


def test_suggestion_is_a_tenth_of_the_rate_at_the_lowest_smoothed_loss():
    lrs = list(np.geomspace(1e-6, 1, 50))
    falls = [2.0] * 10 + list(np.linspace(2.0, 0.5, 30)) + list(np.linspace(0.6, 9.0, 10))
    assert suggest(lrs, falls) == pytest.approx(lrs[int(np.argmin(centred_average(falls)))] / 10)
    assert 34 <= int(np.argmin(centred_average(falls))) <= 39
    # falls, then flat until it explodes: the centred average does not drift to the explosion
    plateau = list(np.linspace(8.0, 1.6, 20)) + [1.6, 1.58, 1.62] * 10
    assert suggest(lrs[:50], plateau) < lrs[40] / 10
    assert suggest(lrs, [2.0] * 50) is None  # never fell, never rose
    flat = [2.0, 1.9, 2.1] * 12 + list(np.linspace(2.0, 20.0, 14))
    risen = int(np.flatnonzero(centred_average(flat) > 1.1 * 2.0)[0])
    assert 34 <= risen <= 38 and suggest(lrs, flat) == pytest.approx(lrs[risen] / 10)  # flat, then the edge
    assert suggest(lrs, list(np.linspace(2.0, 0.5, 50))) is None  # still falling at the end: no edge found
    assert suggest(lrs[:5], falls[:5]) is None  # too short to tell


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_lr_find_writes_its_sweep_and_suggests_a_rate_the_same_every_time(demo_small, tmp_path):
    # --deterministic: the same sweep every time, one that finds a rate. The two sweeps run at once.
    common = ["lr-find", "--data", demo_small, *TINY, "--val-split", "0.2", "--deterministic", *SWEEP]
    again, out = tmp_path / "again", tmp_path / "find"
    for proc in run_at_once(*([*HVD_TRAIN, *common, "--output", o] for o in (again, out))):
        assert proc.returncode == 0, output_of(proc)
    assert (again / "lr_find.csv").read_text() == (out / "lr_find.csv").read_text()
    found = json.loads((out / "lr_find.json").read_text())
    rows = _rows(out / "lr_find.csv")
    lrs = np.array([float(r["lr"]) for r in rows])
    assert 10 <= len(rows) <= 60 and lrs[0] == pytest.approx(1e-5)
    ratios = lrs[1:] / lrs[:-1]
    assert np.allclose(ratios, (10 / 1e-5) ** (1 / 59), rtol=1e-4)  # exponential
    assert (out / "lr_find.png").read_bytes().startswith(b"\x89PNG")
    # A tenth of one of the swept rates, below the last one.
    losses = [float(r["loss"]) for r in rows]
    finite = [i for i, loss in enumerate(losses) if np.isfinite(loss)]
    expected = suggest([lrs[i] for i in finite], [losses[i] for i in finite])
    assert expected is not None and found["suggested_base_lr"] == pytest.approx(expected, rel=1e-4)
    assert np.isclose(lrs, expected * 10, rtol=1e-4).any() and expected * 10 < lrs[-1]
    assert f"suggested --base-lr {found['suggested_base_lr']:.3g}" in proc.stdout


def test_lr_find_without_a_rate_says_so_in_one_line(tmp_path):
    # Rates far too small to move the weights, and every step the same 8 images (2 classes of 5, one of
    # each held out) unaugmented, with no dropout: the loss neither falls nor rises, on any machine.
    data = write_images(tmp_path / "d", {"a": 5, "b": 5})
    out = tmp_path / "find"
    sweep = ["--steps", "20", "--start-lr", "1e-12", "--end-lr", "1e-11"]
    same = ["--batch-size", "8", "--augment", "none", "--dropout", "0"]
    proc = cli(["lr-find", "--data", data, "--output", out, *TINY, *same, "--val-split", "0.2", *sweep])
    assert proc.returncode == 2, output_of(proc)
    assert json.loads((out / "lr_find.json").read_text())["suggested_base_lr"] is None
    assert json.loads((out / "lr_find.json").read_text())["steps"] == 20
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "no rate found" in errors[0] and "Traceback" not in proc.stderr, output_of(proc)


def test_bad_sweep_arguments(demo_small, tmp_path):
    proc = cli(["lr-find", "--data", demo_small, "--output", tmp_path / "o", "--start-lr", "1", "--end-lr", "0.1"])
    assert proc.returncode == 2 and "--start-lr" in proc.stderr


@pytest.fixture(scope="module")
def large_features(demo_small, tmp_path_factory):
    """Weights of the tests' backbone whose pooled features have an L2 norm of about 100, as large as a
    pretrained VGG16's (the backbone that made the default SGD diverge on a linear head)."""
    from tiny_net import backbone

    from hvd_train import compat  # noqa: F401
    from hvd_train.compat import keras
    from hvd_train.model.catalogue import get_spec

    keras.utils.set_random_seed(0)
    model = backbone((32, 32, 3))
    files = sorted(demo_small.rglob("*.png"))[::5]
    images = np.stack([np.asarray(Image.open(f).convert("RGB").resize((32, 32)), np.float32) for f in files])
    pixels = get_spec(TINY_MODEL).preprocess_input()(images)
    norm = lambda: float(np.linalg.norm(np.mean(model(pixels, training=False), axis=(1, 2)), axis=1).mean())  # noqa: E731
    last = model.get_layer("bn2")  # BatchNorm then ReLU: scaling its gamma and beta scales the features
    gamma, beta, *moving = last.get_weights()
    scale = 100 / norm()
    last.set_weights([gamma * scale, beta * scale, *moving])
    assert norm() == pytest.approx(100, rel=0.05)
    path = tmp_path_factory.mktemp("large") / "tiny.weights.h5"
    model.save_weights(path)
    return path


def _losses(out):
    return [float(r["loss"]) for r in _rows(out / "metrics.csv")]


FROZEN = [*TINY, "--freeze-backbone", "--epochs", "3", "--val-split", "0.2", "--deterministic"]
# --deterministic: the same run every time. Without it, thread timing alone
# left the auto rate's 3 epochs flat (last loss above the first) in about one
# run of three.


@pytest.fixture(scope="module")
def frozen_runs(demo_small, large_features, tmp_path_factory):
    """The frozen backbone with those features trained two ways at once: ``{"plain": ..., "auto": ...}``, each
    ``(output, proc)``: the plain head at the old default rate, and the default head at ``--base-lr auto``."""
    root = tmp_path_factory.mktemp("frozen")
    given = {"plain": ["--head-norm", "none", "--base-lr", "0.01"], "auto": ["--base-lr", "auto"]}
    args = ["train", "--data", demo_small, *FROZEN, "--weights", large_features]
    procs = run_at_once(*([*HVD_TRAIN, *args, "--output", root / name, *extra] for name, extra in given.items()))
    return {name: (root / name, proc) for name, proc in zip(given, procs)}


def test_frozen_large_feature_backbone_diverges_with_the_plain_head_at_sgd_0_01(frozen_runs):
    # The trap of the issue, reproduced: the plain head on these features at the old default.
    out, proc = frozen_runs["plain"]
    assert proc.returncode == 0, output_of(proc)
    assert max(_losses(out)) > 10


def test_frozen_large_feature_backbone_with_base_lr_auto_does_not_diverge(frozen_runs):
    out, proc = frozen_runs["auto"]
    assert proc.returncode == 0, output_of(proc)
    losses = _losses(out)
    assert max(losses) < 2 * np.log(5) and losses[-1] < losses[0]
    summary = read_json(out / "summary.json")
    assert summary["base_lr"] == json.loads((out / "lr_find.json").read_text())["suggested_base_lr"]
    assert "--base-lr auto:" in proc.stderr


# --base-lr auto under two ranks (found once, on rank 0, and kept on resume): test_multiprocess.py,
# whose 2-rank run sweeps it.
