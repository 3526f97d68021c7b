"""The index of other tools' TFRecord files: each record's byte offset and label, made once, kept for the next run.

One pass reads every file whole: each record's framing and both of its
checksums verified, its ``tf.train.Example`` parsed for the image's
presence, the label and the text of the label (``TEXT_KEYS``). The index
keeps per file its name, stamp (size and modification time, or ETag),
length, offsets, labels and texts, as JSON:
``hvd_train-index-<digest>.json`` beside the files when their folder can be
written, else in the cache folder (``$HVD_TRAIN_CACHE/record-index``).
Entries count only while their file's stamp and the feature keys are
unchanged: a new or rewritten file is read again, the others are not.
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
from hvd_train.data.packed import _masked_crc
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("data")

FORMAT, VERSION = "hvd_train.record_index", 1
PREFIX = "hvd_train-index-"
TEXT_KEYS = ("image/class/synset", "image/class/text")


def name_of(source) -> str:
    """The index's file name for the records of ``source`` (a ``records.Source``: its pattern or split, and
    keys)."""
    key = json.dumps([source.key, source.options.image_key, source.options.label_key])
    return f"{PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def _cached_path(store: storage.Store, name: str) -> str:
    where = hashlib.sha256(storage.redact_url(store.url).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(hvd_files.cache_base(), "record-index", f"{where}-{name}")


def _read_index(store: storage.Store, name: str, options) -> tuple[dict[tuple[str, str], dict], str]:
    """The usable entries of an existing index, by ``(file, stamp)``, and where it was found."""
    places = [(store.full(name), lambda: store.read(name) if store.exists(name) else None)]
    cached = _cached_path(store, name)
    places.append((cached, lambda: open(cached, "rb").read() if os.path.exists(cached) else None))
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
            return {(e["file"], e["stamp"]): e for e in index["files"]}, where
        except (OSError, UserError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring the record index %s (%s); the records are read again", where, e)
    return {}, ""


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
    """The index entries of the files ``todo`` (``(name, size, stamp)``) of ``store``, read on a pool of threads."""
    if not todo:
        return []
    started = time.perf_counter()
    threads = min(len(todo), s3.concurrency if storage.is_s3(store.url) else 4)
    with ThreadPoolExecutor(threads, thread_name_prefix="hvd-train-index") as pool:
        entries = list(pool.map(lambda f: _scan(store, f, options, flag), todo))
    seconds = time.perf_counter() - started
    count = sum(len(e["offsets"]) for e in entries)
    log.info(
        "read %d records of %d TFRecord files in %.1f s (%.0f records/s)", count, len(todo), seconds, count / seconds
    )
    return entries


def _scan(store: storage.Store, listed: tuple[str, int, str], options, flag: str) -> dict:
    """One file's entry: every record's offset, label and label texts, its framing and checksums verified."""
    name, size, stamp = listed
    data = store.read(name)
    where = store.full(name)
    if len(data) != size:
        raise UserError(f"{where} changed while it was read ({flag}); read it again once it is written.")
    offsets, labels, texts = [], [], {}
    pos, view = 0, memoryview(data)
    while pos < len(data):
        i = len(offsets)
        if len(data) - pos < 16:
            raise UserError(f"{where} ends inside record {i}: a file cut short? ({flag}) Write it again.")
        (length,) = struct.unpack_from("<Q", data, pos)
        if struct.unpack_from("<I", data, pos + 8)[0] != _masked_crc(data[pos : pos + 8]):
            what = "is no TFRecord file" if i == 0 else f"is corrupt at record {i} (its length's checksum)"
            raise UserError(f"{where} {what} ({flag}); give TFRecord files, written whole.")
        end = pos + 12 + length
        if end + 4 > len(data):
            raise UserError(f"{where} ends inside record {i}: a file cut short? ({flag}) Write it again.")
        record = bytes(view[pos + 12 : end])
        if struct.unpack_from("<I", data, end)[0] != _masked_crc(record):
            raise UserError(f"{where} is corrupt at record {i} (its checksum) ({flag}); write it again.")
        label, text = _parse(record, options, f"record {i} of {where} ({flag})")
        for key, value in text:
            texts.setdefault(key, {}).setdefault(str(label), set()).add(value)
        offsets.append(pos)
        labels.append(label)
        pos = end + 4
    if not offsets:
        raise UserError(f"{where} holds no records ({flag}); remove it, or give files with records.")
    texts = {key: {label: sorted(v) for label, v in by.items()} for key, by in texts.items()}
    return {"file": name, "stamp": stamp, "bytes": len(data), "offsets": offsets, "labels": labels, "texts": texts}


def _parse(record: bytes, options, where: str) -> tuple[int | str, list[tuple[str, str]]]:
    """A record's label and label texts; its image checked present."""
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
    values = list(holder.int64_list.value) or [v.decode("utf-8", "replace") for v in holder.bytes_list.value]
    if len(values) != 1:
        raise UserError(
            f"{where}: its feature {options.label_key!r} holds {len(values) or 'no'} integer or string values, not "
            f"one label; name the label's feature with --record-label-key (the record has: {have})."
        )
    texts = [
        (key, feature[key].bytes_list.value[0].decode("utf-8", "replace"))
        for key in TEXT_KEYS
        if key in feature and len(feature[key].bytes_list.value) == 1
    ]
    return values[0], texts
