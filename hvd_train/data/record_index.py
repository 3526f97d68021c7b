"""The index of other tools' TFRecord files: each record's byte offset and label, made once, kept for the next run.

One pass reads every file, ``WINDOW`` bytes at a time: each record's
framing and both of its checksums verified, its ``tf.train.Example`` parsed
for the label, the label's text (``TEXT_KEYS``) and the image, whose first
and last bytes are checked as a folder's are (``checks``; a suspect is
decoded). The index keeps per file its name, stamp (size and modification
time, or ETag), length, offsets, labels, texts and undecodable images, as
JSON: ``.hvd_train-index-<digest>.json`` beside the files when their folder
can be written, else in the cache folder (``$HVD_TRAIN_CACHE/record-index``);
the entries of both places count. An entry counts only while its file's
stamp and the feature keys are unchanged: a new or rewritten file is read
again, the others are not.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from hvd_train import files as hvd_files
from hvd_train.compat import tf
from hvd_train.data import storage
from hvd_train.data.checks import FORMATS
from hvd_train.data.images import decode
from hvd_train.data.packed import _masked_crc
from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger

log = get_logger("data")

FORMAT, VERSION = "hvd_train.record_index", 1
PREFIX = ".hvd_train-index-"
TEXT_KEYS = ("image/class/synset", "image/class/text")
WINDOW = 8 << 20  # bytes of a file read at once: memory per file read, whatever the file's size
THREADS = 8  # files read at once by a process


def name_of(source) -> str:
    """The index's file name for the records of ``source`` (a ``records.Source``: its pattern or split, and
    keys)."""
    key = json.dumps([source.key, source.options.image_key, source.options.label_key])
    return f"{PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def _cached_path(store: storage.Store, name: str) -> str:
    where = hashlib.sha256(storage.redact_url(store.url).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(hvd_files.cache_base(), "record-index", f"{where}-{name}")


def _read_index(store: storage.Store, name: str, options) -> tuple[dict[tuple[str, str], dict], str]:
    """The usable entries of the indexes beside the files and in the cache, by ``(file, stamp)``, and where they
    were found."""
    places = [(store.full(name), lambda: store.read(name) if store.exists(name) else None)]
    cached = _cached_path(store, name)
    places.append((cached, lambda: open(cached, "rb").read() if os.path.exists(cached) else None))
    known, found = {}, []
    for where, read in places:
        try:
            data = read()
            if data is None:
                continue
            index = json.loads(data)
            if (
                index.get("format") != FORMAT
                or index.get("version") != VERSION
                or [index.get("image_key"), index.get("label_key")] != [options.image_key, options.label_key]
            ):
                continue
            entries = [e for e in index["files"] if _sound(e)]
        except (OSError, UserError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring the record index %s (%s); the records are read again", where, e)
            continue
        useful = {(e["file"], e["stamp"]): e for e in entries}
        if useful:
            known.update(useful)
            found.append(where)
    return known, " and ".join(found)


def _sound(e) -> bool:
    """Whether an index entry is whole: offsets rising from 0 inside the file, a label of one kind for each."""
    try:
        offsets, labels = e["offsets"], e["labels"]
        kinds = {type(label) for label in labels}
        return (
            isinstance(e["file"], str)
            and isinstance(e["stamp"], str)
            and isinstance(e["bytes"], int)
            and all(
                isinstance(by, dict)
                and all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in by.values())
                for by in e["texts"].values()
            )
            and all(isinstance(b, list) and len(b) == 2 and isinstance(b[0], int) for b in e.get("bad", []))
            and len(offsets) == len(labels) > 0
            and all(isinstance(o, int) for o in offsets)
            and offsets[0] == 0
            and all(a < b for a, b in zip(offsets, offsets[1:]))
            and offsets[-1] < e["bytes"]
            and (kinds == {int} or kinds == {str})
        )
    except (KeyError, TypeError, IndexError, AttributeError):
        return False


def missing(source) -> list:
    """The files of ``source`` (a ``records.Source``) that its index lacks or has stale."""
    known, _ = _read_index(source.store, name_of(source), source.options)
    return [f for f in source.files if (f[0], f[2]) not in known]


def build(source, s3, flag: str, scanned: list[dict] = ()) -> list[dict]:
    """The index entries of ``source``'s files in their order: from the index, from ``scanned``, or read now.

    A changed index is written back: beside the files, else in the cache folder.
    """
    store, files, options = source.store, source.files, source.options
    name = name_of(source)
    known, where = _read_index(store, name, options)
    known.update({(e["file"], e["stamp"]): e for e in scanned})
    todo = [f for f in files if (f[0], f[2]) not in known]
    if todo:
        for entry in scan_files(store, todo, options, flag, s3):
            known[(entry["file"], entry["stamp"])] = entry
    entries = [known[(f[0], f[2])] for f in files]
    records = sum(len(e["offsets"]) for e in entries)
    what = f"{len(files)} TFRecord files of {storage.redact_url(store.url)} ({source.key or 'all'})"
    if todo or scanned or not where:
        where = _write(store, name, entries, options, source.key)
        log.info("indexed %d records in %s; the index is %s", records, what, where)
    else:
        log.info("%d records in %s, from the index %s", records, what, where)
    return entries


def _write(store: storage.Store, name: str, entries: list[dict], options, key: str) -> str:
    index = {
        "format": FORMAT,
        "version": VERSION,
        "source": [storage.redact_url(store.url), key],
        "image_key": options.image_key,
        "label_key": options.label_key,
        "files": entries,
    }
    data = json.dumps(index).encode()
    try:
        store.write(name, data)
        return store.full(name)
    except (OSError, UserError) as e:
        cached = _cached_path(store, name)
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            with hvd_files.replacing(cached, "wb") as f:
                f.write(data)
        except OSError as e2:
            log.warning("cannot keep the record index (%s; %s): the next run reads the records again", e, e2)
            return "not kept"
        return cached


def scan_files(store: storage.Store, todo: list, options, flag: str, s3) -> list[dict]:
    """The index entries of the files ``todo`` (``(name, size, stamp)``) of ``store``, ``THREADS`` at a time."""
    if not todo:
        return []
    started = time.perf_counter()
    with ThreadPoolExecutor(min(len(todo), THREADS), thread_name_prefix="hvd-train-index") as pool:
        entries = list(pool.map(lambda f: _scan(store, f, options, flag), todo))
    seconds = time.perf_counter() - started
    count = sum(len(e["offsets"]) for e in entries)
    log.info(
        "read %d records of %d TFRecord files in %.1f s (%.0f records/s)", count, len(todo), seconds, count / seconds
    )
    return entries


class _Window:
    """The bytes of one file, read forward ``WINDOW`` at a time (ranged reads): bounded memory for any file."""

    def __init__(self, store: storage.Store, name: str, size: int):
        self.store, self.name, self.size = store, name, size
        self.data, self.start = b"", 0  # the bytes held, and the file offset of the first

    def take(self, pos: int, count: int) -> bytes:
        """Bytes ``[pos, pos + count)``, fewer where the file ends; ``pos`` never goes back."""
        end = min(pos + count, self.size)
        held = self.start + len(self.data)
        if pos > held:  # not how a scan reads; start afresh there
            self.data, self.start, held = b"", pos, pos
        if end > held:
            more = self.store.read(self.name, held, min(self.size, max(end, held + WINDOW)))
            self.data, self.start = self.data[pos - self.start :] + more, pos
        return self.data[pos - self.start : end - self.start]


def _scan(store: storage.Store, listed: tuple[str, int, str], options, flag: str) -> dict:
    """One file's entry: every record's offset, label and label texts, its framing and checksums verified."""
    name, size, stamp = listed
    window = _Window(store, name, size)
    where = store.full(name)
    offsets, labels, texts, bad = [], [], {}, []
    pos = 0
    while pos < size:
        i = len(offsets)
        header = window.take(pos, 12)
        if i == 0 and header[:2] == b"\x1f\x8b":
            raise UserError(f"{where} is compressed (gzip) ({flag}); write the records uncompressed.")
        framed = len(header) == 12 and struct.unpack_from("<I", header, 8)[0] == _masked_crc(header[:8])
        if not framed:
            what = "is no TFRecord file" if i == 0 else f"is corrupt at record {i} (its length)"
            raise UserError(f"{where} {what} ({flag}); give TFRecord files, written whole.")
        (length,) = struct.unpack_from("<Q", header)
        body = window.take(pos + 12, length + 4)
        if len(body) < length + 4:
            raise UserError(f"{where} ends inside record {i}: a file cut short? ({flag}) Write it again.")
        record = body[:length]
        if struct.unpack_from("<I", body, length)[0] != _masked_crc(record):
            raise UserError(f"{where} is corrupt at record {i} (its checksum) ({flag}); write it again.")
        label, text, problem = _parse(record, options, f"record {i} of {where} ({flag})")
        if labels and type(label) is not type(labels[0]):
            raise UserError(
                f"record {i} of {where} ({flag}) has a {type(label).__name__} label and record 0 a "
                f"{type(labels[0]).__name__} one; give labels of one kind."
            )
        for key, value in text:
            seen = texts.setdefault(key, {}).setdefault(str(label), set())
            if len(seen) < 2:  # two tell that a label's text is not its name; more would only cost memory
                seen.add(value)
        if problem:
            bad.append([i, problem])
        offsets.append(pos)
        labels.append(label)
        pos += 16 + length
    if not offsets:
        raise UserError(f"{where} holds no records ({flag}); remove it, or give files with records.")
    texts = {key: {label: sorted(v) for label, v in by.items()} for key, by in texts.items()}
    entry = {"file": name, "stamp": stamp, "bytes": size, "offsets": offsets, "labels": labels, "texts": texts}
    return {**entry, "bad": bad}


def _parse(record: bytes, options, where: str) -> tuple[int | str, list[tuple[str, str]], str | None]:
    """A record's label, its label texts, and why its image does not decode (None when it does)."""
    try:
        feature = tf.train.Example.FromString(record).features.feature
    except Exception:  # protobuf's DecodeError
        raise UserError(f"{where} is no tf.train.Example; give records of images and labels.") from None
    have = ", ".join(sorted(feature)) or "none"
    for key, flag in ((options.image_key, "--record-image-key"), (options.label_key, "--record-label-key")):
        if key not in feature:
            raise UserError(f"{where} has no feature {key!r} (it has: {have}); name the right one with {flag}.")
    if len(feature[options.image_key].bytes_list.value) != 1:
        raise UserError(
            f"{where}: its feature {options.image_key!r} holds no encoded image (one bytes value); name the "
            f"image's feature with --record-image-key (the record has: {have})."
        )
    holder = feature[options.label_key]
    values = list(holder.int64_list.value) or list(holder.bytes_list.value)
    if len(values) != 1:
        raise UserError(
            f"{where}: its feature {options.label_key!r} holds {len(values) or 'no'} integer or string values, not "
            f"one label; name the label's feature with --record-label-key (the record has: {have})."
        )
    label = values[0]
    if isinstance(label, bytes):
        try:
            label = label.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{where}: its label {label!r} is not UTF-8 text; write labels as UTF-8.") from None
    texts = [
        (key, feature[key].bytes_list.value[0].decode("utf-8", "replace"))
        for key in TEXT_KEYS
        if key in feature and len(feature[key].bytes_list.value) == 1
    ]
    return label, texts, _problem(feature[options.image_key].bytes_list.value[0])


def _problem(image: bytes) -> str | None:
    """Why an image does not decode, or None: a JPEG, PNG or GIF that starts and ends as one passes, as a
    folder's quick check passes a file (``checks``); any other is decoded."""
    tail = image[-16:].rstrip(b"\0\r\n ")
    for start, end in FORMATS:
        if len(image) >= 16 and image.startswith(start) and tail.endswith(end):
            return None
    if not image:
        return "empty image (0 bytes)"
    try:
        decoded = decode(tf.constant(image))
    except Exception as e:  # TensorFlow's errors, and Pillow's own for a GIF
        return first_line(getattr(e, "message", "") or str(e)) or "unreadable"
    return None if 0 not in decoded.shape[:2] else "image has no pixels"
