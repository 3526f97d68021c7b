"""The S3 prefix of a run: what it may hold, what of it is the run's, and its files moved to and from the
staging folder one by one (``Prefix``; what a run does with them is ``remote.Mirror``).

* **Keys are file names of the staging folder.** Whoever may write to the
  prefix chooses its keys; each is checked before anything is downloaded:
  one with an empty, ``.`` or ``..`` part (``run//home/u/.bashrc``,
  ``run/checkpoints/epoch-0001/../../x``) would land outside the staging
  folder, and one that is a file and a folder at once cannot be either. Such
  a key is refused, named, in one line. Folder markers (empty objects whose
  key ends in ``/``, what the S3 console's "Create folder" makes) are no
  files and are passed over.
* **The record.** A run keeps in its prefix ``.hvd_train-run.json``: an id
  drawn when it starts, and every file and checkpoint it uploaded, recorded
  before the upload begins. It deletes nothing the record does not list
  (pruned checkpoints, an earlier form of its model), so what others keep
  beside it survives; and a train refuses a prefix that holds objects but
  no record, unless they are a run written before records were kept.
* **The staging folder's copy** of the record's id says whose checkpoints it
  holds: a checkpoint of the staging folder is uploaded on resume only when
  it is of the run the prefix holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import time
import uuid

from hvd_train import files
from hvd_train.data import storage
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("output")

CHECKPOINTS = "checkpoints/"
SUMMARY = "summary.json"
# Files larger than this go up in parts of this size, four at a time.
PART_BYTES = 16 << 20
_BACKOFF_BASE, _BACKOFF_CAP = 0.5, 20.0

RECORD = ".hvd_train-run.json"
FORMAT = "hvd_train.run-in-s3"
VERSION = 1
# Keys of the prefix that are no object of anyone's: the write test of an earlier hvd_train's check that
# died before its delete.
_PROBE = ".write-test-"
# What a run writes from its first epoch on: a prefix holding one of these, and no record, is a run
# written before records were kept.
_EARLIER_RUN = ("run_config.yaml", "summary.json")


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
                if not isinstance(rel, str) or _bad_part(rel):
                    raise ValueError(f"it lists {rel!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(
                f"{where} is not the record of an hvd_train run ({e}); if the prefix holds nothing but that run, "
                f"delete it (the run's files stay and are kept from then on), or give --output another prefix."
            ) from None
        return record


def checked(listed: dict[str, tuple[int, str]], url: str, staging: str) -> dict[str, tuple[int, str]]:
    """The objects of a listing of ``url`` that are files, each with a path inside ``staging``.

    Args:
        listed: ``{key below the prefix: (size, ETag)}``.

    Raises:
        UserError: a key would land outside the staging folder, or is a file and a folder at once.
    """
    found = {rel: value for rel, value in listed.items() if rel and not rel.endswith("/")}  # folder markers
    folders = {rel[:i] for rel in found for i, c in enumerate(rel) if c == "/"}
    for rel in sorted(found):
        why = _bad_part(rel)
        if why:
            raise UserError(
                f"S3 key {url}{rel} {why}, which would put its file outside the staging folder {staging}; "
                f"delete or rename it in the prefix, then run again."
            )
        if rel in folders:
            raise UserError(
                f"S3 key {url}{rel} is a file and, by the keys below {url}{rel}/, a folder of the same name, which "
                f"no staging folder can hold; delete or rename one of them in the prefix, then run again."
            )
    return found


def _bad_part(rel: str) -> str:
    """Why ``rel`` cannot be a relative path inside a folder ("" when it can)."""
    if "\0" in rel:
        return "holds a NUL character"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' part"
    return ""


def inside(staging: str, rel: str) -> str:
    """The path of ``rel`` (a key ``checked`` passed) in ``staging``; checked again where it is written."""
    path = os.path.normpath(os.path.join(staging, rel))
    if os.path.commonpath([os.path.abspath(staging), os.path.abspath(path)]) != os.path.abspath(staging):
        raise UserError(f"{rel} would be written outside the staging folder {staging}; check the prefix's keys.")
    return path


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


@dataclasses.dataclass
class Uploads:
    """What went up to the prefix (``summary.json["output_uploads"]``)."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retried: int = 0
    failed_checkpoints: int = 0


class _Checkpoints:
    """``training.checkpoints``, imported when first used: ``stage`` runs before TensorFlow may load."""

    def __getattr__(self, name: str):
        from hvd_train.training import checkpoints as module

        return getattr(module, name)


checkpoints = _Checkpoints()


class Prefix:
    """The S3 prefix ``url`` of a run and its staging folder ``staging``, file by file: the prefix's files
    listed (keys checked), downloaded, uploaded (tried again), deleted, and its record read and written.

    ``run``: a training run's, which keeps the record; the commands that read a run add their files (a
    report, an export) without it, as beside a run on disk.
    """

    def __init__(self, url: str, staging: str, options: storage.S3Options, run: bool = True):
        self.url, self.staging, self.options, self.run = url, staging, options, run
        self.uploads = Uploads()
        self.uploaded = ""  # the name of the last checkpoint that went up
        self._store: storage.S3Store | None = None
        self._sent: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) as uploaded or downloaded
        self._record: Record | None = None
        self._record_put = b""  # the record as the prefix holds it
        self._staged_run: str | None = None  # whose checkpoints the staging folder held when the record was read

    @property
    def store(self) -> storage.S3Store:
        if self._store is None:
            self._store = storage.S3Store(self.url, self.options)
        return self._store

    def _keys(self) -> dict[str, tuple[int, str]]:
        """Every file of the prefix: ``{path below it: (size, ETag)}``; folder markers left out, and a key that
        is no file name of the staging folder refused (``checked``)."""
        return checked(self.store.list_with_etags("--output"), self.url, self.staging)

    @property
    def record(self) -> Record:
        """The run's record (read from the prefix once; a new one where it holds none)."""
        if self._record is None:
            self._load_record(self._keys())
        return self._record

    def _load_record(self, keys) -> bool:
        """Reads the prefix's record; returns whether it holds one. A run written before records were kept
        is given one that lists its checkpoints."""
        self._staged_run = read_staged(self.staging)
        if RECORD in keys:
            data = self.store.read(RECORD)
            self._record, self._record_put = Record.parse(data, f"{self.url}{RECORD}"), data
            return True
        self._record = Record(checkpoints=self._checkpoint_names(keys)[1])
        return False

    def _checkpoint_names(self, keys) -> tuple[list[str], set[str]]:
        """Complete checkpoints (newest first) and every checkpoint name of the prefix."""
        names = {rel[len(CHECKPOINTS) :].split("/")[0] for rel in keys if rel.startswith(CHECKPOINTS)}
        names = {n for n in names if checkpoints.order(n)}
        complete = [n for n in names if f"{CHECKPOINTS}{n}/{checkpoints.STATE_FILE}" in keys]
        return sorted(complete, key=checkpoints.order, reverse=True), names

    def _sync_files(self, keys, local_wins: bool = False) -> int:
        """The prefix's files outside ``checkpoints/`` into the staging folder where they differ, and
        the staging folder's others removed; returns the bytes downloaded. ``local_wins``: the staging
        folder's files stay as they are, to be uploaded; only those it lacks are downloaded."""
        others, fetched = {rel for rel in keys if not rel.startswith(CHECKPOINTS) and not _hidden(rel)}, 0
        for rel in sorted(others):
            path = inside(self.staging, rel)
            if _same(path, *keys[rel]):
                self._mark_sent(rel)
            elif not (local_wins and os.path.isfile(path)):
                self._download(rel, path)
                fetched += keys[rel][0]
        for rel in [] if local_wins else self._local_files():
            if rel not in others:  # not the prefix's run: the staging folder's own leftovers
                with contextlib.suppress(FileNotFoundError):  # another process on this host was first
                    os.remove(os.path.join(self.staging, rel))
        return fetched

    def _take_checkpoint(self, name: str, keys) -> int:
        """Checkpoint ``name`` of the prefix into the staging folder, verified; returns the bytes downloaded."""
        root = checkpoints.folder(self.staging)
        local = os.path.join(root, name)
        manifest = self.store.read(f"{CHECKPOINTS}{name}/{checkpoints.STATE_FILE}")
        try:
            with open(os.path.join(local, checkpoints.STATE_FILE), "rb") as f:
                if f.read() == manifest:
                    return 0  # the staging folder's copy; restoring it verifies it again
        except OSError:
            pass
        tmp = os.path.join(root, f".{name}.download-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        parts = [rel for rel in keys if rel.startswith(f"{CHECKPOINTS}{name}/")]
        try:
            for rel in parts:
                self._download(rel, inside(tmp, rel[len(f"{CHECKPOINTS}{name}/") :]), record=False)
            checkpoints.verify(tmp)
            shutil.rmtree(local, ignore_errors=True)
            os.rename(tmp, local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return sum(keys[rel][0] for rel in parts)

    def _download(self, rel: str, path: str, record: bool = True) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = self.store.read(rel)
        with files.replacing(path, "wb") as f:
            f.write(data)
        if record:
            self._mark_sent(rel)

    def _mark_sent(self, rel: str) -> None:
        """``rel`` of the staging folder is as in the prefix."""
        stat = os.stat(os.path.join(self.staging, rel))
        self._sent[rel] = (stat.st_size, stat.st_mtime_ns)

    def _local_files(self) -> list[str]:
        """The staging folder's files outside ``checkpoints/``, hidden ones (temporaries) aside."""
        found = []
        for folder, dirs, names in os.walk(self.staging):
            rel_folder = os.path.relpath(folder, self.staging)
            dirs[:] = [d for d in dirs if not d.startswith(".") and (rel_folder, d) != (".", "checkpoints")]
            found += [os.path.normpath(os.path.join(rel_folder, n)) for n in names if not n.startswith(".")]
        return sorted(found)

    def _retrying(self, write, rel: str) -> None:
        """``write()`` of ``rel``, made again with jittered backoff up to ``--s3-max-attempts`` times in
        all (over botocore's own retries of each request: a network cut outlasts those)."""
        attempts = max(1, self.options.max_attempts)
        for attempt in range(1, attempts + 1):
            try:
                return write()
            except Exception as e:
                if attempt == attempts or storage.error_code(e) in _FINAL:
                    raise self.store.error(e, "write", self.store.key(rel)) from None
                self.uploads.retried += 1
                log.warning(
                    "S3: writing %s%s failed (%s); trying again (attempt %d of %d)",
                    self.url,
                    rel,
                    storage.first_line(e),
                    attempt + 1,
                    attempts,
                )
                time.sleep(random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt)))

    def _upload(self, path: str, rel: str) -> None:
        """One file to ``rel``: one PUT, or a multipart upload above ``PART_BYTES``."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=4)
        stat = os.stat(path)
        started = time.perf_counter()
        self._retrying(
            lambda: self.store.client.upload_file(path, self.store.bucket, self.store.key(rel), Config=config), rel
        )
        self.uploads.files += 1
        self.uploads.bytes += stat.st_size
        self.uploads.seconds += time.perf_counter() - started
        self._sent[rel] = (stat.st_size, stat.st_mtime_ns)

    def _put_record(self, force: bool = False) -> None:
        """The record into the prefix, where it changed (``force``: whatever it holds: a write test)."""
        data = self.record.to_bytes()
        if force or data != self._record_put:
            key = self.store.key(RECORD)
            self._retrying(lambda: self.store.client.put_object(Bucket=self.store.bucket, Key=key, Body=data), RECORD)
            self._record_put = data

    def _note(self, rels=(), checkpoint: str | None = None) -> None:
        """What is about to go up, added to the record in the prefix first: whatever of it goes up is the
        run's, to delete once the run no longer needs it (the commands that read a run keep no record)."""
        if self.run:
            self.record.files.update(rels)
            self.record.checkpoints.update([checkpoint] if checkpoint else [])
            self._put_record()

    def _changed(self, skip: str | None = None) -> list[str]:
        """The staging folder's files (checkpoints and ``skip`` aside) changed since they last went up or came
        down, ``summary.json`` last (a prefix that holds it holds a finished run)."""
        changed = []
        for rel in self._local_files():
            stat = os.stat(os.path.join(self.staging, rel))
            if rel != skip and self._sent.get(rel) != (stat.st_size, stat.st_mtime_ns):
                changed.append(rel)
        return sorted(changed, key=lambda rel: rel == SUMMARY)

    def _delete_checkpoint(self, name: str, keys) -> None:
        manifest = f"{CHECKPOINTS}{name}/{checkpoints.STATE_FILE}"
        if manifest in keys:
            self.store.delete(manifest)
        for rel in keys:
            if rel.startswith(f"{CHECKPOINTS}{name}/") and rel != manifest:
                self.store.delete(rel)


# Codes that no retry mends.
_FINAL = {
    "NoSuchBucket",
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "403",
    "404",
}


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _same(path: str, size: int, etag: str) -> bool:
    """Whether the file ``path`` holds the object of ``size`` and ``etag`` (the MD5 of one PUT's body; a
    multipart upload's ETag is not one on AWS, and its file is downloaded again; rclone's serve s3 answers
    the MD5 of the whole)."""
    try:
        return os.path.getsize(path) == size and files.md5(path) == etag
    except OSError:
        return False
