"""Epoch checkpoints: written atomically by rank 0, found again on resume.

A checkpoint is a folder ``checkpoints/epoch-NNNN`` holding a
``tf.train.Checkpoint`` of the model and the optimizer (weights, momentum,
iteration count, hence the learning rate) and ``state.json``. It is written
under a temporary name and renamed when complete, so a crash mid-write never
leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import tensorflow as tf

from hvd_train.errors import UserError

_NAME = re.compile(r"^epoch-(\d{4,})$")
STATE_FILE = "state.json"


def _folder(output: str) -> str:
    return os.path.join(output, "checkpoints")


def latest(output: str) -> tuple[str, dict] | None:
    """The newest complete checkpoint in ``output`` and its state, if any."""
    folder = _folder(output)
    if not os.path.isdir(folder):
        return None
    found = []
    for name in os.listdir(folder):
        match = _NAME.match(name)
        state_path = os.path.join(folder, name, STATE_FILE)
        if match and os.path.isfile(state_path):
            found.append((int(match.group(1)), os.path.join(folder, name)))
    if not found:
        return None
    _, path = max(found)
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
        return path, json.load(f)


def save(output: str, epoch: int, model, optimizer, state: dict, keep: int) -> str:
    """Writes the checkpoint after ``epoch`` completed epochs; keeps the newest ``keep``.

    Returns:
        The checkpoint folder.
    """
    folder = _folder(output)
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, f"epoch-{epoch:04d}")
    tmp = os.path.join(folder, f".epoch-{epoch:04d}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(tmp, "ckpt"))
    with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
        json.dump({**state, "epoch": epoch, "time": time.time()}, f, indent=2)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _prune(folder, keep)
    return final


def restore(path: str, model, optimizer) -> None:
    """Loads a checkpoint into ``model`` and ``optimizer`` (whose variables must exist).

    Raises:
        UserError: the checkpoint was written for a different model.
    """
    try:
        status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(os.path.join(path, "ckpt"))
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        reason = str(e).strip().splitlines()[0][:200]
        raise UserError(
            f"checkpoint {path} does not fit this model ({reason}); it was written by a different "
            f"configuration: use a new --output, or --no-resume to start over."
        ) from None


def _prune(folder: str, keep: int) -> None:
    epochs = sorted((int(m.group(1)), name) for name in os.listdir(folder) if (m := _NAME.match(name)))
    for _, name in epochs[:-keep]:
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    for name in os.listdir(folder):  # temporaries of crashed writers
        if name.startswith(".epoch-") and ".tmp-" in name and not name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
