import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

from hvd_train import checkpoints
from hvd_train.compat import keras
from hvd_train.errors import UserError
from hvd_train.state import TrainState


def small_model(units=3):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(units)(inputs))


def trained(units=3):
    model = small_model(units)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(np.ones((2, 4)), np.ones((2, units)))
    return model, opt


def state_at(epoch, epoch_steps=0):
    state = TrainState(seed=1, world_size=2, batch_size=4, global_batch=8, total=100, epoch=epoch)
    state.advance(epoch_steps)
    return state


def save(out, state, model, opt, keep=3, rows=None):
    rows = np.arange(6, dtype=np.float32).reshape(2, 3) if rows is None else rows
    return checkpoints.save(
        str(out), checkpoints.name_for(state), model, opt, state, {"rows": rows}, {"note": "x"}, keep
    )


def test_save_restore_keeps_weights_optimizer_state_and_per_rank_values(tmp_path):
    model, opt = trained()
    for epoch, steps in ((1, 0), (1, 5), (2, 0)):
        save(tmp_path, state_at(epoch, steps), model, opt)
    found = checkpoints.latest(str(tmp_path))
    assert found.path.endswith("epoch-0002") and found.state.epoch == 2 and found.info["note"] == "x"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch-0001", "epoch-0001-step-000005", "epoch-0002"]

    fresh, fresh_opt = small_model(), keras.optimizers.SGD(0.1, momentum=0.9)
    fresh_opt.build(fresh.trainable_variables)
    local = checkpoints.restore(found, fresh, fresh_opt)
    assert local["rows"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), model.get_weights()))
    assert int(fresh_opt.iterations.numpy()) == int(opt.iterations.numpy()) == 1
    # SGD's momentum slots ("SGD/m/...") come back too, not only the weights.
    saved = [v.numpy() for v in opt.variables if "/m/" in v.name]
    restored = [v.numpy() for v in fresh_opt.variables if "/m/" in v.name]
    assert len(saved) == 2 and np.abs(saved[0]).sum() > 0
    assert all(np.array_equal(a, b) for a, b in zip(saved, restored))


def test_mid_epoch_checkpoints_sort_between_epoch_ends_and_count_towards_keep(tmp_path):
    model, opt = trained()
    for epoch, steps in ((1, 0), (1, 40), (1, 120), (2, 0), (2, 7)):
        save(tmp_path, state_at(epoch, steps), model, opt, keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch-0002", "epoch-0002-step-000007"]
    found = checkpoints.latest(str(tmp_path))
    assert found.path.endswith("epoch-0002-step-000007") and found.state.epoch_steps == 7


def test_incomplete_checkpoints_are_ignored(tmp_path):
    model, opt = trained()
    save(tmp_path, state_at(1), model, opt)
    # A writer that died: a temporary folder, and a folder without state.json.
    (tmp_path / "checkpoints" / ".epoch-0002.tmp-999").mkdir()
    (tmp_path / "checkpoints" / "epoch-0003").mkdir()
    found = checkpoints.latest(str(tmp_path))
    assert found.path.endswith("epoch-0001") and found.state.epoch == 1
    assert checkpoints.latest(str(tmp_path / "elsewhere")) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "state"])
def test_a_damaged_checkpoint_is_skipped_with_a_warning_for_the_one_before(tmp_path, caplog, damage):
    model, opt = trained()
    save(tmp_path, state_at(1), model, opt)
    newest = save(tmp_path, state_at(1, 9), model, opt)
    if damage == "state":
        with open(os.path.join(newest, "state.json"), "r+b") as f:
            f.truncate(40)
    else:
        victim = max(
            (os.path.join(newest, n) for n in os.listdir(newest) if n.startswith("ckpt.data")), key=os.path.getsize
        )
        data = bytearray(open(victim, "rb").read())
        if damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0xFF
        open(victim, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hvd_train"):
        found = checkpoints.latest(str(tmp_path))
    assert found.path.endswith("epoch-0001")
    assert any("skipping checkpoint" in r.message and "epoch-0001-step-000009" in r.message for r in caplog.records)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = trained(units=3)
    save(tmp_path, state_at(1), model, opt)
    other, other_opt = small_model(units=5), keras.optimizers.SGD(0.1, momentum=0.9)
    other_opt.build(other.trainable_variables)
    with pytest.raises(UserError, match="does not fit this model.*--no-resume"):
        checkpoints.restore(checkpoints.latest(str(tmp_path)), other, other_opt)


def test_a_save_that_cannot_write_is_a_clear_error_and_keeps_the_previous(tmp_path):
    model, opt = trained()
    save(tmp_path, state_at(1), model, opt)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the checkpoint folder should be")
    with pytest.raises(
        UserError, match=r"cannot write checkpoint .*blocked/checkpoints/epoch-0002.*choose another --output"
    ):
        save(blocked, state_at(2), model, opt)
    assert checkpoints.latest(str(tmp_path)).path.endswith("epoch-0001")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 600 KB file system (tmpfs), where a checkpoint of a big model cannot fit."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_disk_full_is_a_clear_error_and_leaves_the_previous_checkpoint_intact(tiny_disk):
    small, small_opt = trained(units=3)
    save(tiny_disk, state_at(1), small, small_opt)
    inputs = keras.Input((400,))
    big = keras.Model(inputs, keras.layers.Dense(400)(inputs))  # 160,000 weights: 640 KB
    big_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    big_opt.build(big.trainable_variables)
    with pytest.raises(
        UserError, match=r"cannot write checkpoint .*epoch-0002.*No space left on device.*free some space"
    ):
        save(tiny_disk, state_at(2), big, big_opt)
    assert os.listdir(tiny_disk / "checkpoints") == ["epoch-0001"], "no half-written checkpoint is left"
    assert checkpoints.latest(str(tiny_disk)).path.endswith("epoch-0001")
