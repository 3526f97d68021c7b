"""Checkpoints: written atomically by rank 0, verified and found again on resume.

A checkpoint is a folder in ``OUTPUT/checkpoints``: ``epoch-NNNN`` after
``NNNN`` whole epochs, ``epoch-NNNN-step-SSSSSS`` ``SSSSSS`` steps into the
next one (``--checkpoint-every``, or a stop on a signal). It holds

* ``ckpt.*``: a ``tf.train.Checkpoint`` of the model and the optimizer
  (weights, momentum, iteration count);
* ``local.npz``: the values that differ from rank to rank (BatchNorm moving
  statistics while they train, the running sums of the epoch's metrics), one
  row per rank, so a resume with the same workers continues exactly;
* ``state.json``: the ``TrainState`` and the size and CRC32C of every file.

It is written under a temporary name, flushed to disk and renamed when
complete, so a crash mid-write never leaves a checkpoint that looks whole;
one that is damaged later (a disk that filled up, a file cut short) fails
its checksums and is passed over, with a warning, for the one before it. A
save that fails is an error naming the folder and the reason, and leaves
the previous checkpoints as they were.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

import google_crc32c
import numpy as np
import tensorflow as tf

from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.state import TrainState

log = get_logger("checkpoints")

_NAME = re.compile(r"^epoch-(\d{4,})(?:-step-(\d{6,}))?$")
STATE_FILE = "state.json"
LOCAL_FILE = "local.npz"
FORMAT = "hvd_train.checkpoint"
VERSION = 2


@dataclass(frozen=True)
class Found:
    """A complete checkpoint.

    Attributes:
        path: its folder.
        state: the training state it holds.
        info: the rest of ``state.json`` (metrics, world size, ...).
    """

    path: str
    state: TrainState
    info: dict


def folder(output: str) -> str:
    return os.path.join(output, "checkpoints")


def name_for(state: TrainState) -> str:
    """``epoch-NNNN`` at an epoch's end, ``epoch-NNNN-step-SSSSSS`` inside one."""
    if state.epoch_steps == 0:
        return f"epoch-{state.epoch:04d}"
    return f"epoch-{state.epoch:04d}-step-{state.epoch_steps:06d}"


def save(
    output: str,
    name: str,
    model,
    optimizer,
    state: TrainState,
    local: dict[str, np.ndarray],
    info: dict,
    keep: int,
) -> str:
    """Writes checkpoint ``name``; keeps the newest ``keep``.

    Args:
        local: per-rank values, each an array with one row per rank.
        info: more to record in ``state.json`` (JSON-able).

    Returns:
        The checkpoint folder.

    Raises:
        UserError: the checkpoint could not be written (no space, no
            permission); the previous ones are untouched.
    """
    root = folder(output)
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(tmp, "ckpt"))
        with open(os.path.join(tmp, LOCAL_FILE), "wb") as f:
            np.savez(f, **local)
        files = {rel: _digest(os.path.join(tmp, rel)) for rel in sorted(os.listdir(tmp))}
        body = {
            "format": FORMAT,
            "version": VERSION,
            "state": state.to_dict(),
            "files": files,
            "time": time.time(),
            **info,
        }
        _write_synced(os.path.join(tmp, STATE_FILE), (json.dumps(body, indent=1) + "\n").encode())
        _fsync_dir(tmp)
        if os.path.exists(final):
            # Rewriting a name (a rerun of the same epoch): the new one replaces it whole.
            old = os.path.join(root, f".{name}.old-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except (OSError, tf.errors.OpError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        hint = "free some space" if getattr(e, "errno", None) == errno.ENOSPC or "space" in reason else "check it"
        raise UserError(
            f"cannot write checkpoint {final} ({reason}); {hint} or choose another --output. "
            f"The previous checkpoints are intact."
        ) from None
    _prune(root, keep)
    return final


def _digest(path: str) -> dict:
    crc = google_crc32c.Checksum()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"bytes": size, "crc32c": crc.hexdigest().decode()}


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def candidates(output: str) -> list[str]:
    """Checkpoint folders of ``output``, newest first by name (temporaries and strays left out)."""
    root = folder(output)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        if match:
            found.append(((int(match.group(1)), int(match.group(2) or 0)), os.path.join(root, name)))
    return [path for _, path in sorted(found, reverse=True)]


def verify(path: str) -> Found:
    """Reads ``state.json`` and checks every file against its size and CRC32C.

    Raises:
        ValueError: the checkpoint is incomplete or damaged (why, in words).
    """
    try:
        with open(os.path.join(path, STATE_FILE), "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError("no state.json: the write did not finish") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"state.json unreadable: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ValueError(f"state.json is not a {FORMAT} version {VERSION} checkpoint")
    for rel, want in body["files"].items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise ValueError(f"{rel} is missing")
        got = _digest(file)
        if got != want:
            raise ValueError(f"{rel} is damaged ({got['bytes']} bytes, expected {want['bytes']}; checksum mismatch)")
    info = {k: v for k, v in body.items() if k not in ("format", "version", "state", "files")}
    return Found(path, TrainState.from_dict(body["state"]), info)


def latest(output: str) -> Found | None:
    """The newest intact checkpoint of ``output``; damaged ones are passed over with a warning."""
    for path in candidates(output):
        try:
            return verify(path)
        except ValueError as e:
            log.warning("skipping checkpoint %s: %s; using the one before it", path, e)
    return None


def restore(found: Found, model, optimizer) -> dict[str, np.ndarray]:
    """Loads a verified checkpoint into ``model`` and ``optimizer`` (whose variables must exist).

    Returns:
        The per-rank values (``local.npz``).

    Raises:
        UserError: the checkpoint was written for a different model.
    """
    path = found.path
    try:
        status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(os.path.join(path, "ckpt"))
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        reason = str(e).strip().splitlines()[0][:200]
        raise UserError(
            f"checkpoint {path} does not fit this model ({reason}); it was written by a different "
            f"configuration: use a new --output, or --no-resume to start over."
        ) from None
    with np.load(os.path.join(path, LOCAL_FILE)) as f:
        return {k: f[k] for k in f.files}


def _prune(root: str, keep: int) -> None:
    names = candidates(os.path.dirname(root))
    for path in names[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):  # temporaries of crashed writers
        if name.startswith(".") and (".tmp-" in name or ".old-" in name) and not name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
