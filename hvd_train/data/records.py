"""Other tools' TFRecord files as data, read in place: ``--data DIR`` or ``--data 'DIR/train-*'``.

A folder or ``s3://`` prefix of TFRecord files with no ``manifest.json`` of
``hvd-train pack`` (Model Garden's and the TPU reference ImageNet shards,
the files of a pipeline of one's own) is read as it is. Each record is a
``tf.train.Example``: the encoded image under ``--record-image-key``
(default ``image/encoded``), the label under ``--record-label-key``
(default ``image/class/label``), an integer less ``--label-offset`` (1 for
sets that count from 1) or a string. The files are those of the folder
whose names TFRecord files have (``*.tfrecord``, ``*.tfrec``,
``*-00000-of-01024``; of one set: ``train-*`` and ``validation-*`` in one
folder need a pattern), one file, or those a pattern in the last segment
matches.

The classes are the string labels, sorted; for integer labels the lines of
``--class-names``, else the records' ``image/class/synset`` or
``image/class/text`` when each label has one of its own, else the numbers.

A rank reads its exact share with ranged reads, as of a packed set, which
needs each record's byte offset: one pass over the files gives them (with
the labels, every checksum verified, every image checked). That pass is made once, each rank a
share of the files under a launcher, and kept as an index (``record_index``);
a later run whose files are unchanged starts from the index.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from hvd_train.data import record_classes, record_index, storage, tfds
from hvd_train.data.features import RecordFeatures, RecordOptions
from hvd_train.data.packed import MANIFEST, Shard, ShardSet
from hvd_train.data.table import is_table
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("data")

RECORD_NAME = re.compile(r"\.(tfrecords?|tfrec)(-\d+-of-\d+)?$|-\d+-of-\d+$", re.IGNORECASE)
COMPRESSED = re.compile(r"\.(tfrecords?|tfrec)(-\d+-of-\d+)?\.(gz|zz|zlib)$", re.IGNORECASE)
_PATTERN = re.compile(r"[*?\[]")
_NUMBERED = re.compile(r"-(\d+)-of-(\d+)")
PACKED_NAME = re.compile(r"shard-(\d{3}-)?\d{5}\.tfrecord")  # as hvd-train pack names its shards


def split_url(url: str) -> tuple[str, str]:
    """``(folder, pattern)`` of ``url``: a pattern or a file's name in its last segment, else ``""``.

    A last segment named as a TFRecord file is one (in S3 too), and a local
    file whose name has ``*``, ``?`` or ``[`` is that file.
    """
    head, _, last = url.rstrip("/").rpartition("/")
    if url.endswith("/") or not last:
        return url, ""
    named = _PATTERN.search(last) or RECORD_NAME.search(last) or COMPRESSED.search(last)
    if storage.is_s3(url):
        return (head, last) if named else (url, "")
    if os.path.isdir(url):
        return url, ""
    if named:
        return head or ("/" if url.startswith("/") else "."), last
    return url, ""


def is_records(url: str, s3: storage.S3Options | None = None) -> bool:
    """Whether ``url`` names TFRecord files of another tool (a pattern, a file, or a folder holding some, and no
    ``manifest.json``) or a prepared TFDS folder."""
    if not url or url.lower().endswith((".csv", ".tsv")):
        return False
    folder, pattern = split_url(url)
    if pattern:
        return True
    try:
        if storage.is_s3(url):
            names = storage.open_store(url, s3).children("", "--data")[1]
        elif os.path.isdir(url):
            names = [e.name for e in os.scandir(url) if e.is_file()]
        else:
            return False
    except OSError as e:
        raise UserError(f"cannot list {url} ({e.strerror or e}); check that it can be read.") from None
    found = [n for n in names if RECORD_NAME.search(n) or COMPRESSED.search(n)]
    if MANIFEST in names or (found and all(PACKED_NAME.fullmatch(n) for n in found)):
        return False  # a shard set, or the shards of a pack that has not finished (folder.py says so)
    return bool(found)  # a TFDS folder's shards are named so too


@dataclass(frozen=True)
class Source:
    """Records to read, found: the files of a folder (or a pattern), or of a TFDS folder's split.

    Attributes:
        store: the folder holding the files.
        files: ``(name, size, stamp)`` of each file, in reading order; a
            stamp changes when the file does (its size and modification time,
            or in S3 its ETag).
        options: the feature keys and labels in effect (a TFDS folder's own).
        key: what tells this set's index from another's in the same folder:
            the pattern, or the split.
        split: the TFDS split, if it is one (with its class names and
            records per file).
    """

    store: storage.Store
    files: tuple[tuple[str, int, str], ...]
    options: RecordOptions
    key: str
    split: tfds.Split | None = None


def source(
    url: str, flag: str, s3: storage.S3Options, options: RecordOptions, held_out: bool = False, warn: bool = False
) -> Source:
    """The records of ``url``: a folder's TFRecord files, those a pattern matches, or a TFDS folder's split
    (``options.split``; held-out data defaults to ``validation``). ``warn``: say what is odd (once a load)."""
    folder, pattern = split_url(url)
    store = storage.open_store(folder, s3)
    found = _listed(store, flag)
    where = f"{flag} {storage.redact_url(url)}"
    if not pattern and tfds.is_tfds(store):
        given = [f for f, _ in options.given()]
        if given and warn:
            log.info(
                "%s is a TFDS folder, which names its features and classes itself: %s is not applied",
                where,
                ", ".join(given),
            )
        split = tfds.split_of(store, options.split, held_out, flag, f"{flag}-split")
        by_name = {f[0]: f for f in found}
        absent = [name for name in split.files if name not in by_name]
        if absent:
            raise UserError(
                f"{len(absent)} of the {len(split.files)} files of split {split.name!r} are not in {where} "
                f"(the first: {absent[0]}); prepare the dataset again, or copy all of its files."
            )
        effective = RecordOptions(split.image_key, split.label_key)
        return Source(store, tuple(by_name[n] for n in split.files), effective, f"tfds:{split.name}", split)
    if options.split:
        raise UserError(f"{flag}-split tells which split of a TFDS folder is read, and {where} is none; leave it out.")
    if pattern and any(f[0] == pattern for f in found):
        files = [f for f in found if f[0] == pattern]
    elif pattern:
        files = sorted(f for f in found if fnmatch.fnmatchcase(f[0], pattern))
    else:
        files = sorted(f for f in found if RECORD_NAME.search(f[0]))
    compressed = [f[0] for f in files if COMPRESSED.search(f[0])] or (
        [] if files or pattern else [f[0] for f in found if COMPRESSED.search(f[0])]
    )
    if compressed:
        raise UserError(
            f"{storage.join(store.url, compressed[0])} is a compressed TFRecord file ({where}); a rank reads its "
            f"share of a file in byte ranges, which compression prevents: write the records uncompressed."
        )
    if not files:
        raise UserError(
            f"{where} matches no TFRecord file; give a folder of *.tfrecord files (in S3 with a trailing /), or a "
            f"pattern such as 'DIR/train-*'."
        )
    _check_families([f[0] for f in files], pattern, where, warn)
    return Source(store, tuple(files), options, pattern)


def _check_families(names: list[str], pattern: str, where: str, warn: bool) -> None:
    """A folder given whole (no ``pattern``) that holds training and held-out files is refused: numbered sets
    (``<prefix>-<i>-of-<n><suffix>``) of two prefixes, or names that start with ``train`` and with ``val``,
    ``test``, ``eval`` or ``dev``. A numbered set with fewer than ``n`` files is warned of, unless one file was
    named."""
    families: dict[str, tuple[int, set[int]]] = {}
    for name in names:
        found = list(_NUMBERED.finditer(name))
        if found:
            last = found[-1]
            glob = f"{name[: last.start()]}-*{name[last.end() :]}"
            families.setdefault(glob, (int(last.group(2)), set()))[1].add(int(last.group(1)))
    held = [n for n in names if n.lower().startswith(("val", "test", "eval", "dev"))]
    trained = [n for n in names if n.lower().startswith("train")]
    if not pattern and (len(families) > 1 or (held and trained)):
        sets = sorted(families) if len(families) > 1 else [f"{trained[0][:5]}*", f"{held[0][:3]}*"]
        folder = where.split(" ", 1)[1].rstrip("/")
        raise UserError(
            f"{where} holds the files of {len(sets)} sets ({', '.join(sets[:4])}): training and held-out records, "
            f"mostly. Give one with a pattern, e.g. '{folder}/{sets[0]}'."
        )
    one_file = pattern and not _PATTERN.search(pattern)
    for glob, (count, present) in sorted(families.items()):
        if len(present) < count and warn and not one_file:
            log.warning("%s has %d of the %d files of %s: the others are not read", where, len(present), count, glob)


def _listed(store: storage.Store, flag: str) -> list[tuple[str, int, str]]:
    """The files directly in ``store``'s folder, as ``(name, size, stamp)``; hidden files and indexes left out."""
    if isinstance(store, storage.S3Store):
        found = store.files_here(flag)
    else:
        try:
            entries = [(e.name, e.stat()) for e in os.scandir(store.url) if e.is_file()]
        except OSError as e:
            raise UserError(f"cannot list {store.url} ({e.strerror or e}); check {flag}.") from None
        found = [(name, st.st_size, f"{st.st_size}:{st.st_mtime_ns}") for name, st in entries]
    return [f for f in found if not f[0].startswith((".", record_index.PREFIX))]


def prepare(
    url: str, flag: str, s3: storage.S3Options, options: RecordOptions, ctx: Context, held_out: bool = False
) -> None:
    """Under a launcher: the index of ``url``'s records made by every rank, a share of the files each.

    Rank 0 finds which files its index lacks; each rank reads every
    ``size``-th of them; rank 0 writes the index. ``load`` then starts from
    it. Nothing is done for data that is not other tools' TFRecords, or on
    one process (``load`` makes the index itself).
    """
    if ctx.size == 1:
        return

    def plan():
        if not is_records(url, s3):
            return None
        folder, pattern = split_url(url)
        if held_out and not pattern and tfds.is_tfds(storage.open_store(folder, s3)) and not tfds_held_out(url, s3):
            return None  # a TFDS folder without a held-out split
        found = source(url, flag, s3, options, held_out)
        return found.store.url, found.options, record_index.missing(found)

    planned = ctx.on_root(plan, name=f"records_plan{flag}")
    if not planned or not planned[2]:
        return
    folder, effective, todo = planned
    store = storage.open_store(folder, s3)
    mine = ctx.agree(
        lambda: record_index.scan_files(store, todo[ctx.rank :: ctx.size], effective, flag, s3), name=f"records{flag}"
    )
    scanned = [entry for part in ctx.allgather_object(mine, name=f"records_scanned{flag}") for entry in part]
    ctx.on_root(
        lambda: record_index.build(source(url, flag, s3, options, held_out), s3, flag, scanned) and None,
        name=f"records_save{flag}",
    )


def tfds_held_out(url: str, s3: storage.S3Options | None, split: str = "") -> str:
    """The split a TFDS folder holds out: ``split`` when given, else the first of ``tfds.HELD_OUT`` it has
    ("": none)."""
    return split or tfds.held_out_name(storage.open_store(url, s3))


def refuse_unused(options: RecordOptions, *data) -> None:
    """Raises when an option of ``options`` is given and none of ``data`` is other tools' TFRecords (a TFDS
    folder names its features and classes itself)."""
    given = options.given()
    if given and not any(isinstance(d, ShardSet) and d.features.kind == "records" for d in data):
        raise UserError(
            f"{given[0][0]} tells how other tools' TFRecord files are read, and no data given names some; "
            f"leave it out.",
            agreed=True,
        )


def undivided(data: ShardSet, url: str) -> str:
    """Why ``--val-split`` cannot hold out images of the set ``data`` at ``url``, and what to pass instead."""
    if data.features.kind == "tfds":
        return (
            f"--data {url} is a split of a TFDS folder, which --val-split cannot divide; pass the folder as "
            f"--val-data too (its validation split, or --val-data-split NAME), or --val-split 0."
        )
    if data.features.kind == "records":
        return (
            f"--data {url} is a set of TFRecord files, which --val-split cannot divide; pass its held-out records "
            f"as --val-data (e.g. 'DIR/validation-*'), or --val-split 0."
        )
    return (
        f"--data {url} is a packed shard set, which --val-split cannot divide; pack the held-out images separately "
        f"(hvd-train pack --val-split) and pass --val-data, or pass --val-split 0."
    )


def refuse_split(split: str, flag: str, data, url: str) -> None:
    """Raises when ``flag`` names a split (``split``) and ``data`` (read from ``url``) is neither a TFDS folder's
    nor a CSV's (one without a column of splits was refused as it was read)."""
    if split and not (isinstance(data, ShardSet) and data.features.kind == "tfds") and not is_table(url):
        raise UserError(
            f"{flag} {split} tells which split of a TFDS folder or rows of a CSV are read, and its data is neither; "
            f"leave it out.",
            agreed=True,
        )


def load(
    url: str, flag: str, s3: storage.S3Options, options: RecordOptions | None = None, classes: list[str] | None = None
) -> ShardSet:
    """The TFRecord files of ``url`` as a ``ShardSet``, from their index (made first when it is missing or stale).

    Args:
        classes: the training classes when loading held-out data: the set's
            classes with records must be among them.
    """
    found = source(url, flag, s3, options or RecordOptions(), held_out=classes is not None, warn=True)
    where = f"{flag} {storage.redact_url(url)}"
    entries = record_index.build(found, s3, flag)
    if found.split is not None:
        short = [
            (e["file"], len(e["offsets"]), n) for e, n in zip(entries, found.split.lengths) if len(e["offsets"]) != n
        ]
        if short:
            name, have, want = short[0]
            raise UserError(
                f"{found.store.full(name)} holds {have} records where {tfds.INFO} says {want} ({flag}); "
                f"prepare the dataset again."
            )
    bad = [(e["file"], i, why) for e in entries for i, why in e.get("bad", [])]
    if bad:
        name, i, why = bad[0]
        raise UserError(
            f"{len(bad)} record(s) of {where} hold no image that decodes (the first: record {i} of "
            f"{found.store.full(name)}: {why}); a record cannot be passed over inside its file: write the files "
            f"again without them."
        )
    own, labels_of = record_classes.own_classes(entries, found, s3, where, len(classes) if classes else 0)
    counts_own = [0] * len(own)
    for e in entries:
        for label in labels_of(e):
            counts_own[label] += 1
    if classes is None:
        empty = [c for c, n in zip(own, counts_own) if n == 0]
        if empty:
            raise UserError(
                f"class {empty[0]!r} has no record in {where} ({len(empty)} of {len(own)} classes have none); every "
                f"class needs images to train on: check --class-names and --label-offset."
            )
        classes = own
    unknown = [c for c, n in zip(own, counts_own) if n and c not in classes]
    if unknown:
        raise UserError(
            f"class {unknown[0]!r} of {where} is not a training class; training classes are: "
            f"{', '.join(classes[:20])}{' ...' if len(classes) > 20 else ''}."
        )
    index = {c: i for i, c in enumerate(classes)}
    label_map = tuple(index.get(c, 0) if n else 0 for c, n in zip(own, counts_own))  # no record: never looked up
    counts = [0] * len(classes)
    for c, n in zip(own, counts_own):
        if n:
            counts[index[c]] += n
    shards = tuple(Shard(e["file"], len(e["offsets"]), e["bytes"], tuple(e["offsets"])) for e in entries)
    options = found.options
    vocabulary = tuple(own) if isinstance(entries[0]["labels"][0], str) else ()
    kind = "tfds" if found.split is not None else "records"
    features = RecordFeatures(options.image_key, options.label_key, options.label_offset, vocabulary, kind)
    return ShardSet(
        found.store.url,
        list(classes),
        shards,
        label_map,
        tuple(counts),
        digest=_digest(entries, features, own),
        features=features,
    )


def _digest(entries: list[dict], features: RecordFeatures, own: list[str]) -> str:
    """What the set holds (files, records, labels, how they are read), not where or when the files were written:
    the same set copied elsewhere has the same digest."""
    digest = hashlib.sha256(json.dumps([features.__dict__, own], sort_keys=True, default=list).encode())
    for e in entries:
        digest.update(json.dumps([e["file"], e["bytes"], e["labels"]]).encode())
        digest.update(np.asarray(e["offsets"], np.int64).tobytes())
    return digest.hexdigest()[:16]
