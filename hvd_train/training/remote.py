"""A run whose ``--output`` is an S3 prefix: staged on local disk, mirrored to the prefix by rank 0.

Everything is written as for a run on disk, to a staging folder
(``$HVD_TRAIN_CACHE/runs/BUCKET/PREFIX``), which is only a cache: rank 0
uploads what changed there at every checkpoint, and everything at the end.

* A checkpoint is uploaded file by file, ``state.json`` last. ``state.json``
  is its manifest (the size and CRC32C of every other file, and a checksum of
  its own), so a checkpoint in S3 is complete exactly when its ``state.json``
  is there and its files match it; a reader never takes one half uploaded.
  Older checkpoints are deleted from the prefix (``state.json`` first) only
  once the new one is complete there, so the newest complete one is never
  deleted.
* An upload that fails is tried again with backoff, up to
  ``--s3-max-attempts`` times; a checkpoint that still cannot be uploaded
  is a warning, not the end of the run: it stays in the staging folder, and
  the next checkpoint is uploaded whole. The final outputs must upload, or
  the run ends with an error naming the staging folder that holds them.
* The prefix is the run: a resume takes the newest checkpoint complete
  there, verified against its manifest, downloaded unless the staging folder
  holds it (another machine, a deleted disk), and the files beside it.
* Large files go up as multipart uploads (boto3's transfer manager).
  ``summary.json`` counts the uploads (``output_uploads``) and is uploaded
  last: the prefix holds a finished run once it is there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import time
import urllib.parse

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

_mirrors: dict[str, Mirror] = {}


def staging_folder(url: str) -> str:
    """The local folder an S3 ``--output`` is staged in: ``$HVD_TRAIN_CACHE/runs/BUCKET/PREFIX``."""
    parts = urllib.parse.urlsplit(url)
    segments = parts.path.strip("/").split("/")
    if not parts.netloc or not parts.path.strip("/") or any(s in ("", ".", "..") for s in segments):
        raise UserError(
            f"--output {storage.redact_url(url)} must name a bucket and a prefix without empty, '.' or '..' "
            "parts, e.g. s3://my-bucket/runs/flowers."
        )
    return os.path.join(files.cache_base(), "runs", parts.netloc, *segments)


def stage(cfg):
    """``cfg`` with an S3 ``--output`` replaced by its staging folder, mirrored to the prefix."""
    url = cfg.run.output
    if not storage.is_s3(url):
        return cfg
    staging = staging_folder(url)
    _mirrors[os.path.abspath(staging)] = Mirror(url.rstrip("/") + "/", staging, cfg.data.s3_options())
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output=staging))


def of(output: str) -> Mirror | None:
    """The mirror of a staging folder; None for a run on disk."""
    return _mirrors.get(os.path.abspath(output))


def location(output: str, checkpoint: str) -> str:
    """Where a checkpoint of the run in ``output`` is kept, for messages: in the prefix, or on disk."""
    mirror, name = of(output), os.path.basename(checkpoint)
    if mirror is None:
        return checkpoint
    if name == mirror.uploaded:
        return f"{mirror.url}{CHECKPOINTS}{name}"
    return f"{checkpoint} (its upload to {mirror.url} failed: the prefix keeps its last complete checkpoint)"


def open_run(path: str, options: storage.S3Options | None = None) -> tuple[str, Mirror | None]:
    """A trained run for ``predict``, ``evaluate``, ``report`` and ``export``: a folder as it is, or
    an S3 prefix as a copy of its finished run (checkpoints aside) in its staging folder, with the
    mirror that uploads what the command adds (``push_outputs``)."""
    if not storage.is_s3(path):
        return path, None
    mirror = Mirror(path.rstrip("/") + "/", staging_folder(path), options or storage.S3Options())
    mirror.sync_outputs()
    return mirror.staging, mirror


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


class Mirror:
    """The S3 prefix ``url`` of the staging folder ``staging``; used by rank 0 only."""

    def __init__(self, url: str, staging: str, options: storage.S3Options):
        self.url, self.staging, self.options = url, staging, options
        self.uploads = Uploads()
        self.uploaded = ""  # the name of the last checkpoint that went up
        self._store: storage.S3Store | None = None
        self._sent: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) as uploaded or downloaded

    @property
    def store(self) -> storage.S3Store:
        if self._store is None:
            self._store = storage.S3Store(self.url, self.options)
        return self._store

    # --- reading the prefix ---

    def _keys(self) -> dict[str, tuple[int, str]]:
        """Every object of the prefix: ``{path below it: (size, ETag)}``."""
        return self.store.list_with_etags("--output")

    def _checkpoint_names(self, keys) -> tuple[list[str], set[str]]:
        """Complete checkpoints (newest first) and every checkpoint name of the prefix."""
        names = {rel[len(CHECKPOINTS) :].split("/")[0] for rel in keys if rel.startswith(CHECKPOINTS)}
        names = {n for n in names if checkpoints.order(n)}
        complete = [n for n in names if f"{CHECKPOINTS}{n}/{checkpoints.STATE_FILE}" in keys]
        return sorted(complete, key=checkpoints.order, reverse=True), names

    def check(self) -> None:
        """The prefix can be listed and written, or a ``UserError`` that says why."""
        self._keys()
        probe = f".write-test-{os.getpid()}"
        self._retrying(lambda: self.store.client.put_object(Bucket=self.store.bucket, Key=self.store.key(probe)), probe)
        self.store.delete(probe)

    def clear(self) -> None:
        """Empties the staging folder (a run that starts over)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        os.makedirs(self.staging, exist_ok=True)

    def pull(self) -> str | None:
        """Before a resume: the staging folder made a copy of the run in the prefix.

        The prefix is the run, the staging folder a cache of it: the newest checkpoint complete in
        the prefix (and verified) is the one to resume from, downloaded unless the staging folder has
        it already, and the files beside it are downloaded where they differ. A checkpoint of the
        staging folder that the prefix lacks (its upload failed) is removed: the run goes on from
        the last complete one. Returns its name; None (and an empty staging folder) when the prefix
        has none.
        """
        keys = self._keys()
        complete, _ = self._checkpoint_names(keys)
        started, fetched, chosen = time.perf_counter(), 0, None
        for name in complete:
            try:
                fetched = self._take_checkpoint(name, keys)
            except ValueError as e:
                log.warning("skipping checkpoint %s%s%s: %s; using the one before it", self.url, CHECKPOINTS, name, e)
                continue
            chosen = name
            break
        if chosen is None:
            self.clear()
            return None
        for path in checkpoints.candidates(self.staging):
            if os.path.basename(path) != chosen:
                log.info("removing %s from the staging folder: %s has no complete copy of it", path, self.url)
                shutil.rmtree(path, ignore_errors=True)
        fetched += self._sync_files(keys)
        log.info(
            "resuming the run in %s: checkpoint %s (%.1f MB downloaded in %.1f s)",
            self.url,
            chosen,
            fetched / 1e6,
            time.perf_counter() - started,
        )
        return chosen

    def sync_outputs(self) -> None:
        """The staging folder made a copy of the prefix's finished run, checkpoints aside (``open_run``)."""
        keys = self._keys()
        if SUMMARY not in keys:
            raise UserError(
                f"{self.url} holds no finished run (no {SUMMARY}); train it to the end with --output "
                f"{self.url.rstrip('/')}, or check the prefix."
            )
        started, fetched = time.perf_counter(), self._sync_files(keys)
        log.info("the run in %s: %.1f MB downloaded in %.1f s", self.url, fetched / 1e6, time.perf_counter() - started)

    def _sync_files(self, keys) -> int:
        """The prefix's files outside ``checkpoints/`` into the staging folder where they differ, and
        the staging folder's others removed; returns the bytes downloaded."""
        others, fetched = {rel for rel in keys if not rel.startswith(CHECKPOINTS) and not _hidden(rel)}, 0
        for rel in sorted(others):
            path = os.path.join(self.staging, rel)
            if _same(path, *keys[rel]):
                self._record(rel)
            else:
                self._download(rel, path)
                fetched += keys[rel][0]
        for rel in self._local_files():
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
                self._download(rel, os.path.join(tmp, rel[len(f"{CHECKPOINTS}{name}/") :]), record=False)
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
            self._record(rel)

    def _record(self, rel: str) -> None:
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

    # --- writing the prefix ---

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

    def push_outputs(self, skip: str | None = None) -> None:
        """Uploads every file of the staging folder (checkpoints and ``skip`` aside) changed since it
        last went up or came down."""
        for rel in self._local_files():
            stat = os.stat(os.path.join(self.staging, rel))
            if rel != skip and self._sent.get(rel) != (stat.st_size, stat.st_mtime_ns):
                self._upload(os.path.join(self.staging, rel), rel)

    def push_checkpoint(self, path: str) -> bool:
        """The outputs, then checkpoint ``path`` with its ``state.json`` last; then the prefix's
        checkpoints that the staging folder no longer has are deleted. False (and a warning) when
        it could not be uploaded: the run goes on, and the next checkpoint is uploaded whole."""
        name = os.path.basename(path)
        started = time.perf_counter()
        try:
            self.push_outputs()
            parts = sorted(f for f in os.listdir(path) if f != checkpoints.STATE_FILE)
            for part in [*parts, checkpoints.STATE_FILE]:
                self._upload(os.path.join(path, part), f"{CHECKPOINTS}{name}/{part}")
        except UserError as e:
            self.uploads.failed_checkpoints += 1
            log.warning(
                "checkpoint %s could not be uploaded to %s (%s); it is in %s, and the prefix keeps its last "
                "complete checkpoint",
                name,
                self.url,
                e,
                path,
            )
            return False
        log.info("checkpoint %s uploaded to %s (%.2f s)", name, self.url, time.perf_counter() - started)
        self.uploaded = name
        self._prune(keep={os.path.basename(p) for p in checkpoints.candidates(self.staging)} | {name})
        return True

    def _prune(self, keep: set[str]) -> None:
        """Deletes the prefix's checkpoints not in ``keep``: ``state.json`` first, then the rest. A
        delete that fails (a policy without s3:DeleteObject) is a warning: they are only older."""
        try:
            keys = self._keys()
            _, names = self._checkpoint_names(keys)
            for name in sorted(names - keep):
                self._delete_checkpoint(name, keys)
        except UserError as e:
            log.warning("older checkpoints stay in %s%s: %s", self.url, CHECKPOINTS, e)

    def _delete_checkpoint(self, name: str, keys) -> None:
        manifest = f"{CHECKPOINTS}{name}/{checkpoints.STATE_FILE}"
        if manifest in keys:
            self.store.delete(manifest)
        for rel in keys:
            if rel.startswith(f"{CHECKPOINTS}{name}/") and rel != manifest:
                self.store.delete(rel)

    def remove_checkpoints(self) -> int:
        """``--no-resume``: deletes every checkpoint of the prefix; returns how many."""
        keys = self._keys()
        _, names = self._checkpoint_names(keys)
        for name in sorted(names):
            self._delete_checkpoint(name, keys)
        return len(names)

    def finish(self, summary: dict) -> None:
        """The run's outputs, then ``summary.json`` with the upload counts, last; files the staging
        folder no longer has (a model saved in another form) are deleted from the prefix."""
        try:
            self.push_outputs(skip=SUMMARY)
            summary["output_uploads"] = dataclasses.asdict(self.uploads)
            files.write_json(os.path.join(self.staging, SUMMARY), summary)
            self._upload(os.path.join(self.staging, SUMMARY), SUMMARY)
        except UserError as e:
            raise UserError(
                f"{e} The run's outputs are in {self.staging}; rerun the same command to upload them "
                f"(it resumes from the last checkpoint and writes them again)."
            ) from None
        summary["output_uploads"] = dataclasses.asdict(self.uploads)
        kept = set(self._local_files())
        try:
            for rel in self._keys():
                if not rel.startswith(CHECKPOINTS) and not _hidden(rel) and rel not in kept:
                    self.store.delete(rel)
        except UserError as e:
            log.warning("files of an earlier form of the model stay in %s: %s", self.url, e)
        log.info(
            "outputs in %s: %d file(s), %.1f MB uploaded in %.1f s (%d retried)",
            self.url,
            self.uploads.files,
            self.uploads.bytes / 1e6,
            self.uploads.seconds,
            self.uploads.retried,
        )


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
    """Whether the file ``path`` holds the object of ``size`` and ``etag`` (the MD5 of one PUT's body;
    a multipart upload's ETag is not one, and its file is downloaded again)."""
    try:
        return os.path.getsize(path) == size and files.md5(path) == etag
    except OSError:
        return False
