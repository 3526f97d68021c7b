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
  holds it intact (another machine, a deleted disk, a damaged copy), and the
  files beside it; with ``--early-stop``, the best epoch's checkpoint too.
  Only where the staging folder holds a newer intact checkpoint of the same
  run (its upload failed: an outage) does that one go up, with the outputs
  waiting beside it, and the run go on from it. The resume restores the
  checkpoint the pull took or stops (``latest_checkpoint``): a run that
  started over would prune the prefix's checkpoints with its first upload.
* A prefix holds the run alone (``prefix``, ``run_record``): its keys must be
  file names of the staging folder, the run deletes only what its record
  says it uploaded, and one process writes it (on one machine, the one that
  holds its staging folder: ``staging_folders``); a train refuses a prefix
  that holds something else, or another run below or around it.
* Large files go up as multipart uploads (boto3's transfer manager).
  ``summary.json`` counts the uploads (``output_uploads``) and is uploaded
  last: the prefix holds a finished run once it is there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from hvd_train import files
from hvd_train.data import storage
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.training import checkpoints, prefix, run_record, staging_folders
from hvd_train.training.prefix import CHECKPOINTS, PART_BYTES, SUMMARY  # noqa: F401  (PART_BYTES: tests)
from hvd_train.training.staging_folders import staging_folder

log = get_logger("output")

_mirrors: dict[str, Mirror] = {}


def stage(cfg):
    """``cfg`` with an S3 ``--output`` replaced by its staging folder, mirrored to the prefix."""
    url = cfg.run.output
    if not storage.is_s3(url):
        return cfg
    staging = staging_folder(url, cfg.data.s3_endpoint)
    mirror = Mirror(url.rstrip("/") + "/", staging, cfg.data.s3_options())
    mirror.earlier = staging_folders.earlier(url, cfg.data.s3_endpoint)
    _mirrors[os.path.abspath(staging)] = mirror
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


def open_run(
    path: str, options: storage.S3Options | None = None, flag: str = "--model-dir"
) -> tuple[str, Mirror | None]:
    """A trained run for ``predict``, ``evaluate``, ``report`` and ``export``: a folder as it is, or
    an S3 prefix as a copy of its finished run (checkpoints aside) in a staging folder of its own (a
    training of the prefix on this machine keeps its files in another; another command that reads it, in
    another copy: ``staging_folders.for_reading``), with the mirror that uploads what the command adds
    (``push_outputs``)."""
    if not storage.is_s3(path):
        return path, None
    options = options or storage.S3Options()
    staging = staging_folders.for_reading(path, options.endpoint, flag)
    mirror = Mirror(path.rstrip("/") + "/", staging, options, run=False)
    mirror.sync_outputs()
    return mirror.staging, mirror


def latest_checkpoint(output: str) -> checkpoints.Found | None:
    """The checkpoint a resume starts from: the newest intact one of ``output`` (damaged ones set aside). For a
    run in S3, the one ``Mirror.pull`` took from the prefix, or an error: a run that started over instead
    would delete the prefix's checkpoints with its first upload.

    Raises:
        UserError: the checkpoint the prefix holds did not verify in the staging folder after its download.
    """
    found, mirror = checkpoints.latest(output, set_aside=True), of(output)
    if mirror is not None and mirror.pulled and (found is None or os.path.basename(found.path) != mirror.pulled):
        raise UserError(
            f"checkpoint {mirror.pulled} of {mirror.url} did not verify in the staging folder {output} after its "
            f"download (see the warning above; it is set aside): nothing in the prefix changed; rerun the same "
            f"command to download it again, and check that disk if it recurs."
        )
    return found


class Mirror(prefix.Prefix):
    """What a run in S3 does with its prefix: checks it, resumes from it, uploads its checkpoints and outputs,
    prunes and deletes what it no longer needs; used by rank 0 only."""

    pulled: str | None = None  # the checkpoint ``pull`` took, which the resume must restore
    earlier = ""  # where an hvd_train before this one staged the run, if elsewhere (``staging_folders.earlier``)

    def check(self) -> None:
        """Before a train writes anything: the prefix holds nothing, or a run (its record, or a run written
        before records were kept), with no run below or around it, and can be written (its record is); or a
        ``UserError`` that says why."""
        staging_folders.hold(self.staging, self.url)  # first: another process of this machine may stage it too
        listed = self.store.list_with_etags("--output")
        refused = run_record.nesting(listed, self.store)
        keys = self._keys(listed)
        if refused is None and not self._load_record(keys):
            refused = run_record.foreign(keys, self.url)
        if refused is not None:
            raise refused
        self.record.writer = run_record.writer()  # a second writer changes the record, even where it adds nothing
        self._put_record(force=True)

    def pull(self) -> str | None:
        """Before a resume: the staging folder made a copy of the run in the prefix.

        The prefix is the run, the staging folder a cache of it: the newest checkpoint of the run complete
        in the prefix (and verified) is the one to resume from, downloaded unless the staging folder has
        it already, with the best epoch's for ``--early-stop``; the files beside it are downloaded where
        they differ, and the staging folder's other checkpoints removed. But a newer intact checkpoint of
        the staging folder, of the same run, goes up with the outputs beside it (``_push_ahead``). Returns
        the checkpoint's name; None (and no checkpoint in the staging folder) when there is none.
        """
        staging_folders.hold(self.staging, self.url)
        keys = self._keys()
        if self._record is None:
            self._load_record(keys)
        complete = self._complete(keys)
        self._move_earlier_staging(complete)
        self._adopt_earlier_staging(complete)
        ahead = self._ahead(complete)
        if ahead is not None:
            self.pulled = self._push_ahead(ahead, keys, complete)
            return self.pulled
        started, fetched, chosen = time.perf_counter(), 0, None
        for name in complete:
            try:
                fetched = self._take_checkpoint(name, keys)
            except ValueError as e:
                log.warning("skipping checkpoint %s%s%s: %s; using the one before it", self.url, CHECKPOINTS, name, e)
                continue
            chosen = name
            break
        fetched += self._sync_files(keys)
        keep = {chosen} if chosen else set()
        if chosen is not None:
            best = _best_epoch(os.path.join(checkpoints.folder(self.staging), chosen))
            keep |= self._keep_best(best, chosen, complete, keys)
        for path in checkpoints.candidates(self.staging):
            if os.path.basename(path) not in keep:
                log.info("removing %s from the staging folder: %s has no complete copy of it", path, self.url)
                shutil.rmtree(path, ignore_errors=True)
        run_record.mark_staged(self.staging, self.record.run)
        self.pulled = chosen
        if chosen is None:
            shutil.rmtree(checkpoints.folder(self.staging), ignore_errors=True)
            return None
        log.info(
            "resuming the run in %s: checkpoint %s (%.1f MB downloaded in %.1f s)",
            self.url,
            chosen,
            fetched / 1e6,
            time.perf_counter() - started,
        )
        return chosen

    def pull_outputs(self) -> None:
        """``--no-resume``: the staging folder made a copy of the prefix's files, checkpoints aside, so that the
        run starts over beside them as in a folder on disk (a finished run's model, and what describes it,
        stay until the new run's end replaces them)."""
        staging_folders.hold(self.staging, self.url)
        keys = self._keys()
        if self._record is None:
            self._load_record(keys)
        self._sync_files(keys)

    def _complete(self, keys) -> list[str]:
        """The run's checkpoints complete in the prefix, newest first; others (not in its record) passed over."""
        complete, names = self._checkpoint_names(keys)
        strays = sorted(names - self.record.checkpoints)
        if strays:
            log.warning(
                "passing over %s in %s%s: no checkpoint(s) of this run (not in its %s)",
                ", ".join(strays),
                self.url,
                CHECKPOINTS,
                run_record.RECORD,
            )
        return [name for name in complete if name in self.record.checkpoints]

    def _move_earlier_staging(self, complete: list[str]) -> None:
        """``--s3-endpoint``: where the staging folder holds no run yet, and the one an hvd_train before staged the
        run in (``staging_folders.earlier``) holds this one's (by its id, or a checkpoint the prefix holds byte
        for byte; not another store's run of a bucket of the same name), that one's checkpoints and files are
        moved here: an outage's kept-back checkpoint, and the outputs beside it, go up as they would have."""
        source = self.earlier
        if not source or os.path.exists(os.path.join(self.staging, run_record.RECORD)) or not os.path.isdir(source):
            return
        ours = run_record.read_staged(source) == self.record.run
        if not (ours or self._shared_checkpoint(source, complete)):
            return
        if not staging_folders.take(source):  # a training of the same prefix without --s3-endpoint, running
            log.warning("the staging folder %s of an earlier hvd_train is used by another process: left alone", source)
            return
        log.info("moving the run's staging folder of an earlier hvd_train, %s, to %s", source, self.staging)
        staging_folders.move_in(source, self.staging)
        self._staged_run = run_record.read_staged(self.staging)

    def _adopt_earlier_staging(self, complete: list[str]) -> None:
        """A staging folder whose copy of the record names another run id, or none (an earlier hvd_train's; a
        record deleted, whose run drew a new id), is of the prefix's run where one of its checkpoints is
        complete in the prefix with the same manifest, byte for byte (its time and checksums are no other
        run's): its newer checkpoints, which an outage kept back, are the run's too."""
        if self._staged_run == self.record.run:
            return
        name = self._shared_checkpoint(self.staging, complete)
        if name is None:
            return
        log.info(
            "the staging folder %s holds checkpoint %s as %s does: its checkpoints are of this run",
            self.staging,
            name,
            self.url,
        )
        run_record.mark_staged(self.staging, self.record.run)
        self._staged_run = self.record.run

    def _ahead(self, complete: list[str]) -> checkpoints.Found | None:
        """The staging folder's newest intact checkpoint where it is of the prefix's run and newer than every
        checkpoint complete there (its upload failed); None otherwise."""
        if self._staged_run != self.record.run:
            return None
        for path in checkpoints.candidates(self.staging):
            if complete and checkpoints.order(os.path.basename(path)) <= checkpoints.order(complete[0]):
                return None
            try:
                return checkpoints.verify_again_if_unreadable(path)  # else the pull removes it
            except ValueError as e:
                log.warning("skipping checkpoint %s: %s", path, e)
        return None

    def _push_ahead(self, found: checkpoints.Found, keys, complete: list[str]) -> str:
        """The run's newest checkpoint, which the staging folder alone holds, uploaded with the outputs
        waiting beside it (the prefix's other files downloaded where the staging folder lacks them)."""
        name = os.path.basename(found.path)
        log.warning(
            "checkpoint %s of the staging folder is newer than any complete in %s (its upload failed): uploading "
            "it and the outputs beside it, and resuming from it",
            found.path,
            self.url,
        )
        self._sync_files(keys, local_wins=True)
        self._keep_best(found.state.best_epoch, name, complete, keys)
        self.push_checkpoint(found.path)
        return name

    def _keep_best(self, best_epoch: int, chosen: str, complete: list[str], keys) -> set[str]:
        """``--early-stop``: the best epoch's checkpoint, kept beside ``chosen`` (``restore_best`` loads it at
        the end, and the next upload keeps what the staging folder holds): the prefix's, or the staging
        folder's own, uploaded, where its upload failed. Its name, in a set; an empty set for none."""
        if best_epoch < 0:
            return set()
        want = checkpoints.order(checkpoints.epoch_end_name(best_epoch + 1))[:2]
        before = checkpoints.order(chosen)
        if before[:2] == want:
            return set()
        for name in complete:
            if checkpoints.order(name)[:2] == want and checkpoints.order(name) < before:
                try:
                    self._take_checkpoint(name, keys)
                    return {name}
                except ValueError as e:
                    log.warning("skipping checkpoint %s%s%s: %s", self.url, CHECKPOINTS, name, e)
        own = checkpoints.of_epoch_end(self.staging, best_epoch + 1) if self._staged_run == self.record.run else None
        if (
            own is not None
            and checkpoints.order(os.path.basename(own.path)) < before
            and self.push_checkpoint(own.path)
        ):
            return {os.path.basename(own.path)}
        log.warning("early stop: %s holds no checkpoint of the best epoch (%d)", self.url, best_epoch + 1)
        return set()

    def sync_outputs(self) -> None:
        """The staging folder made a copy of the prefix's finished run, checkpoints aside (``open_run``)."""
        keys = self._keys()
        if SUMMARY not in keys:
            raise UserError(
                f"{self.url} holds no finished run (no {SUMMARY}); train it to the end with --output "
                f"{self.url.rstrip('/')}, or check the prefix."
            )
        run_record.mark_staged(self.staging, None)  # a staging folder, which one around it passes over
        started, fetched = time.perf_counter(), self._sync_files(keys)
        log.info("the run in %s: %.1f MB downloaded in %.1f s", self.url, fetched / 1e6, time.perf_counter() - started)

    def push_outputs(self, skip: str | None = None) -> None:
        """Uploads every file of the staging folder (checkpoints and ``skip`` aside) changed since it
        last went up or came down."""
        changed = self._changed(skip)
        self._note(changed)
        for rel in changed:
            self._upload(os.path.join(self.staging, rel), rel)

    def push_checkpoint(self, path: str) -> bool:
        """The outputs, then checkpoint ``path`` with its ``state.json`` last (both in the record first);
        then the run's checkpoints in the prefix that the staging folder no longer has are deleted. False
        (and a warning) when it could not be uploaded: the run goes on, and the next checkpoint is uploaded
        whole."""
        name = os.path.basename(path)
        started = time.perf_counter()
        try:
            changed = self._changed()
            self._note(changed, name)
            if self._staged_run != self.record.run:  # the staging folder's checkpoints are of this run
                run_record.mark_staged(self.staging, self.record.run)
                self._staged_run = self.record.run
            for rel in changed:
                self._upload(os.path.join(self.staging, rel), rel)
            parts = sorted(f for f in os.listdir(path) if f != checkpoints.STATE_FILE)
            for part in [*parts, checkpoints.STATE_FILE]:
                if part == checkpoints.STATE_FILE:
                    self._ours()  # a writer that took the run over meanwhile may upload one of this name too
                self._upload(os.path.join(path, part), f"{CHECKPOINTS}{name}/{part}")
        except run_record.OtherWriter:
            raise
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
        """Deletes the run's checkpoints in the prefix not in ``keep``: ``state.json`` first, then the rest (each
        once the record is read back as this process's). A delete that fails (a policy without s3:DeleteObject)
        is a warning: they are only older."""
        try:
            keys = self._keys()
            _, names = self._checkpoint_names(keys)
            self.record.checkpoints &= names | keep  # none of what was recorded and never went up
            for name in sorted(self.record.checkpoints - keep):
                self._delete_checkpoint(name, keys)
                self.record.checkpoints.discard(name)  # the record says so with the next upload
        except run_record.OtherWriter:
            raise
        except UserError as e:
            log.warning("older checkpoints stay in %s%s: %s", self.url, CHECKPOINTS, e)

    def remove_checkpoints(self) -> int:
        """``--no-resume``: deletes every checkpoint of the run from the prefix, and the run starts over with a
        new id (no staging folder's checkpoint of the run before is taken for its own); returns how many."""
        keys = self._keys()
        _, names = self._checkpoint_names(keys)
        mine = sorted(names & self.record.checkpoints)
        for name in mine:
            self._delete_checkpoint(name, keys)
        self._record = run_record.Record(files=self.record.files, writer=self.record.writer)
        self._put_record()
        run_record.mark_staged(self.staging, self.record.run)
        self._staged_run = self.record.run
        return len(mine)

    def finish(self, summary: dict) -> None:
        """The run's outputs, then ``summary.json`` with the upload counts, last; files the run uploaded that
        the staging folder no longer has (a model saved in another form) are deleted from the prefix."""
        try:
            changed = self._changed(skip=SUMMARY)
            self._note([*changed, SUMMARY])
            for rel in changed:
                self._upload(os.path.join(self.staging, rel), rel)
            summary["output_uploads"] = dataclasses.asdict(self.uploads)
            files.write_json(os.path.join(self.staging, SUMMARY), summary)
            self._upload(os.path.join(self.staging, SUMMARY), SUMMARY)
        except run_record.OtherWriter:
            raise
        except UserError as e:
            raise UserError(
                f"{e} The run's outputs are in {self.staging}; rerun the same command to upload them (it "
                f"resumes from the newest checkpoint, uploaded first where the prefix lacks it, and writes them "
                f"again)."
            ) from None
        summary["output_uploads"] = dataclasses.asdict(self.uploads)
        kept = set(self._local_files())
        try:
            keys = self._keys()
            for rel in sorted(self.record.files - kept):
                if rel in keys:
                    self._ours()  # the record read minutes ago may no longer be the run's
                    self.store.delete(rel)
                self.record.files.discard(rel)
            self._put_record()
        except run_record.OtherWriter:
            raise
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


def _best_epoch(path: str) -> int:
    """The best epoch (0-based; -1: none) that checkpoint ``path`` holds for ``--early-stop``."""
    with open(os.path.join(path, checkpoints.STATE_FILE), "rb") as f:
        return int(json.loads(f.read())["state"].get("best_epoch", -1))
