"""A run's record in its S3 prefix (``.hvd_train-run.json``), and what records tell of a prefix.

* **The record.** A run keeps in its prefix an id drawn when it starts, and
  every file and checkpoint it uploaded, recorded before the upload begins.
  It deletes nothing the record does not list (pruned checkpoints, an
  earlier form of its model), so what others keep beside it survives; and a
  train refuses a prefix that holds objects but no record, unless they are a
  run written before records were kept. A record that lists what no run
  writes (a checkpoint's file among its files, a hidden name, a checkpoint
  of no checkpoint's name), or a field of another type than a run writes,
  is refused whole: its other entries, which say what may be deleted,
  cannot be trusted either.
* **One writer.** A train writes its own writer (host, pid, time, a random
  part) into the record when it starts, so a second process that takes up
  the run (a second machine that resumed it, two that started it at once)
  always changes the record, even where it adds nothing. Before each write
  of the record, each checkpoint's upload and its manifest, and each delete,
  the record in the prefix is read back: where it is not what this process
  last read or wrote, another process writes the run now, and this one
  stops (``OtherWriter``) before it mixes its files with that one's or
  deletes what that one resumed from.
* **Runs do not nest.** A train refuses a prefix that holds another run's
  record below it, or that lies below one: their staging folders would nest
  as well, and one run's sync would delete or upload the other's files.
* **The staging folder's copy** of the record's id says whose checkpoints it
  holds: a checkpoint of the staging folder is uploaded on resume only when
  it is of the run the prefix holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid

from hvd_train import files
from hvd_train.data import storage
from hvd_train.errors import UserError
from hvd_train.training import checkpoints

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
# The longest part of a key (in UTF-8 bytes) that a staging folder holds: a file system takes 255, and a
# file is written under a temporary name of up to about 100 bytes more (``files.replacing``).
MAX_PART_BYTES = 150


class OtherWriter(UserError):
    """Another process writes the run's record: a run in S3 has one writer at a time."""


def bad_part(rel: str) -> str:
    """Why ``rel`` cannot be a relative path inside a folder ("" when it can): the rule for the prefix's keys
    and for the names a record lists."""
    if "\0" in rel:
        return "holds a NUL character"
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' part"
    if any(len(part.encode("utf-8", "surrogateescape")) > MAX_PART_BYTES for part in parts):
        return f"has a part longer than {MAX_PART_BYTES} bytes"
    return ""


@dataclasses.dataclass
class Record:
    """What a run uploaded to its prefix.

    Attributes:
        run: drawn when the run starts (a fresh prefix, or ``--no-resume``); the same on every resume.
        files: paths below the prefix of the files it uploaded outside ``checkpoints/``.
        checkpoints: names of the checkpoints it uploaded, whole or in part.
        writer: the process that writes the run now (``writer``); "" in a record of an earlier hvd_train.
    """

    run: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    files: set[str] = dataclasses.field(default_factory=set)
    checkpoints: set[str] = dataclasses.field(default_factory=set)
    writer: str = ""

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "run": self.run,
            "writer": self.writer,
            "files": sorted(self.files),
            "checkpoints": sorted(self.checkpoints),
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Record:
        """The record in ``data`` (the object ``where``).

        Raises:
            UserError: it is not a record this hvd_train reads, or it lists a name no run writes.
        """
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT or body.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} of version {VERSION}")
            if not isinstance(body["run"], str) or not body["run"]:
                raise ValueError("its run id is no string")
            for field in ("files", "checkpoints"):
                if not isinstance(body[field], list) or not all(isinstance(rel, str) for rel in body[field]):
                    raise ValueError(f"its {field!r} is no list of names")
            if not isinstance(body.get("writer", ""), str):
                raise ValueError("its writer is no string")
            record = cls(body["run"], set(body["files"]), set(body["checkpoints"]), body.get("writer", ""))
            for rel in [*record.files, *record.checkpoints]:
                if bad_part(rel):
                    raise ValueError(f"it lists {rel!r}")
            for rel in record.files:  # what _local_files gives: checkpoints and hidden files aside
                if rel.startswith(CHECKPOINTS) or any(part.startswith(".") for part in rel.split("/")):
                    raise ValueError(f"it lists {rel!r} among its files, which no run uploads as one")
            for name in record.checkpoints:
                if "/" in name or not checkpoints.order(name):
                    raise ValueError(f"it lists {name!r} among its checkpoints, which is no checkpoint's name")
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


def nested_runs(keys) -> list[str]:
    """The folders below a prefix (``sub/``) that hold another run, by its record: ``keys`` is the listing."""
    return sorted(rel[: -len(RECORD)] for rel in keys if rel.endswith("/" + RECORD))


def nesting(keys, store: storage.S3Store) -> UserError | None:
    """Why a train must not write to ``store``'s prefix, which holds ``keys``, for the runs around it: one
    below it (a record in ``keys``) or one it lies in (a record in a parent prefix, one HEAD each); None
    where no run is. A HEAD the credentials may not make (403) finds none: a policy may end at the prefix.
    Runs that an earlier hvd_train let nest are told how to move the inner one out, so that both resume."""
    url = store.url
    below = nested_runs(keys)
    if below:
        out = f"{url.rstrip('/')}-{below[0].rstrip('/').replace('/', '-')}/"
        return UserError(
            f"--output {url} holds another run, in {url}{below[0]} (its {RECORD}): runs in S3 may not nest, as "
            f"one run's uploads and deletes would meet the other's files; give --output a prefix beside it, "
            f"e.g. {url.rstrip('/')}-2/, or, to resume both (an earlier hvd_train let them nest), move the inner "
            f"one out (aws s3 mv --recursive {url}{below[0]} {out}) and resume it with --output {out}."
        )
    parts = store.prefix.rstrip("/").split("/")
    for depth in range(len(parts) - 1, 0, -1):
        parent = "/".join(parts[:depth]) + "/"
        try:
            store.client.head_object(Bucket=store.bucket, Key=parent + RECORD)
        except Exception as e:
            if storage.error_code(e) in ("404", "NoSuchKey", "NotFound", "403", "AccessDenied"):
                continue
            raise store.error(e, "read", parent + RECORD, "--output") from None
        outer = f"s3://{store.bucket}/{parent}"
        out = f"s3://{store.bucket}/{parent.rstrip('/')}-{'-'.join(parts[depth:])}/"
        return UserError(
            f"--output {url} is inside the run in {outer} (its {RECORD}): runs in S3 may not nest, as one run's "
            f"uploads and deletes would meet the other's files; give --output a prefix outside it, e.g. {out}, "
            f"or, to resume this run (an earlier hvd_train let it start there), move it out (aws s3 mv "
            f"--recursive {url} {out}) and resume it with --output {out}."
        )
    return None


def writer() -> str:
    """A writer of a run, for its record: this process (host, pid, when), and a random part, drawn anew at each
    start (``Mirror.check``): no other start, on any machine, writes the same."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"{socket.gethostname()} pid {os.getpid()} from {when} #{uuid.uuid4().hex[:8]}"


def same_as_written(store: storage.S3Store, last: bytes, tried=()) -> str:
    """Checks that the record in the prefix is ``last`` (what this process last read or wrote; ``b""``: none)
    or one of ``tried`` (writes of this process whose answer was lost); returns its ETag ("": none).

    Raises:
        OtherWriter: another process wrote it.
    """
    try:
        got = store.client.get_object(Bucket=store.bucket, Key=store.key(RECORD))
        now, etag = got["Body"].read(), got.get("ETag", "")
    except Exception as e:
        if storage.error_code(e) not in ("404", "NoSuchKey", "NotFound"):
            raise store.error(e, "read", store.key(RECORD), "--output") from None
        now, etag = b"", ""
    if now == last or now in tried:
        return etag
    if not now:
        raise OtherWriter(
            f"{store.url}{RECORD} was deleted since this process read it (by another process, or by hand): this one "
            f"stops rather than write a run whose record is gone; check what writes to {store.url}, then rerun this "
            f"command to resume the run."
        )
    raise OtherWriter(
        f"another process{_who(now)} wrote {store.url}{RECORD} since this one read it: that process writes the "
        f"run in {store.url} now (a second machine resumed it, a requeued job's earlier one still ran, or two "
        f"started it at once) and goes on, and this one stops rather than mix its files with that one's; let "
        f"that one finish (or stop it), then rerun this command to resume the run (or give each run a prefix "
        f"of its own)."
    )


def _who(record: bytes) -> str:
    """`` (its writer)`` as a record names it, for messages; "" where it names none."""
    try:
        named = json.loads(record).get("writer")
    except (ValueError, AttributeError):
        return ""
    shown = isinstance(named, str) and named and named.isprintable() and len(named) < 200  # anyone's bytes
    return f" ({named})" if shown else ""


def read_staged(staging: str) -> str | None:
    """The run id of the staging folder's checkpoints (its copy of the record), or None."""
    copy = files.read_json(os.path.join(staging, RECORD), {})
    return copy.get("run") if isinstance(copy, dict) else None


def mark_staged(staging: str, run: str | None) -> None:
    """The staging folder's checkpoints are of run ``run`` (None: the copy of a command that reads a run). The
    copy also marks the folder as a staging folder, which another's, around it, passes over."""
    os.makedirs(staging, exist_ok=True)
    files.write_json(os.path.join(staging, RECORD), {"run": run})
