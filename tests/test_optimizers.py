"""The optimizers' table (``model.optimizers``): what config offers, what each builds, and gradient clipping."""

import csv

import numpy as np
import pytest

from hvd_train import config
from hvd_train.config.choices import OPTIMIZERS as NAMES
from hvd_train.errors import UserError
from hvd_train.model import optimizers

from conftest import HVD_TRAIN, TINY, output_of, run_at_once


def _optim(**optim):
    return config.build({"data": {"train": "d"}, "run": {"output": "o"}, "optim": {"base_lr": 0.1, **optim}}).optim


def test_config_offers_exactly_the_optimizers_of_the_table():
    assert tuple(NAMES) == tuple(optimizers.OPTIMIZERS)


@pytest.mark.parametrize("name, keras_name, slots", [("sgd", "SGD", 1), ("adam", "Adam", 2), ("adamw", "AdamW", 2)])
def test_each_entry_builds_its_optimizer_with_the_runs_rate_decay_and_average(name, keras_name, slots):
    from hvd_train.compat import tf

    made = optimizers.make(_optim(optimizer=name, weight_decay=0.25, ema=0.9), learning_rate=0.5)
    assert type(made).__name__ == keras_name and optimizers.OPTIMIZERS[name].slots == slots
    assert float(made.learning_rate.numpy()) == 0.5 and float(made.weight_decay) == 0.25
    assert made.use_ema and made.ema_momentum == pytest.approx(0.9)
    plain = optimizers.make(_optim(optimizer=name, weight_decay=0.25, ema=0.9), ema=False)
    assert not plain.use_ema and float(plain.learning_rate.numpy()) == pytest.approx(0.1)
    # The values it keeps per weight are what plan counts.
    kernel = tf.Variable(np.ones((3, 2), np.float32))
    made.build([kernel])
    kept = [v for v in made.variables if tuple(v.shape) == (3, 2) and "average" not in v.name]
    assert len(kept) == slots


def test_clipping_is_keras_own_arithmetic_and_keeps_what_is_not_finite():
    from hvd_train.compat import tf

    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=(4, 3)), tf.float32), None, tf.constant(rng.normal(size=3), tf.float32)]
    present = [grads[0], grads[2]]
    norm = float(tf.linalg.global_norm(present))
    # --clip-norm: Keras's global norm clipping, the missing gradient kept missing.
    for limit in (norm / 4, norm * 2):
        got, _ = optimizers.clip(grads, _optim(clip_norm=limit))
        want, _ = tf.clip_by_global_norm(present, limit)
        assert got[1] is None
        for g, w in zip([got[0], got[2]], want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
    # --clip-value, then --clip-norm.
    got, _ = optimizers.clip(grads, _optim(clip_value=0.5, clip_norm=0.1))
    valued = [tf.clip_by_value(g, -0.5, 0.5) for g in present]
    want, _ = tf.clip_by_global_norm(valued, 0.1)
    for g, w in zip([got[0], got[2]], want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
    # Gradients held elsewhere (the sharded head's) count in the norm by their squares, and take the factor.
    got, factor = optimizers.clip([grads[0]], _optim(clip_norm=norm / 4), float(tf.reduce_sum(grads[2] ** 2)))
    want, _ = tf.clip_by_global_norm(present, norm / 4)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose((grads[2] * factor).numpy(), want[1].numpy(), rtol=1e-6)
    # An overflow stays one: a loss scale still sees it and skips the step on every rank.
    inf = [tf.constant([np.inf, 1.0, -3.0])]
    assert not np.isfinite(optimizers.clip(inf, _optim(clip_norm=1.0))[0][0].numpy()).all()
    assert optimizers.clip(inf, _optim(clip_value=2.0))[0][0].numpy().tolist() == [np.inf, 1.0, -2.0]
    # Off: the gradients as they came.
    assert optimizers.clip(grads, _optim())[0] == grads


@pytest.mark.parametrize("flag", ["clip_norm", "clip_value"])
@pytest.mark.parametrize("value", [-1.0, float("inf")])
def test_a_bad_clip_is_refused_in_one_line(flag, value):
    from hvd_train.config.checks import validate

    cfg = config.build({"data": {"train": "d"}, "run": {"output": "o"}, "optim": {flag: value}})
    with pytest.raises(UserError, match=f"`--{flag.replace('_', '-')}` is invalid. Received: {flag}="):
        validate(cfg)


def test_lr_find_sweeps_with_the_runs_optimizer(demo_small, tmp_path):
    """``lr-find --optimizer adamw`` is AdamW with the run's decay, not Adam: the same sweep otherwise."""
    sweep = ["--steps", "12", "--start-lr", "0.05", "--end-lr", "1", "--deterministic", "--val-split", "0.2"]
    runs = {"adam": ["--optimizer", "adam"], "adamw": ["--optimizer", "adamw", "--weight-decay", "0.5"]}
    procs = run_at_once(
        *(
            [*HVD_TRAIN, "lr-find", "--data", demo_small, *TINY, *sweep, *o, "--output", tmp_path / n]
            for n, o in runs.items()
        )
    )
    for proc in procs:
        assert proc.returncode == 0, output_of(proc)
    losses = {}
    for name in runs:
        with open(tmp_path / name / "lr_find.csv") as f:
            losses[name] = [row["loss"] for row in csv.DictReader(f)]
    assert len(losses["adam"]) == len(losses["adamw"]) >= 3
    assert losses["adam"][0] == losses["adamw"][0]  # the first step's loss comes before any update
    assert losses["adam"][1:] != losses["adamw"][1:]
