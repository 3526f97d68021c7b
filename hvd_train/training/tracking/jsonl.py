"""``--track jsonl``: rank 0 appends the run's events to a file, one JSON object a line; nothing to install.

Every event has ``event``, ``time`` (seconds since 1970), ``project``
(``--tracker-project``) and ``run`` (``--tracker-run``, else the output
folder's name):

- ``start``: ``resumed`` (the run went on from a checkpoint) and ``params``,
  the resolved configuration as ``section.option``, as ``run_config.yaml``
  has it (credentials left out);
- ``epoch``: ``step`` (the epoch, from 1) and ``metrics``, its numbers as
  metrics.csv has them;
- ``finish``: ``results``, the final numbers of summary.json, and
  ``files``, the run's files there (``curves.png``, ``model.keras``, ...);
- ``stopped``: a stop signal ended the run on a checkpoint (a resume goes on);
- ``failed``: ``error``, the first line of what ended the run.

A number that is not finite (a diverged epoch's loss) is ``null``.

The file is ``--tracker-uri``: a path relative to the output folder (by
default ``tracking.jsonl`` there), which must stay inside it, or an
absolute path, which the user chose. For an S3 ``--output`` the output
folder is its staging folder, mirrored to the prefix as every file of the
run. A resumed run appends to the same file. Each event is one write to
the file opened for appending, so runs that share a file (a sweep's trials
given one absolute path) do not cut into each other's lines. Once training
runs, a write that fails is a warning: the run's own files hold everything.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger
from hvd_train.training.tracking.base import ARTEFACTS, Tracker, final, flat_config, numbers

log = get_logger("track")

DEFAULT_FILE = "tracking.jsonl"


class JsonlTracker(Tracker):
    """Rank 0's file of events (see the module docstring)."""

    name = "jsonl"
    sweep_names = True

    def __init__(self, path: str, output: str, project: str, run_name: str):
        self.path = path
        self.output = output
        self.project = project
        self.run_name = run_name

    @classmethod
    def start(cls, cfg, resumed: bool) -> JsonlTracker:
        """The run's file found (``file_of``) and its ``start`` event appended.

        Raises:
            UserError: the path leaves the output folder, or the file cannot be written (one line).
        """
        run = cfg.run
        path = file_of(run.tracker_uri, run.output)
        name = run.tracker_run or os.path.basename(os.path.abspath(run.output))
        tracker = cls(path, run.output, run.tracker_project, name)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tracker._append("start", resumed=resumed, params=flat_config(cfg))
        except OSError as e:
            raise UserError(
                f"cannot write the tracking file {path} ({e.strerror or e}); give --tracker-uri a file that can be "
                "written."
            ) from None
        log.info("tracking the run in %s", path)
        return tracker

    @classmethod
    def prepare_sweep(cls, uri: str, project: str) -> None:
        """The base's ``tracker_uri`` checked as far as it can be without a trial's folder (``_given``)."""
        _given(uri)

    def log_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        self._write("epoch", step=epoch, metrics=numbers(logs))

    def finish(self, summary: dict[str, Any]) -> None:
        there = [name for name in ARTEFACTS if os.path.isfile(os.path.join(self.output, name))]
        self._write("finish", results=final(summary), files=there)

    def stopped(self) -> None:
        self._write("stopped")

    def failed(self, error: BaseException | None = None) -> None:
        self._write("failed", **({} if error is None else {"error": first_line(error)}))

    def _write(self, event: str, **fields: Any) -> None:
        """``_append``, a failure a warning (the run's own files hold everything)."""
        try:
            self._append(event, **fields)
        except OSError as e:
            log.warning("could not write the %s event to %s: %s", event, self.path, e.strerror or e)

    def _append(self, event: str, **fields: Any) -> None:
        """One line, in one write to the file opened for appending."""
        record = {"event": event, "time": round(time.time(), 3), "project": self.project, "run": self.run_name}
        line = json.dumps(_finite({**record, **fields}), allow_nan=False, default=str) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, line.encode("utf-8"))
        finally:
            os.close(fd)


# Folders of the output that the run replaces or prunes (checkpoints, TensorBoard's, its HParams'): a file of the
# user's there would be lost.
_RUNS_OWN = ("checkpoints", "tensorboard")


def file_of(uri: str, output: str) -> str:
    """The tracking file of ``--tracker-uri`` ``uri`` for a run in ``output``: an absolute path as it is; a
    relative one (``tracking.jsonl`` when empty) in ``output``, links followed, which it must not leave.

    Raises:
        UserError: ``uri`` is a URI, or leaves ``output`` (one line).
    """
    _given(uri)
    if os.path.isabs(uri):
        return uri
    root = os.path.realpath(output)
    path = os.path.realpath(os.path.join(root, uri or DEFAULT_FILE))
    if os.path.commonpath([root, path]) != root or path == root:
        raise _outside(uri, output)
    parts = os.path.relpath(path, root).split(os.sep)
    if parts[0] in _RUNS_OWN or any(part.startswith(".") for part in parts):
        raise UserError(
            f"--tracker-uri {uri}: {'/'.join(parts)} is where the run keeps its own files (checkpoints/, "
            "tensorboard/, hidden names), which it replaces and does not copy to an S3 --output; give another "
            f"path, or leave it out for {DEFAULT_FILE}."
        )
    return path


def _given(uri: str) -> None:
    """Refuses a ``--tracker-uri`` no run can take: a URI (another tracker's), or a relative path that
    climbs out of the output folder (``..``).

    Raises:
        UserError: one line.
    """
    if "://" in uri:
        raise UserError(
            f"--track jsonl writes a file, and --tracker-uri {uri} is a URI: give a path (relative to --output, "
            f"or absolute), or leave it out for {DEFAULT_FILE} in --output."
        )
    if not os.path.isabs(uri) and os.path.normpath(uri or DEFAULT_FILE).split(os.sep)[0] == os.pardir:
        raise _outside(uri, "given as --output")


def _outside(uri: str, output: str) -> UserError:
    return UserError(
        f"--tracker-uri {uri} leaves the output folder {output}: a relative path is taken inside it; give one "
        "that stays there, or an absolute path."
    )


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite made None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
