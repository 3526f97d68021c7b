import json
import logging
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from hvd_train.compat import keras
from hvd_train.errors import UserError
from hvd_train.training import checkpoints
from hvd_train.training.state import TrainState

from conftest import small_file_system


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


def is_momentum(variable) -> bool:
    return "/m/" in variable.name or variable.name.endswith("_momentum")


@pytest.mark.both_kerases
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
    # SGD's momentum slots (tf-keras: "SGD/m/...", Keras 3: "..._momentum") come back too, not only the weights.
    saved = [v.numpy() for v in opt.variables if is_momentum(v)]
    restored = [v.numpy() for v in fresh_opt.variables if is_momentum(v)]
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


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 600 KB file system (tmpfs), where a checkpoint of a big model cannot fit."""
    with small_file_system(tmp_path, "600k") as mount:
        yield mount


def big_model():
    inputs = keras.Input((400,))
    big = keras.Model(inputs, keras.layers.Dense(400)(inputs))  # 160,000 weights: 640 KB
    big_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    big_opt.build(big.trainable_variables)
    return big, big_opt


def test_disk_full_is_a_clear_error_and_leaves_the_previous_checkpoint_intact(tiny_disk):
    small, small_opt = trained(units=3)
    save(tiny_disk, state_at(1), small, small_opt, keep=1)
    big, big_opt = big_model()
    with pytest.raises(
        UserError, match=r"cannot write checkpoint .*epoch-0002.*No space left on device.*free some space"
    ):
        save(tiny_disk, state_at(2), big, big_opt, keep=1)
    assert os.listdir(tiny_disk / "checkpoints") == ["epoch-0001"], "no half-written checkpoint is left"
    assert checkpoints.latest(str(tiny_disk)).path.endswith("epoch-0001")
    # With room again, the next save goes through and only then replaces the previous (keep 1).
    save(tiny_disk, state_at(2), small, small_opt, keep=1)
    assert os.listdir(tiny_disk / "checkpoints") == ["epoch-0002"]


# The same with a file size limit (RLIMIT_FSIZE), which needs no root: a process of its own.
_SAVE_UNDER_LIMIT = """
import json, sys
import numpy as np
from hvd_train.training import checkpoints
from hvd_train.compat import keras
from hvd_train.errors import UserError
from hvd_train.training.state import TrainState

out = sys.argv[1]
def model(width):
    inputs = keras.Input((width,))
    m = keras.Model(inputs, keras.layers.Dense(width)(inputs))
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(m.trainable_variables)
    return m, opt
def state(epoch):
    return TrainState(seed=1, world_size=1, batch_size=4, global_batch=4, total=100, epoch=epoch)
rows = {"rows": np.zeros((1, 3), np.float32)}
checkpoints.save(out, "epoch-0001", *model(4), state(1), rows, {}, keep=1)
try:
    checkpoints.save(out, "epoch-0002", *model(400), state(2), rows, {}, keep=1)
    error = None
except UserError as e:
    error = str(e)
print(json.dumps({"error": error, "latest": checkpoints.latest(out).path}))
"""


def test_a_file_size_limit_is_a_clear_error_and_leaves_the_previous_checkpoint_intact(tmp_path):
    import resource
    import signal
    import sys

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead

    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_UNDER_LIMIT, str(tmp_path)], capture_output=True, text=True, preexec_fn=limited
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert re.search(
        r"cannot write checkpoint .*epoch-0002 \(.*[Ff]ile too large.*\); free some space", result["error"]
    )
    assert result["latest"].endswith("epoch-0001")
    assert os.listdir(tmp_path / "checkpoints") == ["epoch-0001"], "no half-written checkpoint is left"


def test_a_damaged_newer_checkpoint_is_moved_aside_and_never_outlives_new_saves(tmp_path, caplog):
    model, opt = trained()
    save(tmp_path, state_at(2), model, opt)
    damaged = save(tmp_path, state_at(3), model, opt)
    with open(os.path.join(damaged, "local.npz"), "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, logger="hvd_train"):
        found = checkpoints.latest(str(tmp_path), set_aside=True)
    assert found.path.endswith("epoch-0002")
    [aside] = os.listdir(tmp_path / "checkpoints" / "damaged")
    assert aside.startswith("epoch-0003-") and any("moved it to" in r.message for r in caplog.records)
    # Resumed from epoch 2 with --keep-checkpoints 1: the new save is kept, whatever sorts where.
    written = save(tmp_path, state_at(2, 5), model, opt, keep=1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["damaged", "epoch-0002-step-000005"]
    assert checkpoints.latest(str(tmp_path)).path == written


def test_checkpoints_after_the_one_resumed_from_are_removed_by_the_next_save(tmp_path):
    # A run that resumed from an earlier checkpoint (e.g. its epoch started over) left the
    # later ones behind: they would shadow every new checkpoint on the next resume.
    model, opt = trained()
    for epoch, steps in ((2, 0), (3, 0), (3, 40)):
        save(tmp_path, state_at(epoch, steps), model, opt)
    written = save(tmp_path, state_at(3, 10), model, opt, keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch-0003", "epoch-0003-step-000010"]
    assert checkpoints.latest(str(tmp_path)).path == written


def test_a_checkpoint_written_twice_at_the_same_point_gets_a_new_generation(tmp_path):
    model, opt = trained()
    first = save(tmp_path, state_at(2, 7), model, opt, keep=1)
    second = checkpoints.save(
        str(tmp_path), checkpoints.name_for(state_at(2, 7)), model, opt, state_at(2, 7), {"rows": np.zeros((1, 1))},
        {"note": "again"}, 1,
    )  # fmt: skip
    assert first.endswith("epoch-0002-step-000007") and second.endswith("epoch-0002-step-000007.2")
    found = checkpoints.latest(str(tmp_path))
    assert found.path == second and found.info["note"] == "again"
    assert os.listdir(tmp_path / "checkpoints") == ["epoch-0002-step-000007.2"]


_REWRITE = """
import sys
import numpy as np
from hvd_train.training import checkpoints
from hvd_train.compat import keras
from hvd_train.training.state import TrainState

inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
opt = keras.optimizers.SGD(0.1, momentum=0.9)
opt.build(model.trainable_variables)
state = TrainState(seed=1, world_size=1, batch_size=4, global_batch=4, total=100, epoch=2)
for note in ("first", "second"):
    checkpoints.save(sys.argv[1], "epoch-0002", model, opt, state, {"rows": np.zeros((1, 1))}, {"note": note}, keep=1)
"""


def test_no_save_ever_moves_or_replaces_a_complete_checkpoint(tmp_path):
    # Every rename of two saves at the same point, as the kernel saw them: a crash between
    # any two syscalls must leave a complete checkpoint of that point.
    import sys

    assert shutil.which("strace"), "strace is missing: launch/install.sh installs it with the test extras"
    log = tmp_path / "syscalls"
    proc = subprocess.run(
        ["strace", "-f", "-qq", "-o", log, "-e", "trace=rename,renameat,renameat2", sys.executable, "-c", _REWRITE,
         tmp_path],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rename("a", "b"), renameat(AT_FDCWD, "a", AT_FDCWD, "b"), renameat2(..., 0)
    renames = re.findall(r'rename(?:at2?)?\((?:\w+, )?"([^"]+)", (?:\w+, )?"([^"]+)"', log.read_text())
    folder = str(tmp_path / "checkpoints")
    moved = [(a, b) for a, b in renames if os.path.dirname(a) == folder and checkpoints.order(os.path.basename(a))]
    assert not moved, f"a complete checkpoint was renamed: {moved}"
    replaced = [b for _, b in renames if os.path.dirname(b) == folder and os.path.basename(b) == "epoch-0002"]
    assert len(replaced) == 1, f"epoch-0002 was written {len(replaced)} times"
    assert checkpoints.latest(str(tmp_path)).info["note"] == "second"


@pytest.mark.parametrize("damage", ["flipped digit", "missing key", "read error"])
def test_a_checkpoint_with_a_damaged_state_or_unreadable_files_is_skipped(tmp_path, caplog, damage):
    model, opt = trained()
    save(tmp_path, state_at(1), model, opt)
    newest = save(tmp_path, state_at(1, 9), model, opt)
    state_file = os.path.join(newest, "state.json")
    body = json.loads(open(state_file).read())
    if damage == "flipped digit":  # still valid JSON, still a plausible state
        text = open(state_file).read().replace('"epoch_steps": 9', '"epoch_steps": 8')
        open(state_file, "w").write(text)
    elif damage == "missing key":
        del body["files"]
        body["checksum"] = checkpoints._body_checksum(body)
        open(state_file, "w").write(json.dumps(body))
    else:  # a file whose every read fails with EIO, as on a failing disk: /proc/self/mem at offset 0
        os.remove(os.path.join(newest, "local.npz"))
        os.symlink("/proc/self/mem", os.path.join(newest, "local.npz"))
    with caplog.at_level(logging.WARNING, logger="hvd_train"):
        found = checkpoints.latest(str(tmp_path))
    assert found.path.endswith("epoch-0001")
    assert any("skipping checkpoint" in r.message and "epoch-0001-step-000009" in r.message for r in caplog.records)


def test_state_json_of_version_2_is_still_read(tmp_path):
    model, opt = trained()
    path = save(tmp_path, state_at(1, 3), model, opt)
    state_file = os.path.join(path, "state.json")
    body = json.loads(open(state_file).read())
    body["version"] = 2
    del body["checksum"]
    open(state_file, "w").write(json.dumps(body))
    assert checkpoints.latest(str(tmp_path)).state.epoch_steps == 3


def test_a_checkpoint_that_cannot_be_read_for_a_moment_is_read_again_not_set_aside(tmp_path, caplog):
    import threading

    model, opt = trained()
    save(tmp_path, state_at(1), model, opt)
    newest = save(tmp_path, state_at(1, 9), model, opt)
    # For a moment state.json cannot be read (a directory stands where the file is: every open
    # fails, as on a file server failing over), then it can again.
    state_file = os.path.join(newest, "state.json")
    os.rename(state_file, state_file + ".away")
    os.mkdir(state_file)

    def back():
        os.rmdir(state_file)
        os.rename(state_file + ".away", state_file)

    timer = threading.Timer(0.2, back)
    timer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="hvd_train"):
            found = checkpoints.latest(str(tmp_path), set_aside=True)
    finally:
        timer.join()
    assert found is not None and found.path == newest
    assert not (tmp_path / "checkpoints" / checkpoints.DAMAGED).exists()
    assert any("cannot read checkpoint" in r.message and "reading it again" in r.message for r in caplog.records)
