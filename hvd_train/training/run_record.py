"""A run's record in its S3 prefix (``.hvd_train-run.json``): what of the prefix is the run's.

* **The record.** A run keeps in its prefix an id drawn when it starts, and
  every file and checkpoint it uploaded, recorded before the upload begins.
  It deletes nothing the record does not list (pruned checkpoints, an
  earlier form of its model), so what others keep beside it survives; and a
  train refuses a prefix that holds objects but no record, unless they are a
  run written before records were kept.
* **The staging folder's copy** of the record's id says whose checkpoints it
  holds: a checkpoint of the staging folder is uploaded on resume only when
  it is of the run the prefix holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

from hvd_train import files
from hvd_train.errors import UserError

CHECKPOINTS = "checkpoints/"
RECORD = ".hvd_train-run.json"
FORMAT = "hvd_train.run-in-s3"
VERSION = 1
# Keys of the prefix that are no object of anyone's: the write test of an earlier hvd_train's check that
# died before its delete.
_PROBE = ".write-test-"
# What a run writes from its first epoch on: a prefix holding one of these, and no record, is a run
# written before records were kept.
_EARLIER_RUN = ("run_config.yaml", "summary.json")


class _Checkpoints:
    """``training.checkpoints``, imported when first used: ``remote.stage`` runs before TensorFlow may load."""

    def __getattr__(self, name: str):
        from hvd_train.training import checkpoints as module

        return getattr(module, name)


checkpoints = _Checkpoints()


def bad_part(rel: str) -> str:
    """Why ``rel`` cannot be a relative path inside a folder ("" when it can): the rule for the prefix's keys
    and for the names a record lists."""
    if "\0" in rel:
        return "holds a NUL character"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' part"
    return ""


@dataclasses.dataclass
class Record:
    """What a run uploaded to its prefix.

    Attributes:
        run: drawn when the run starts (a fresh prefix, or ``--no-resume``); the same on every resume.
        files: paths below the prefix of the files it uploaded outside ``checkpoints/``.
        checkpoints: names of the checkpoints it uploaded, whole or in part.
    """

    run: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    files: set[str] = dataclasses.field(default_factory=set)
    checkpoints: set[str] = dataclasses.field(default_factory=set)

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "run": self.run,
            "files": sorted(self.files),
            "checkpoints": sorted(self.checkpoints),
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Record:
        """The record in ``data`` (the object ``where``).

        Raises:
            UserError: it is not a record this hvd_train reads.
        """
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT or body.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} of version {VERSION}")
            record = cls(str(body["run"]), set(body["files"]), set(body["checkpoints"]))
            for rel in [*record.files, *record.checkpoints]:
                if not isinstance(rel, str) or bad_part(rel):
                    raise ValueError(f"it lists {rel!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(
                f"{where} is not the record of an hvd_train run ({e}); if the prefix holds nothing but that run, "
                f"delete it (the run's files stay and are kept from then on), or give --output another prefix."
            ) from None
        return record


def foreign(keys, url: str) -> UserError | None:
    """Why a train must not write to the prefix ``url`` that holds ``keys`` and no record; None where it may.

    It may when the prefix holds nothing (but folder markers and stale write tests) or a run written before
    records were kept: ``run_config.yaml`` or ``summary.json`` at its top (a run uploads the first with its
    first checkpoint).
    """
    objects = sorted(rel for rel in keys if not rel.startswith(_PROBE))
    if not objects or any(rel in _EARLIER_RUN for rel in objects):
        return None
    shown = ", ".join(objects[:3]) + (", ..." if len(objects) > 3 else "")
    return UserError(
        f"--output {url} holds {len(objects)} object(s) that are not an hvd_train run's ({shown}; no {RECORD}): "
        f"a run deletes from its prefix what it no longer needs, so it writes only to an empty prefix or one of "
        f"its own; give --output a prefix of its own, e.g. {url}hvd-run/."
    )


def read_staged(staging: str) -> str | None:
    """The run id of the staging folder's checkpoints (its copy of the record), or None."""
    copy = files.read_json(os.path.join(staging, RECORD), {})
    return copy.get("run") if isinstance(copy, dict) else None


def mark_staged(staging: str, record: Record) -> None:
    """The staging folder's checkpoints are of ``record``'s run."""
    os.makedirs(staging, exist_ok=True)
    files.write_json(os.path.join(staging, RECORD), {"run": record.run})
