"""Where a run in S3 is staged on this machine, and which process holds the staging folder.

* **Its name.** The staging folder is named after the prefix,
  ``$HVD_TRAIN_CACHE/runs/[HOST:PORT/]BUCKET/PREFIX`` (the host of
  ``--s3-endpoint``: two stores may each hold a bucket of one name); the
  commands that read a run keep their copy in ``read/`` instead, apart from
  a training's. A bucket is a folder's name too, so it is checked, and a
  ``?`` or ``#`` (which would cut the prefix short), or credentials before
  the bucket, refused.
* **One process holds it.** A staging folder is rewritten by the process
  that stages the run (a resume makes it a copy of the prefix, removing
  what the prefix lacks), so a process holds a lock on it (``flock`` of its
  ``.hvd_train-lock``) from its first use to its end. A training whose
  folder another process on the machine holds (the same command launched
  twice, a requeued job whose earlier one still runs) stops before it
  changes anything, here or in the prefix. A command that reads a run takes
  the next copy no process holds (``read+1/``, ``read+2/``...) instead: none
  removes the files another has not uploaded yet, and none waits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import urllib.parse

from hvd_train import files
from hvd_train.data import storage
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.training.run_record import RECORD

log = get_logger("output")

LOCK = ".hvd_train-lock"
_held: dict[str, int] = {}  # the real path of a staging folder -> its lock's descriptor (-1: none), held here


# A bucket's name as a folder's: what S3 and the stores like it allow, and never "." or "..".
_BUCKET = re.compile(r"[A-Za-z0-9._-]+")


def staging_folder(url: str, endpoint: str = "", flag: str = "--output", kind: str = "runs") -> str:
    """The local folder the run in the S3 prefix ``url`` is staged in: ``$HVD_TRAIN_CACHE/runs/BUCKET/PREFIX``,
    with ``HOST:PORT/`` before the bucket for a store at ``endpoint`` (``--s3-endpoint``: two stores may each
    hold a bucket of one name). ``kind``: ``runs`` for a training's, ``read`` (``read+1``...: ``for_reading``)
    for a copy of the commands that read a run, which never rewrites a training's staging folder.

    Raises:
        UserError: ``url`` (the value of ``flag``) names no bucket and prefix that a folder can be named after.
    """
    parts = urllib.parse.urlsplit(url)
    segments = parts.path.strip("/").split("/")
    shown = storage.redact_url(url)
    if "?" in url or "#" in url:
        raise UserError(
            f"{flag} {shown} holds a '?' or '#', which would cut the prefix short; name the prefix without "
            "them, e.g. s3://my-bucket/runs/flowers."
        )
    if parts.username is not None or parts.password is not None:  # never shown, not even in part
        raise UserError(
            f"{flag} holds user:password@ before its bucket (shown without it: {shown}): S3 credentials never go "
            f"in a URL, they come from the AWS chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, an "
            f"instance role); give {flag} {shown}."
        )
    bucket = parts.netloc
    if (
        not _BUCKET.fullmatch(bucket)
        or bucket in (".", "..")
        or not parts.path.strip("/")
        or any(s in ("", ".", "..") for s in segments)
    ):
        raise UserError(
            f"{flag} {shown} must name a bucket and a prefix: a bucket of letters, digits, '.', '-' or '_', a "
            "prefix without empty, '.' or '..' parts, e.g. s3://my-bucket/runs/flowers."
        )
    store = []
    if endpoint:
        at = urllib.parse.urlsplit(endpoint)
        store = [f"{at.hostname or 'endpoint'}:{at.port or (443 if at.scheme == 'https' else 80)}"]
    return os.path.join(files.cache_base(), kind, *store, bucket, *segments)


def earlier(url: str, endpoint: str) -> str:
    """Where an hvd_train before the store's host was in the staging folder's name staged the run in ``url`` of
    the store at ``endpoint`` (``--s3-endpoint``): ``runs/BUCKET/PREFIX``; "" without ``endpoint``, whose
    staging folder that is now too."""
    return staging_folder(url) if endpoint else ""


def move_in(source: str, target: str) -> None:
    """Everything of the staging folder ``source`` (checkpoints, files, its copy of the record) moved into the
    staging folder ``target``, on the same file system; other staging folders inside ``source`` (of a run of a
    prefix below) stay where they are."""
    for folder, dirs, names in os.walk(source):
        dirs[:] = [d for d in dirs if not os.path.exists(os.path.join(folder, d, RECORD))]
        into = os.path.join(target, os.path.relpath(folder, source))
        os.makedirs(into, exist_ok=True)
        for name in names:
            if name != LOCK:
                os.replace(os.path.join(folder, name), os.path.join(into, name))
    for folder, _, _ in os.walk(source, topdown=False):
        with contextlib.suppress(OSError):  # one that is not empty (the lock's, another staging folder's) stays
            os.rmdir(folder)


def hold(folder: str, url: str) -> None:
    """This process holds the staging folder ``folder`` of the run in ``url`` (``--output``) until it ends.

    Raises:
        UserError: another process of this machine holds it.
    """
    if not take(folder):
        raise UserError(
            f"the staging folder {folder} of --output {url.rstrip('/')} is used by another process of this "
            f"machine (the same run started twice, or a requeued job whose earlier one still runs), which would "
            f"lose what it has not uploaded yet; let that one end (or stop it), then rerun this command."
        )


def for_reading(url: str, endpoint: str = "", flag: str = "--model-dir") -> str:
    """The folder a command that reads the run in ``url`` copies it into, held by this process until it ends:
    ``read/...``, or where another process of this machine holds that one, ``read+1/...``, ``read+2/...``."""
    for slot in itertools.count():
        folder = staging_folder(url, endpoint, flag, kind=f"read+{slot}" if slot else "read")
        if take(folder):
            return folder
    raise AssertionError("unreachable")


def take(folder: str) -> bool:
    """Whether this process holds ``folder`` (made where it is not there), or now takes it; False where another
    process holds it. A file system without locks (some network ones) holds nothing: a warning says so."""
    key = os.path.realpath(folder)
    if key in _held:
        return True
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(
            f"cannot write to the staging folder {folder} ({e.strerror or e}); set HVD_TRAIN_CACHE to a folder "
            f"that can be written."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        log.warning("cannot lock the staging folder %s (%s): another process may use it too", folder, e.strerror)
        fd = -1
    _held[key] = fd  # closed, and the lock with it, when the process ends
    return True
