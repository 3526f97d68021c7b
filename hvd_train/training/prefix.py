"""The S3 prefix of a run and its staging folder, file by file (``Prefix``; what a run does with them is
``s3_mirror.Mirror``, what of the prefix is the run's is ``run_record``, where the staging folder is
``staging_folders``).

* **Keys are file names of the staging folder.** Whoever may write to the
  prefix chooses its keys; each is checked before anything is downloaded:
  one with an empty, ``.`` or ``..`` part (``run//home/u/.bashrc``,
  ``run/checkpoints/epoch-0001/../../x``) would land outside the staging
  folder, one with a part longer than a file name may be cannot be written,
  and one that is a file and a folder at once cannot be either. Such a key
  is refused, named, in one line. Folder markers (empty objects whose key
  ends in ``/``, what the S3 console's "Create folder" makes) are no files
  and are passed over; so are the keys of another run below the prefix.
* **Paths stay inside.** Every file downloaded is written where its real
  path (symbolic links followed) is inside the staging folder; one that
  cannot be written at all is an error naming its key.
* **Another staging folder inside this one** (a run of a prefix below, or a
  copy of a command that reads one), marked by its copy of a record, is not
  this run's: it is neither uploaded nor removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import time

from hvd_train import files
from hvd_train.data import storage
from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger
from hvd_train.training import checkpoints, run_record
from hvd_train.training.run_record import CHECKPOINTS, RECORD, bad_part

log = get_logger("output")

SUMMARY = "summary.json"
# Files larger than this go up in parts of this size, four at a time.
PART_BYTES = 16 << 20
_BACKOFF_BASE, _BACKOFF_CAP = 0.5, 20.0


def checked(listed: dict[str, tuple[int, str]], url: str, staging: str) -> dict[str, tuple[int, str]]:
    """The objects of a listing of ``url`` that are files of its run, each with a path inside ``staging``:
    folder markers, and the keys of another run below the prefix (``run_record.nested_runs``), left out.

    Args:
        listed: ``{key below the prefix: (size, ETag)}``.

    Raises:
        UserError: a key names no file inside the staging folder, or is a file and a folder at once.
    """
    others = tuple(run_record.nested_runs(listed))
    found = {rel: v for rel, v in listed.items() if rel and not rel.endswith("/") and not rel.startswith(others)}
    folders = {rel[:i] for rel in found for i, c in enumerate(rel) if c == "/"}
    for rel in sorted(found):
        why = bad_part(rel)
        if why:
            raise UserError(
                f"S3 key {url}{rel} {why}, so it names no file inside the staging folder {staging}; delete or "
                f"rename it in the prefix, then run again."
            )
        if rel in folders:
            raise UserError(
                f"S3 key {url}{rel} is a file and, by the keys below {url}{rel}/, a folder of the same name, which "
                f"no staging folder can hold; delete or rename one of them in the prefix, then run again."
            )
    return found


def inside(staging: str, rel: str) -> str:
    """The path of ``rel`` (a key ``checked`` passed) in ``staging``, checked again where it is written: its real
    path (symbolic links followed) must be inside the staging folder's."""
    path = os.path.normpath(os.path.join(staging, rel))
    root = os.path.abspath(staging)
    if os.path.commonpath([root, os.path.abspath(path)]) != root:
        raise UserError(f"{rel} would be written outside the staging folder {staging}; check the prefix's keys.")
    real_root = os.path.realpath(staging)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise UserError(
            f"{rel} would be written outside the staging folder {staging}, through a symbolic link in it (to "
            f"{os.path.realpath(path)}); remove the link, then run again."
        )
    return path


@dataclasses.dataclass
class Uploads:
    """What went up to the prefix (``summary.json["output_uploads"]``)."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retried: int = 0
    failed_checkpoints: int = 0


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
        self._record: run_record.Record | None = None
        self._record_put = b""  # the record as this process last read or wrote it
        self._record_tried: set[bytes] = set()  # records it put since, whose answer was lost
        self._staged_run: str | None = None  # whose checkpoints the staging folder held when the record was read
        self._unfit: set[str] = set()  # files whose name no key of the prefix may have, warned of

    @property
    def store(self) -> storage.S3Store:
        if self._store is None:
            self._store = storage.S3Store(self.url, self.options)
        return self._store

    def _keys(self, listed=None) -> dict[str, tuple[int, str]]:
        """Every file of the run in the prefix: ``{path below it: (size, ETag)}``; folder markers and other runs
        below it left out, and a key that is no file name of the staging folder refused (``checked``).
        ``listed``: the prefix's listing, where it was just made."""
        if listed is None:
            listed = self.store.list_with_etags("--output")
        return checked(listed, self.url, self.staging)

    @property
    def record(self) -> run_record.Record:
        """The run's record (read from the prefix once; a new one where it holds none)."""
        if self._record is None:
            self._load_record(self._keys())
        return self._record

    def _load_record(self, keys) -> bool:
        """Reads the prefix's record; returns whether it holds one. A run written before records were kept
        is given one that lists its checkpoints."""
        self._staged_run = run_record.read_staged(self.staging)
        self._record_tried.clear()
        if RECORD in keys:
            data = self.store.read(RECORD)
            self._record, self._record_put = run_record.Record.parse(data, f"{self.url}{RECORD}"), data
            return True
        self._record, self._record_put = run_record.Record(checkpoints=self._checkpoint_names(keys)[1]), b""
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
        inside(self.staging, f"{CHECKPOINTS}{name}")  # no symbolic link out of the staging folder on the way
        if self._staged_copy(name, local):
            return 0
        tmp = os.path.join(root, f".{name}.download-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        parts = [rel for rel in keys if rel.startswith(f"{CHECKPOINTS}{name}/")]
        try:
            for rel in parts:
                self._download(rel, inside(tmp, rel[len(f"{CHECKPOINTS}{name}/") :]), record=False)
            checkpoints.verify_again_if_unreadable(tmp)  # a read fault of a moment must not cost its turn
            shutil.rmtree(local, ignore_errors=True)
            os.rename(tmp, local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return sum(keys[rel][0] for rel in parts)

    def _same_manifest(self, name: str, local: str) -> bool:
        """Whether the checkpoint folder ``local`` holds the manifest of the prefix's checkpoint ``name``."""
        manifest = self.store.read(f"{CHECKPOINTS}{name}/{checkpoints.STATE_FILE}")
        try:
            with open(os.path.join(local, checkpoints.STATE_FILE), "rb") as f:
                return f.read() == manifest
        except OSError:
            return False

    def _shared_checkpoint(self, folder: str, complete: list[str]) -> str | None:
        """The newest checkpoint of the staging folder ``folder`` that is complete in the prefix (``complete``)
        with the same manifest, byte for byte: its time and checksums are no other run's. None where none is."""
        for path in checkpoints.candidates(folder):
            name = os.path.basename(path)
            if name in complete and self._same_manifest(name, path):
                return name
        return None

    def _staged_copy(self, name: str, local: str) -> bool:
        """Whether the staging folder holds checkpoint ``name`` as the prefix does: the same manifest, and its
        files as the manifest says (a copy damaged on disk is downloaded again)."""
        if not self._same_manifest(name, local):
            return False
        try:
            checkpoints.verify(local)
        except ValueError as e:
            log.warning("the staging folder's copy of checkpoint %s is damaged (%s): downloading it again", name, e)
            return False
        return True

    def _download(self, rel: str, path: str, record: bool = True) -> None:
        data = self.store.read(rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with files.replacing(path, "wb") as f:
                f.write(data)
        except OSError as e:
            raise UserError(
                f"cannot write S3 key {self.url}{rel} into the staging folder {self.staging} ({e.strerror or e}); "
                f"free space there, or delete or rename the key in the prefix, then run again."
            ) from None
        if record:
            self._mark_sent(rel)

    def _mark_sent(self, rel: str) -> None:
        """``rel`` of the staging folder is as in the prefix."""
        stat = os.stat(os.path.join(self.staging, rel))
        self._sent[rel] = (stat.st_size, stat.st_mtime_ns)

    def _local_files(self) -> list[str]:
        """The staging folder's files outside ``checkpoints/``, hidden ones (temporaries) and other staging
        folders inside it (each marked by its copy of a record: a run of a prefix below) aside."""
        found = []
        for folder, dirs, names in os.walk(self.staging):
            rel_folder = os.path.relpath(folder, self.staging)
            dirs[:] = [
                d
                for d in dirs
                if not d.startswith(".")
                and (rel_folder, d) != (".", "checkpoints")
                and not os.path.exists(os.path.join(folder, d, RECORD))
            ]
            found += [os.path.normpath(os.path.join(rel_folder, n)) for n in names if not n.startswith(".")]
        return sorted(found)

    def _retrying(self, write, rel: str) -> None:
        """``write()`` of ``rel``, made again with jittered backoff up to ``--s3-max-attempts`` times in
        all (over botocore's own retries of each request: a network cut outlasts those)."""
        attempts = max(1, self.options.max_attempts)
        for attempt in range(1, attempts + 1):
            try:
                return write()
            except UserError:  # OtherWriter: no retry mends it
                raise
            except Exception as e:
                if attempt == attempts or storage.error_code(e) in _FINAL:
                    raise self.store.error(e, "write", self.store.key(rel)) from None
                self.uploads.retried += 1
                log.warning(
                    "S3: writing %s%s failed (%s); trying again (attempt %d of %d)",
                    self.url,
                    rel,
                    first_line(e),
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

    def _ours(self) -> str:
        """Checks that the run is still this process's to write: its record in the prefix is as this process last
        read or wrote it (``run_record.same_as_written``); returns the record's ETag ("": none).

        Raises:
            run_record.OtherWriter: another process wrote it since.
        """
        return run_record.same_as_written(self.store, self._record_put, self._record_tried)

    def _put_record(self, force: bool = False) -> None:
        """The record into the prefix, where it changed (``force``: whatever it holds: a write test); before, and
        where it did not change too, it is read back as this process last read or wrote it (``_ours``)."""
        data = self.record.to_bytes()
        etag = self._ours()
        if force or data != self._record_put:
            self._record_tried.add(data)  # its answer may be lost where the write is not
            self._retrying(lambda: self._put_if(data, etag), RECORD)
            self._record_put = data
            self._record_tried.clear()

    def _put_if(self, data: bytes, etag: str) -> None:
        """``data`` as the record, only while the prefix holds the record of ``etag`` (none: ``""``), where the
        store makes conditional writes (AWS, moto; rclone's serve s3 ignores the condition, and a store that
        refuses it gets a plain write: the read-back before is the check that holds everywhere).

        Raises:
            run_record.OtherWriter: another process wrote or deleted the record since it was read.
        """
        put = self.store.client.put_object
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            put(Bucket=self.store.bucket, Key=self.store.key(RECORD), Body=data, **condition)
        except Exception as e:
            code = storage.error_code(e)
            if code in _CONDITIONS_REFUSED:
                put(Bucket=self.store.bucket, Key=self.store.key(RECORD), Body=data)
            elif code in _CHANGED_SINCE_READ:  # by another process, or by this one's try whose answer was lost
                run_record.same_as_written(self.store, data)
            else:
                raise

    def _note(self, rels=(), checkpoint: str | None = None) -> None:
        """What is about to go up, added to the record in the prefix first: whatever of it goes up is the
        run's, to delete once the run no longer needs it (the commands that read a run keep no record)."""
        if self.run:
            self.record.files.update(rels)
            self.record.checkpoints.update([checkpoint] if checkpoint else [])
            self._put_record()

    def _changed(self, skip: str | None = None) -> list[str]:
        """The staging folder's files (checkpoints and ``skip`` aside) changed since they last went up or came
        down, ``summary.json`` last (a prefix that holds it holds a finished run); a file whose name is no key's
        (``bad_part``: too long a part) is left out with a warning, as a resume would refuse the prefix."""
        changed = []
        for rel in self._local_files():
            why = bad_part(rel)  # a name longer than MAX_PART_BYTES: no staging folder could take it back
            if why:
                if rel not in self._unfit:
                    self._unfit.add(rel)
                    log.warning("%s of %s is not uploaded to %s: its name %s", rel, self.staging, self.url, why)
                continue
            stat = os.stat(os.path.join(self.staging, rel))
            if rel != skip and self._sent.get(rel) != (stat.st_size, stat.st_mtime_ns):
                changed.append(rel)
        return sorted(changed, key=lambda rel: rel == SUMMARY)

    def _delete_checkpoint(self, name: str, keys) -> None:
        """Checkpoint ``name`` deleted from the prefix, its manifest first, once the record is read back as this
        process's (``_ours``): a record read minutes ago (``--no-resume``, a prune) may be another writer's now,
        and the checkpoint the one it resumed from."""
        self._ours()
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


# A conditional write's answers: the object is not the one read (or a write of it is under way; or, for If-Match,
# it is gone), or the store makes no conditional writes.
_CHANGED_SINCE_READ = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"}
_CONDITIONS_REFUSED = {"NotImplemented", "501"}


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
