"""Packed datasets: TFRecord shards plus ``manifest.json``, local or in S3.

One object per image is slow to list and to fetch; ``hvd-train pack`` writes
the images of a labelled folder, in a seeded random order, into shards of
about ``--shard-size`` bytes. Each record is a ``tf.train.Example`` with the
original encoded image (``image/encoded``), its label (``image/class/label``)
and its path below the source (``image/filename``); the files are standard
TFRecord files that ``tf.data.TFRecordDataset`` reads too.

``manifest.json`` lists the classes and, per shard, its images, bytes,
SHA-256 and the byte offset of every record. The offsets let a rank read
exactly the records it is given with ranged reads, so shards of any size are
divided among any number of ranks with equal step counts. The manifest is
written last, after any previous one was removed: a manifest never points at
a missing or partial shard.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass

import google_crc32c
import numpy as np

from hvd_train.compat import tf
from hvd_train.data import storage
from hvd_train.data.features import RecordFeatures
from hvd_train.data.fetcher import Fetcher
from hvd_train.data.folder import ImageSet, list_folder, split_per_class
from hvd_train.data.images import DEFAULT_ALPHA_BACKGROUND, flatten_alpha, report_bad_images, sort_out
from hvd_train.data.table import TableOptions, is_table, read_table_pair
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.files import plain_name
from hvd_train.log import Ticker, get_logger

MANIFEST = "manifest.json"
FORMAT = "hvd_train.shards"
VERSION = 1

log = get_logger("pack")


def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its CRC, the data, its CRC (CRC32C, masked)."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", _masked_crc(length)) + record + struct.pack("<I", _masked_crc(record))


def unframe(data: bytes, count: int, where: str) -> list[bytes]:
    """The ``count`` records at the start of ``data``, their checksums verified.

    Raises:
        UserError: naming ``where`` when the bytes are not intact records.
    """
    records = []
    pos = 0
    view = memoryview(data)
    for i in range(count):
        header = bytes(view[pos : pos + 12])
        if len(header) < 12:
            raise UserError(f"{where} is truncated at record {i}; pack the data again (hvd-train pack).")
        (length,) = struct.unpack("<Q", header[:8])
        (length_crc,) = struct.unpack("<I", header[8:])
        end = pos + 12 + length + 4
        if length_crc != _masked_crc(header[:8]) or end > len(data):
            raise UserError(f"{where} is corrupt at record {i} (bad length); pack the data again (hvd-train pack).")
        record = bytes(view[pos + 12 : pos + 12 + length])
        (data_crc,) = struct.unpack("<I", view[end - 4 : end])
        if data_crc != _masked_crc(record):
            raise UserError(f"{where} is corrupt at record {i} (checksum mismatch); pack the data again.")
        records.append(record)
        pos = end
    return records


def example(image: bytes, label: int, name: str) -> bytes:
    feature = {
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        "image/filename": tf.train.Feature(bytes_list=tf.train.BytesList(value=[storage.os_bytes(name)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


@dataclass(frozen=True)
class Shard:
    file: str
    images: int
    bytes: int
    offsets: tuple[int, ...]

    def span(self, first: int, last: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of records ``first`` ... ``last - 1``."""
        end = self.offsets[last] if last < self.images else self.bytes
        return self.offsets[first], end


@dataclass(frozen=True)
class ShardSet:
    """A packed dataset: classes and shards, read through ``url``.

    Attributes:
        url: the folder or ``s3://`` prefix holding the shards.
        classes: class names in label order.
        shards: the shards in manifest order.
        label_map: maps the set's own labels to the training classes'.
        class_counts: images per class (of ``classes``).
        alpha_background: what ``pack`` composited transparent images over
            ("" for sets packed before it did).
        digest: a digest of the manifest's classes, counts and shards: the
            same set wherever it is read from, another one once repacked.
        features: how a record gives its image and label (other tools'
            files name them otherwise: ``data.records``).
    """

    url: str
    classes: list[str]
    shards: tuple[Shard, ...]
    label_map: tuple[int, ...]
    class_counts: tuple[int, ...]
    alpha_background: str = ""
    digest: str = ""
    features: RecordFeatures = RecordFeatures()

    def __len__(self) -> int:
        return sum(s.images for s in self.shards)

    def counts(self) -> list[int]:
        """Images per class, in class order."""
        return list(self.class_counts)

    @property
    def starts(self) -> np.ndarray:
        """Global index of each shard's first record (manifest order)."""
        return np.concatenate([[0], np.cumsum([s.images for s in self.shards])])


def is_shard_set(url: str, s3: storage.S3Options | None = None) -> bool:
    """True when ``url`` holds a ``manifest.json`` written by ``hvd-train pack``."""
    return storage.open_store(url, s3).exists(MANIFEST)


def load(url: str, flag: str, s3: storage.S3Options | None = None, classes: list[str] | None = None) -> ShardSet:
    """Reads the manifest of the shard set at ``url``.

    Args:
        classes: the training classes when loading held-out data: the set's
            classes must be among them, and labels are mapped onto them.
    """
    store = storage.open_store(url, s3)
    try:
        manifest = json.loads(store.read(MANIFEST))
    except ValueError as e:
        raise UserError(f"cannot read {store.full(MANIFEST)} ({e}); pack the data again ({flag}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(
            f"{store.full(MANIFEST)} is not a manifest of {FORMAT} version {VERSION}; "
            f"pack the data with this version of hvd-train ({flag})."
        )
    own = list(manifest["classes"])
    if classes is None:
        classes = own
    unknown = [c for c in own if c not in classes]
    if unknown:
        raise UserError(
            f"class {unknown[0]!r} of {store.url} ({flag}) is not a training class; "
            f"training classes are: {', '.join(classes)}."
        )
    shards = tuple(Shard(s["file"], int(s["images"]), int(s["bytes"]), tuple(s["offsets"])) for s in manifest["shards"])
    for shard in shards:
        # ``pack`` writes plain names: a manifest that names ``../x`` or ``/x`` would read outside the set.
        if not plain_name(shard.file):
            raise UserError(
                f"{store.full(MANIFEST)} names the shard {shard.file!r}, which is no file of the set ({flag}); "
                f"pack the data again."
            )
    if not shards or sum(s.images for s in shards) == 0:
        raise UserError(f"shard set {store.url} has no images ({flag}); pack a folder with images.")
    counts = [0] * len(classes)
    for c, n in zip(own, manifest["class_counts"]):
        counts[classes.index(c)] += int(n)
    identity = {k: manifest.get(k) for k in ("classes", "class_counts", "shards", "seed", "alpha_background")}
    return ShardSet(
        store.url,
        list(classes),
        shards,
        tuple(classes.index(c) for c in own),
        tuple(counts),
        str(manifest.get("alpha_background", "")),
        hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16],
    )


def parse_size(text: str) -> int:
    """``128MB``, ``1GiB``, ``65536`` ... as a number of bytes."""
    units = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20}
    units.update({"G": 1e9, "GB": 1e9, "GIB": 2**30})
    t = str(text).strip().upper()
    number = t.rstrip("KMGIB")
    try:
        value = int(float(number) * units[t[len(number) :].strip()])
    except (KeyError, ValueError):
        raise UserError(f"--shard-size {text!r} is not a size; write e.g. 128MB, 1GB or 65536.") from None
    if value < 1024:
        raise UserError(f"--shard-size {text!r} is too small; use at least 1KB (default 128MB).")
    return value


def pack(
    src: str,
    dst: str,
    *,
    shard_size: int,
    on_bad_image: str,
    seed: int,
    s3: storage.S3Options,
    overwrite: bool = False,
    val_split: float = 0.0,
    alpha_background: str = DEFAULT_ALPHA_BACKGROUND,
    ctx: Context | None = None,
    table: TableOptions | None = None,
) -> dict[str, dict]:
    """Packs the labelled folder ``src`` (or the images a CSV of labels names, read with ``table``) into shards at
    ``dst``.

    With ``val_split``, ``val_split`` of each class goes to ``dst/val`` and
    the rest to ``dst/train`` (MXNet's im2rec ``--train-ratio``). Images
    with transparent pixels are stored composited over
    ``alpha_background``, as PNG; all others byte for byte.

    Under ``horovodrun``/``mpirun`` (``ctx`` of several ranks) rank 0 lists
    ``src``; each rank packs one contiguous part of the seeded record order
    into shards of its own; rank 0 writes the manifest last, listing every
    rank's shards in rank order, so the records come in the same order as
    from one process.

    Returns:
        The manifests written, by destination (on rank 0; empty on the others).

    Raises:
        UserError: on every rank, for a bad source, an existing manifest
            without ``overwrite``, or (``on_bad_image == "fail"``) an unreadable image.
    """
    ctx = ctx or Context()

    def listing():
        images, held = read_table_pair(src, "SRC", s3, table or TableOptions()) if is_table(src) else (None, None)
        images = list_folder(src, "SRC", s3=s3) if images is None else images
        if held is not None:  # a CSV's own held-out rows, as --val-split would have packed them
            if val_split > 0:
                raise UserError(f"SRC {src} holds out rows of its own (its split column); leave --val-split out.")
            parts = [(storage.join(dst, "train"), images), (storage.join(dst, "val"), held)]
        elif val_split > 0:
            train, val = split_per_class(images, val_split, seed)
            parts = [(storage.join(dst, "train"), train), (storage.join(dst, "val"), val)]
        else:
            parts = [(dst, images)]
        for url, _ in parts:
            out = storage.open_store(url, s3)
            if out.exists(MANIFEST):
                if not overwrite:
                    raise UserError(f"{out.full(MANIFEST)} exists already; pass --overwrite to replace that shard set.")
                # Remove the old manifest first: from now on no manifest points at
                # shards that are being replaced.
                out.delete(MANIFEST)
        return parts

    parts = ctx.on_root(listing, name="pack_list")
    # A CSV's images are read below its image root, a folder's below the folder.
    source = storage.open_store(parts[0][1].prefix if is_table(src) else src, s3)
    written = {}
    for url, part in parts:
        out = storage.open_store(url, s3)
        share = ctx.agree(
            lambda out=out, part=part: _pack_share(
                part, source, out, shard_size, on_bad_image, seed, s3, src, alpha_background, ctx
            ),
            name=f"pack.{url}",
        )
        shares = ctx.allgather_object(share, name=f"pack_shares.{url}")
        manifest = ctx.on_root(
            lambda out=out, part=part, shares=shares: _write_manifest(part, out, shares, seed, src, alpha_background),
            name=f"pack_manifest.{url}",
        )
        if ctx.is_root:
            written[out.url] = manifest
    return written


def _pack_share(images, source, out, shard_size, on_bad_image, seed, s3, src, alpha_background, ctx) -> dict:
    """Packs this rank's part of the seeded order of ``images`` into shards of its own."""
    root = source.url.rstrip("/") + "/"
    order = np.random.default_rng(seed).permutation(len(images))
    mine = np.array_split(order, ctx.size)[ctx.rank]
    fetcher = Fetcher(s3.concurrency if storage.is_s3(source.url) else 8)

    def read(i: int) -> bytes:
        return source.read(images.paths[i][len(root) :])

    # One process: shard-00000...; several: shard-<rank>-00000..., so no two ranks write one name.
    writer = _ShardWriter(out, shard_size, f"{ctx.rank:03d}-" if ctx.size > 1 else "")
    bad: list[tuple[str, str]] = []
    counts = np.zeros(len(images.classes), dtype=np.int64)
    started = time.perf_counter()
    composited = 0
    with Ticker(log, f"packing to {storage.redact_url(out.url)}", len(mine), "images") as ticker:
        for i, contents in _checked(fetcher.stream(mine.tolist(), read), images, bad, on_bad_image):
            flat = flatten_alpha(contents, alpha_background)
            if flat is not None:
                contents, composited = flat, composited + 1
            label = int(images.labels[i])
            writer.add(example(contents, label, images.paths[i][len(root) :]))
            counts[label] += 1
            ticker.count += 1
        writer.close()
    return {
        "shards": writer.shards,
        "bad": bad,
        "counts": counts.tolist(),
        "composited": composited,
        "seconds": time.perf_counter() - started,
    }


def _write_manifest(images, out, shares: list[dict], seed, src, alpha_background) -> dict:
    """Rank 0, after every rank packed its share: stale shards removed, then the manifest, last."""
    shards = [shard for share in shares for shard in share["shards"]]
    if not shards:
        raise UserError(f"no readable images to pack for {out.url} (SRC {storage.redact_url(src)}).")
    stale = {rel for rel, _ in out.list("DST") if rel.startswith("shard-")} - {s["file"] for s in shards}
    for rel in sorted(stale):
        out.delete(rel)
    counts = np.sum([share["counts"] for share in shares], axis=0)
    bad = sorted(item for share in shares for item in share["bad"])
    composited = sum(share["composited"] for share in shares)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "classes": images.classes,
        "class_counts": counts.tolist(),
        "images": int(counts.sum()),
        "bytes": sum(s["bytes"] for s in shards),
        "seed": seed,
        "alpha_background": alpha_background,
        "composited": composited,
        "source": storage.redact_url(src),
        "skipped": [{"path": p, "reason": r} for p, r in bad],
        "shards": shards,
    }
    out.write(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    seconds = max(share["seconds"] for share in shares)
    log.info(
        "packed %d images (%d classes) into %d shard(s), %.1f MB, at %s in %.1f s "
        "(%.0f images/s on %d process(es))%s%s",
        manifest["images"],
        len(images.classes),
        len(shards),
        manifest["bytes"] / 1e6,
        out.url,
        seconds,
        manifest["images"] / max(seconds, 1e-9),
        len(shares),
        f"; skipped {len(bad)} unreadable image(s)" if bad else "",
        f"; {composited} with transparency composited over {alpha_background}" if composited else "",
    )
    return manifest


def _checked(stream, images: ImageSet, bad: list, policy: str):
    """Yields ``(index, contents)`` of decodable images; lists or fails on the others."""
    for i, contents, reason in sort_out(stream):
        if reason is None:
            yield i, contents
            continue
        path = images.paths[i]
        if policy == "fail":
            report_bad_images([(path, reason)], policy, "SRC")  # raises the one message for an unreadable image
        bad.append((path, reason))
        log.warning("skipped %s: %s", path, reason)


class _ShardWriter:
    """Collects framed records; writes a shard whenever it reaches the size."""

    def __init__(self, store: storage.Store, shard_size: int, name_part: str = ""):
        self.store = store
        self.shard_size = shard_size
        self.name_part = name_part
        self.shards: list[dict] = []
        self._parts: list[bytes] = []
        self._offsets: list[int] = []
        self._bytes = 0

    def add(self, record: bytes) -> None:
        framed = frame(record)
        if self._parts and self._bytes + len(framed) > self.shard_size:
            self._flush()
        self._offsets.append(self._bytes)
        self._parts.append(framed)
        self._bytes += len(framed)

    def close(self) -> None:
        if self._parts:
            self._flush()

    def _flush(self) -> None:
        data = b"".join(self._parts)
        name = f"shard-{self.name_part}{len(self.shards):05d}.tfrecord"
        self.store.write(name, data)
        self.shards.append(
            {
                "file": name,
                "images": len(self._offsets),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "offsets": self._offsets,
            }
        )
        self._parts, self._offsets, self._bytes = [], [], 0
