"""Checkpoints: written atomically by rank 0, verified and found again on resume.

A checkpoint is a folder in ``OUTPUT/checkpoints``: ``epoch-NNNN`` after
``NNNN`` whole epochs, ``epoch-NNNN-step-SSSSSS`` ``SSSSSS`` steps into the
next one (``--checkpoint-every``, or a stop on a signal). It holds

* ``ckpt.*``: a ``tf.train.Checkpoint`` of the model and the optimizer
  (weights, momentum, iteration count);
* ``local.npz``: the values that differ from rank to rank (BatchNorm moving
  statistics while they train, the running sums of the epoch's metrics), one
  row per rank, so a resume with the same workers continues exactly;
* ``state.json``: the ``TrainState``, the digests of the image lists it was
  made with, the size and CRC32C of every other file, and a CRC32C of its
  own contents.

It is written under a temporary name, flushed to disk and renamed when
complete, so a crash mid-write never leaves a checkpoint that looks whole.
A name is never written twice: a second checkpoint at the same point (a
rerun that stops where the last one did) gets the next generation,
``epoch-NNNN-step-SSSSSS.2``, which sorts after the first; so no rename ever
replaces or sets aside a complete checkpoint. One that is damaged later (a
disk that filled up, a file cut short, a flipped digit) fails its checksums;
the resume moves it to ``checkpoints/damaged/`` with a warning and takes the
one before it. A save that fails is an error naming the folder and the
reason, and leaves the previous checkpoints as they were. Pruning to
``--keep-checkpoints`` never removes the checkpoint just written; the ones
that sort after it belong to a course the run no longer follows (it resumed
from an earlier one) and are removed first.
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

from hvd_train.errors import UserError, first_line
from hvd_train.files import plain_name
from hvd_train.log import get_logger
from hvd_train.training.state import TrainState

log = get_logger("checkpoints")

_NAME = re.compile(r"^epoch-(\d{4,})(?:-step-(\d{6,}))?(?:\.(\d+))?$")
STATE_FILE = "state.json"
LOCAL_FILE = "local.npz"
DAMAGED = "damaged"
FORMAT = "hvd_train.checkpoint"
VERSION = 3
# Version 2 (before state.json carried its own checksum and the data digests) is still read.
READABLE_VERSIONS = (2, 3)


@dataclass(frozen=True)
class Found:
    """A complete checkpoint.

    Attributes:
        path: its folder.
        state: the training state it holds.
        info: the rest of ``state.json`` (metrics, world size, data digests, ...).
    """

    path: str
    state: TrainState
    info: dict


def folder(output: str) -> str:
    return os.path.join(output, "checkpoints")


def name_for(state: TrainState) -> str:
    """``epoch-NNNN`` at an epoch's end, ``epoch-NNNN-step-SSSSSS`` inside one."""
    if state.epoch_steps == 0:
        return epoch_end_name(state.epoch)
    return f"epoch-{state.epoch:04d}-step-{state.epoch_steps:06d}"


def epoch_end_name(epochs: int) -> str:
    """The name of the checkpoint written after ``epochs`` whole epochs (its first generation)."""
    return f"epoch-{epochs:04d}"


def order(name: str) -> tuple[int, int, int] | None:
    """Where checkpoint ``name`` sorts: (epoch, step, generation); None for other names."""
    match = _NAME.match(name)
    if not match:
        return None
    return int(match.group(1)), int(match.group(2) or 0), int(match.group(3) or 1)


def _free_name(root: str, name: str) -> str:
    """``name``, or its next generation (``name.2``, ...) when a checkpoint of that name exists."""
    generations = [
        place[2]
        for other in (os.listdir(root) if os.path.isdir(root) else [])
        if (other == name or other.startswith(name + ".")) and (place := order(other))
    ]
    return f"{name}.{max(generations) + 1}" if generations else name


def save(
    output: str,
    name: str,
    model,
    optimizer,
    state: TrainState,
    local: dict[str, np.ndarray],
    info: dict,
    keep: int,
    extra: str | None = None,
) -> str:
    """Writes checkpoint ``name`` (or its next generation); keeps the newest ``keep``.

    Args:
        local: per-rank values, each an array with one row per rank.
        info: more to record in ``state.json`` (JSON-able).
        extra: a folder whose files move into the checkpoint (the sharded head's), digested like the rest.

    Returns:
        The checkpoint folder.

    Raises:
        UserError: the checkpoint could not be written (no space, no
            permission); the previous ones are untouched.
    """
    from hvd_train.compat import tf  # here, not above: the S3 mirror reads checkpoints before TensorFlow may load

    root = folder(output)
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        final = os.path.join(root, _free_name(root, name))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(tmp, "ckpt"))
        with open(os.path.join(tmp, LOCAL_FILE), "wb") as f:
            np.savez(f, **local)
        for file in sorted(os.listdir(extra)) if extra else ():
            os.rename(os.path.join(extra, file), os.path.join(tmp, file))
        files = {rel: _digest(os.path.join(tmp, rel)) for rel in sorted(os.listdir(tmp))}
        body = {
            "format": FORMAT,
            "version": VERSION,
            "state": state.to_dict(),
            "files": files,
            "time": time.time(),
            **info,
        }
        body["checksum"] = _body_checksum(body)
        _write_synced(os.path.join(tmp, STATE_FILE), (json.dumps(body, indent=1) + "\n").encode())
        _fsync_dir(tmp)
        # The only rename: a new name, so no complete checkpoint is ever replaced or moved.
        os.rename(tmp, final)
        _fsync_dir(root)
        if extra:
            shutil.rmtree(extra, ignore_errors=True)
    except (OSError, tf.errors.OpError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if extra:
            shutil.rmtree(extra, ignore_errors=True)
        reason = _reason(e)
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
            os.strerror(code) in reason for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        )
        hint = "free some space" if full else "check it"
        raise UserError(
            f"cannot write checkpoint {final} ({reason}); {hint} or choose another --output. "
            f"The previous checkpoints are intact."
        ) from None
    # --early-stop: the best epoch's checkpoint is the model the run will save.
    best = epoch_end_name(state.best_epoch + 1) if state.best_epoch >= 0 else None
    _prune(root, final, keep, best)
    return final


def _reason(e: Exception) -> str:
    """Why a write failed, in the words of the OS: an OSError's, or the text inside TensorFlow's."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return first_line(e)


def _body_checksum(body: dict) -> str:
    """CRC32C of ``body`` without its checksum, as canonical JSON: a flipped digit anywhere shows."""
    canonical = json.dumps({k: v for k, v in body.items() if k != "checksum"}, sort_keys=True).encode()
    return google_crc32c.Checksum(canonical).hexdigest().decode()


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
    found = [(place, os.path.join(root, name)) for name in os.listdir(root) if (place := order(name))]
    return [path for _, path in sorted(found, reverse=True)]


class Unreadable(ValueError):
    """A file of the checkpoint could not be read: maybe damage, maybe a passing fault (NFS)."""


# Seconds between the reads of a checkpoint that could not be read, before it counts as damaged.
READ_RETRIES = (0.5, 1.0, 2.0)


def verify(path: str) -> Found:
    """Reads ``state.json``, checks its own checksum and every file against its size and CRC32C.

    The files it names must be plain names in ``path`` (as ``save`` writes them): a manifest that came from
    elsewhere (an S3 prefix) and names ``../x`` or ``/etc/x`` makes the checkpoint damaged, read no further.

    Raises:
        ValueError: the checkpoint is incomplete, damaged or unreadable (why, in words).
    """
    try:
        with open(os.path.join(path, STATE_FILE), "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError("no state.json: the write did not finish") from None
    except OSError as e:
        raise Unreadable(f"state.json unreadable ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"state.json is not JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"state.json is not a {FORMAT} of version {' or '.join(map(str, READABLE_VERSIONS))}")
    if body["version"] >= 3 and body.get("checksum") != _body_checksum(body):
        raise ValueError("state.json is damaged (its checksum does not match its contents)")
    try:
        for rel, want in body["files"].items():
            if not plain_name(rel):  # save() writes plain names; a manifest from elsewhere may name any path
                raise ValueError(f"state.json names {rel!r}, which is no file of a checkpoint's folder")
            file = os.path.join(path, rel)
            if not os.path.isfile(file):
                raise ValueError(f"{rel} is missing")
            try:
                got = _digest(file)
            except OSError as e:
                raise Unreadable(f"{rel} unreadable ({e.strerror or e})") from None
            if got != want:
                raise ValueError(
                    f"{rel} is damaged ({got['bytes']} bytes, expected {want['bytes']}; checksum mismatch)"
                )
        state = TrainState.from_dict(body["state"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"state.json lacks or garbles {e}") from None
    skip = ("format", "version", "state", "files", "checksum")
    return Found(path, state, {k: v for k, v in body.items() if k not in skip})


def latest(output: str, set_aside: bool = False) -> Found | None:
    """The newest intact checkpoint of ``output``; damaged ones are passed over with a warning.

    Args:
        set_aside: move damaged checkpoints to ``checkpoints/damaged/``
            (the run that resumes does, so that they never count again:
            neither for a later resume nor for pruning).
    """
    for path in candidates(output):
        try:
            return verify_again_if_unreadable(path)
        except ValueError as e:
            moved = _set_aside(path) if set_aside else None
            log.warning(
                "skipping checkpoint %s: %s; %susing the one before it",
                path,
                e,
                f"moved it to {moved}; " if moved else "",
            )
    return None


def verify_again_if_unreadable(path: str) -> Found:
    """``verify``, read again after ``READ_RETRIES`` where a read failed: a file server that
    fails over or a network that drops for a moment must not cost the newest checkpoint."""
    for delay in READ_RETRIES:
        try:
            return verify(path)
        except Unreadable as e:
            log.warning("cannot read checkpoint %s: %s; reading it again in %g s", path, e, delay)
            time.sleep(delay)
    return verify(path)


def _set_aside(path: str) -> str | None:
    """Moves a damaged checkpoint into ``checkpoints/damaged/``; returns where (None if it cannot)."""
    aside = os.path.join(os.path.dirname(path), DAMAGED)
    target = os.path.join(aside, f"{os.path.basename(path)}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.makedirs(aside, exist_ok=True)
        os.rename(path, target)
        return target
    except OSError as e:
        log.warning("cannot move the damaged checkpoint %s aside (%s)", path, e.strerror or e)
        return None


def remove_all(output: str) -> int:
    """Deletes every checkpoint of ``output`` (``--no-resume``, once training starts); returns how many."""
    paths = candidates(output)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return len(paths)


def restore(found: Found, model, optimizer, partial: bool = False) -> dict[str, np.ndarray]:
    """Loads a verified checkpoint into ``model`` and ``optimizer`` (whose variables must exist).

    ``partial``: the optimizer may hold values the checkpoint has elsewhere (a sharded head's slots, in
    ``head.*.npy``); something must still match.

    Returns:
        The per-rank values (``local.npz``).

    Raises:
        UserError: the checkpoint was written for a different model.
    """
    from hvd_train.compat import tf

    path = found.path
    try:
        status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(os.path.join(path, "ckpt"))
        if partial:
            status.assert_nontrivial_match().expect_partial()
        else:
            status.assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        reason = first_line(e, limit=200)
        raise UserError(
            f"checkpoint {path} does not fit this model ({reason}); it was written by a different "
            f"configuration: use a new --output, or --no-resume to start over."
        ) from None
    with np.load(os.path.join(path, LOCAL_FILE)) as f:
        return {k: f[k] for k in f.files}


def of_epoch_end(output: str, epochs: int) -> Found | None:
    """The newest intact checkpoint written after ``epochs`` whole epochs (any generation), or None."""
    want = order(epoch_end_name(epochs))[:2]
    for path in candidates(output):
        if order(os.path.basename(path))[:2] == want:
            try:
                return verify_again_if_unreadable(path)
            except ValueError as e:
                log.warning("skipping checkpoint %s: %s", path, e)
    return None


def _prune(root: str, written: str, keep: int, best: str | None = None) -> None:
    """Keeps ``written`` and the newest ``keep - 1`` checkpoints before it; removes the rest.

    Checkpoints that sort after ``written`` are from before a resume that
    went back to an earlier one: the run left that course, and they would
    shadow every new checkpoint on the next resume. ``best`` (a name
    without its generation) keeps its newest generation before ``written``.
    """
    names = candidates(os.path.dirname(root))
    newer = names[: names.index(written)] if written in names else []
    older = names[names.index(written) + 1 :] if written in names else []
    for path in newer:
        log.info("removing checkpoint %s: it is from before the resume to an earlier one", path)
    if best is not None:
        kept = [path for path in older if order(os.path.basename(path))[:2] == order(best)[:2]][:1]
        older = [path for path in older if path not in kept]
    for path in newer + older[max(0, keep - 1) :]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):  # temporaries of crashed writers
        if name.startswith(".") and (".tmp-" in name or ".old-" in name) and not name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
