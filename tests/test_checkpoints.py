import os

import numpy as np
import pytest

from hvd_train import checkpoints
from hvd_train.compat import keras
from hvd_train.errors import UserError


def small_model(units=3):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(units)(inputs))


def trained(units=3):
    model = small_model(units)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(np.ones((2, 4)), np.ones((2, units)))
    return model, opt


def test_save_restore_keeps_weights_and_optimizer_state(tmp_path):
    model, opt = trained()
    for epoch in (1, 2, 3):
        checkpoints.save(str(tmp_path), epoch, model, opt, {"note": epoch}, keep=2)
    path, state = checkpoints.latest(str(tmp_path))
    assert path.endswith("epoch-0003") and state["epoch"] == 3 and state["note"] == 3
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch-0002", "epoch-0003"]

    fresh, fresh_opt = small_model(), keras.optimizers.SGD(0.1, momentum=0.9)
    fresh_opt.build(fresh.trainable_variables)
    checkpoints.restore(path, fresh, fresh_opt)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), model.get_weights()))
    assert int(fresh_opt.iterations.numpy()) == int(opt.iterations.numpy()) == 1
    # SGD's momentum slots ("SGD/m/...") come back too, not only the weights.
    saved = [v.numpy() for v in opt.variables if "/m/" in v.name]
    restored = [v.numpy() for v in fresh_opt.variables if "/m/" in v.name]
    assert len(saved) == 2 and np.abs(saved[0]).sum() > 0
    assert all(np.array_equal(a, b) for a, b in zip(saved, restored))


def test_incomplete_checkpoint_is_ignored(tmp_path):
    model, opt = trained()
    checkpoints.save(str(tmp_path), 1, model, opt, {}, keep=3)
    # A writer that died: a temporary folder, and a folder without state.json.
    (tmp_path / "checkpoints" / ".epoch-0002.tmp-999").mkdir()
    (tmp_path / "checkpoints" / "epoch-0003").mkdir()
    path, state = checkpoints.latest(str(tmp_path))
    assert path.endswith("epoch-0001") and state["epoch"] == 1
    assert checkpoints.latest(str(tmp_path / "elsewhere")) is None


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = trained(units=3)
    path = checkpoints.save(str(tmp_path), 1, model, opt, {}, keep=1)
    other, other_opt = small_model(units=5), keras.optimizers.SGD(0.1, momentum=0.9)
    other_opt.build(other.trainable_variables)
    with pytest.raises(UserError, match="does not fit this model.*--no-resume"):
        checkpoints.restore(path, other, other_opt)
