"""Labelled image folders: ``ROOT/<class>/.../<image>``, local or ``s3://``.

Classes are the sorted names of the top-level folders; images in nested
sub-folders belong to their top-level class. Listing happens once (on rank 0)
and the result is shared, so every rank agrees on files, labels and order.

The order is the same wherever the tree lives: images sorted by their path
relative to ROOT, segment by segment, in Unicode normal form C
(``storage.canonical_key``). A local walk and an S3 listing of the same
tree therefore give the same list, the same ``--val-split`` hold-out, the
same epochs and, with ``--deterministic``, the same weights. Class names
are NFC too, so a class folder named on macOS (NFD) matches its name typed
anywhere else.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from hvd_train.data import storage
from hvd_train.data.label_sets import LabelSets, every_class_trained, split_keys
from hvd_train.errors import UserError
from hvd_train.log import Ticker, get_logger

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")

log = get_logger("data")


class PathList(Sequence[str]):
    """Many file paths below one prefix, held as one UTF-8 buffer and the end of each path in it.

    A Python list of 1.28 million paths costs about 150 MB per rank and as
    much again as a pickle to broadcast; this costs the bytes of the
    relative paths and 8 bytes a path, in two objects that pickle as they
    are. Indexing gives ``prefix + relative path``, as a list would.
    """

    def __init__(self, prefix: str, blob: bytes, ends: np.ndarray):
        self.prefix = prefix
        self.blob = blob
        self.ends = np.asarray(ends, dtype=np.int64)

    @classmethod
    def of(cls, prefix: str, relatives: Iterable[str]) -> PathList:
        """The paths ``prefix + r`` for each of ``relatives``."""
        return cls.of_bytes(prefix, [storage.os_bytes(r) for r in relatives])

    def __len__(self) -> int:
        return int(self.ends.size)

    def starts(self) -> np.ndarray:
        return np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def relative(self, i: int) -> str:
        """Path ``i`` without the prefix, as the file system or the store names it."""
        start = int(self.ends[i - 1]) if i > 0 else 0
        return self.blob[start : int(self.ends[i])].decode("utf-8", "surrogateescape")

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self.prefix + self.relative(i % n)

    def __iter__(self) -> Iterator[str]:
        prefix = self.prefix
        return (prefix + r for r in self.relatives())

    def relatives(self) -> Iterator[str]:
        """Every path without the prefix, in order."""
        text = self.blob.decode("ascii") if self.blob.isascii() else None
        start = 0
        for end in self.ends.tolist():
            yield text[start:end] if text is not None else self.blob[start:end].decode("utf-8", "surrogateescape")
            start = end

    def take(self, indices) -> PathList:
        """The paths at ``indices``, in that order."""
        indices = np.asarray(indices, np.int64)
        starts, ends, blob = self.starts()[indices].tolist(), self.ends[indices].tolist(), self.blob
        return PathList.of_bytes(self.prefix, [blob[a:b] for a, b in zip(starts, ends)])

    @classmethod
    def of_bytes(cls, prefix: str, encoded: list[bytes]) -> PathList:
        """The paths ``prefix + e`` for each of ``encoded`` (UTF-8 relative paths)."""
        ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)))
        return cls(prefix, b"".join(encoded), ends)

    def __eq__(self, other) -> bool:
        if isinstance(other, PathList):
            return (self.prefix, self.blob) == (other.prefix, other.blob) and np.array_equal(self.ends, other.ends)
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths below {self.prefix!r})"

    def nbytes(self) -> int:
        return len(self.blob) + self.ends.nbytes


def as_paths(paths: Sequence[str], prefix: str = "") -> PathList:
    """``paths`` as a ``PathList`` below ``prefix`` (every path must start with it)."""
    if isinstance(paths, PathList) and paths.prefix == prefix:
        return paths
    return PathList.of(prefix, (p[len(prefix) :] for p in paths))


@dataclass(frozen=True, eq=False)
class ImageSet:
    """Image files with integer labels into ``classes``.

    Attributes:
        paths: image file paths (or ``s3://`` URLs), in canonical order (a
            list is turned into a ``PathList`` below ``prefix``).
        labels: class index of each path (an int32 array).
        classes: class names; a label indexes into this list.
        ignored: files that were passed over because they are not images.
        prefix: what every path starts with: the listed root and a ``/``
            ("" for lists that were not made by listing a root).
        skipped: ``(path, reason)`` of images left out because they cannot
            be decoded (``without``).
        label_sets: a multi-label set's labels, each image's set of classes
            (``labels`` then holds each set's lowest class, -1 for none).
    """

    paths: PathList
    labels: np.ndarray
    classes: list[str]
    ignored: list[str] = field(default_factory=list)
    prefix: str = ""
    skipped: tuple[tuple[str, str], ...] = ()
    label_sets: LabelSets | None = None

    def __post_init__(self):
        object.__setattr__(self, "paths", as_paths(self.paths, self.prefix))
        if self.label_sets is not None:
            object.__setattr__(self, "labels", self.label_sets.first())
        object.__setattr__(self, "labels", np.asarray(self.labels, dtype=np.int32).reshape(-1))
        if self.labels.size != len(self.paths):
            raise ValueError(f"{len(self.paths)} paths but {self.labels.size} labels")

    def __len__(self) -> int:
        return len(self.paths)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ImageSet):
            return NotImplemented
        return (
            self.paths == other.paths
            and np.array_equal(self.labels, other.labels)
            and (self.classes, self.ignored, self.prefix, self.skipped, self.label_sets)
            == (other.classes, other.ignored, other.prefix, other.skipped, other.label_sets)
        )

    def nbytes(self) -> int:
        """Bytes the paths and labels take in memory."""
        return self.paths.nbytes() + self.labels.nbytes + (self.label_sets.nbytes if self.label_sets else 0)

    def counts(self) -> list[int]:
        """Images per class (labelled with it, in a multi-label set), in class order."""
        if self.label_sets is not None:
            return self.label_sets.counts(len(self.classes))
        return np.bincount(self.labels.astype(np.int64), minlength=len(self.classes)).tolist()

    def _sets(self, indices) -> LabelSets | None:
        return self.label_sets.take(indices) if self.label_sets is not None else None

    def subset(self, indices) -> ImageSet:
        indices = np.asarray(indices, dtype=np.int64)
        return ImageSet(
            self.paths.take(indices),
            self.labels[indices],
            self.classes,
            prefix=self.prefix,
            label_sets=self._sets(indices),
        )

    def without(self, bad: list[tuple[str, str]]) -> ImageSet:
        """These images without ``bad`` (``(path, reason)`` pairs), which are kept as ``skipped``."""
        gone = {p for p, _ in bad}
        keep = [i for i, p in enumerate(self.paths) if p not in gone]
        return ImageSet(
            self.paths.take(keep),
            self.labels[keep],
            self.classes,
            self.ignored,
            self.prefix,
            self.skipped + tuple(bad),
            self._sets(keep),
        )

    def relative(self, i: int) -> str:
        """Path ``i`` relative to the listed root (NFC): the same for a local tree and its S3 copy."""
        return storage.nfc(self.paths.relative(i))

    @functools.cached_property
    def digest(self) -> str:
        """A digest of the classes and of every image's relative path and label, in order.

        Equal for the same tree on local disk and in S3; different as soon as
        an image is added, removed, renamed or relabelled, or the split changes.
        """
        h = hashlib.sha256()
        h.update("\0".join(self.classes).encode() + b"\n")
        labels = self.labels.tolist()
        if self.label_sets is not None:  # "m" and each set: never a single-label list's digest
            labels = ["m" + " ".join(map(str, row)) for row in self.label_sets.rows()]
        for label, rel in zip(labels, self.paths.relatives()):
            # ASCII is its own NFC.
            h.update(storage.os_bytes(f"{label}\t{rel if rel.isascii() else storage.nfc(rel)}\n"))
        return h.hexdigest()[:16]


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def list_folder(root: str, flag: str = "--data", classes: list[str] | None = None, s3=None) -> ImageSet:
    """Lists a labelled image folder, on local disk or in S3.

    Class folders are listed in parallel (threads: the time goes into file
    system or S3 round trips), with a line every few seconds on how far
    the listing got.

    Args:
        root: the folder (or ``s3://bucket/prefix/``) whose sub-folders are the classes.
        flag: the option that named ``root``, for error messages.
        classes: the training classes, when listing held-out data: labels
            then index into these, and an unknown class is an error.
        s3: ``storage.S3Options`` for an ``s3://`` root.

    Returns:
        The images in canonical order (class, then relative path; see the
        module docstring). S3 images are ``s3://`` URLs.

    Raises:
        UserError: the folder is missing or empty, a class has no images,
            there are fewer than two classes, two class folders differ only
            in their Unicode form, or (with ``classes``) a class is not one
            of the training classes.
    """
    if storage.is_s3(root):
        return _list_s3(root, flag, classes, s3)
    if not os.path.exists(root):
        raise UserError(f"data folder {root} does not exist; check {flag}.")
    if not os.path.isdir(root):
        raise UserError(f"{root} is not a folder; {flag} takes a folder with one sub-folder per class.")
    prefix = root if root.endswith("/") else root + "/"
    entries = sorted(e for e in os.listdir(root) if not e.startswith("."))
    found = [e for e in entries if os.path.isdir(prefix + e)]
    stray = [e for e in entries if e not in found]
    return _labelled(prefix, found, stray, lambda name: _walk(prefix, name), flag, classes)


def _list_s3(root: str, flag: str, classes: list[str] | None, s3) -> ImageSet:
    """The S3 version of ``list_folder``: class = first key segment below the prefix."""
    store = storage.S3Store(root, s3 or storage.S3Options())
    files: dict[str, tuple[list[str], list[str]]] = {}
    stray = []
    with Ticker(log, f"listing {flag} {storage.redact_url(root)}", unit="objects") as ticker:
        listed = store.list_by_folder(flag, ticker)
    for rel, _size in listed:
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        if "/" not in rel:
            stray.append(rel)
            continue
        images, others = files.setdefault(rel.split("/", 1)[0], ([], []))
        (images if is_image_name(rel) else others).append(rel)
    if not files and not stray:
        raise UserError(f"no objects below {store.url}; check the bucket and prefix in {flag}.")
    prefix = store.url if store.url.endswith("/") else store.url + "/"
    return _labelled(prefix, list(files), stray, lambda name: files[name], flag, classes)


def _labelled(prefix, found, stray, walk, flag, classes) -> ImageSet:
    """The ImageSet of class folders ``found`` below ``prefix``.

    ``walk(folder)`` gives the folder's images and other files, as paths
    relative to ``prefix`` (any order); it is called for all folders at
    once on a pool of threads.
    """
    root = prefix.rstrip("/") or "/"
    if not found and any(name.startswith("shard-") and name.endswith(".tfrecord") for name in stray):
        raise UserError(
            f"{root} holds shards but no manifest.json: the pack was interrupted or is still running; "
            f"run hvd-train pack again ({flag})."
        )
    if not found:
        raise UserError(f"data folder {root} has no class folders; put images in {root}/<class>/ ({flag}).")
    ignored = [prefix + e for e in stray]
    if stray:
        log.warning(
            "ignored %d file(s) at the top of %s that are in no class folder, e.g. %s", len(stray), root, stray[0]
        )
    # Class names in NFC, folders in the order of their names.
    folder_of: dict[str, str] = {}
    for name in found:
        if not _is_utf8(name):
            raise UserError(
                f"class folder {storage.os_bytes(root + '/' + name)!r} ({flag}) has a name that is not valid UTF-8 "
                f"(an older tool's Latin-1?), so it cannot name a class; rename it in UTF-8 "
                f"(e.g. convmv -f latin1 -t utf8 -r --notest {root})."
            )
        other = folder_of.setdefault(storage.nfc(name), name)
        if other != name:
            raise UserError(
                f"class folders {root}/{other} and {root}/{name} ({flag}) have the same name in two Unicode "
                f"forms (composed and decomposed accents, as macOS writes them); merge them into one folder."
            )
    found = sorted(folder_of)
    if classes is None:
        classes = found
    else:
        unknown = [c for c in found if c not in classes]
        if unknown:
            raise UserError(
                f"class folder {root}/{folder_of[unknown[0]]} ({flag}) is not a training class; "
                f"training classes are: {', '.join(classes)}. Rename or remove it."
            )
    index = {c: i for i, c in enumerate(classes)}
    relatives: list[str] = []
    labels: list[np.ndarray] = []
    with Ticker(log, f"listing {flag} {storage.redact_url(root)}", len(found), "class folders") as ticker:

        def walk_one(name):
            listed = walk(folder_of[name])
            ticker.count += 1
            return listed

        with concurrent.futures.ThreadPoolExecutor(min(16, len(found))) as pool:
            for name, (images, others) in zip(found, pool.map(walk_one, found)):
                ignored.extend(prefix + rel for rel in _in_order(others))
                if not images:
                    raise UserError(
                        f"class {name!r} ({root}/{folder_of[name]}) has no images "
                        f"({', '.join(e.lstrip('.') for e in IMAGE_EXTENSIONS)}); add images or remove the folder."
                    )
                relatives.extend(_in_order(images))
                labels.append(np.full(len(images), index[name], np.int32))
    if len(classes) < 2:
        raise UserError(
            f"data folder {root} has {len(classes)} class folder ({', '.join(classes)}); "
            f"a classifier needs at least 2 ({flag})."
        )
    if len(ignored) > len(stray):
        log.warning(
            "ignored %d file(s) in %s that are not images (%s), e.g. %s",
            len(ignored) - len(stray),
            root,
            "/".join(IMAGE_EXTENSIONS),
            ignored[len(stray)],
        )
    return ImageSet(PathList.of(prefix, relatives), np.concatenate(labels), list(classes), ignored, prefix)


def _in_order(relatives: list[str]) -> list[str]:
    """Relative paths of one class folder in canonical order (``storage.canonical_key``).

    The common case, ASCII names and no folder below the class folder, is
    a plain string sort: the same order, ten times faster.
    """
    plain = all(r.isascii() and r.count("/") == 1 for r in relatives)
    return sorted(relatives) if plain else sorted(relatives, key=storage.canonical_key)


def _walk(prefix: str, folder: str) -> tuple[list[str], list[str]]:
    """Images and other files below ``prefix + folder``, relative to ``prefix`` (any order)."""
    images, others = [], []
    cut = len(prefix)
    for dirpath, dirnames, filenames in os.walk(prefix + folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        base = dirpath[cut:] + "/"
        for name in filenames:
            if name.startswith("."):
                continue
            (images if is_image_name(name) else others).append(base + name)
    return images, others


def split_per_class(images: ImageSet, fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
    """Holds out ``fraction`` of each class (MATLAB's splitEachLabel); of a multi-label set, of the images keyed by
    their rarest class (``label_sets.split_keys``), every class then keeping a training image.

    The split depends only on the file list and ``seed``, so every rank and
    every resumed run makes the same one. Each class keeps at least one
    training image and, when it has two or more, gives at least one.

    Returns:
        ``(train, held_out)``.
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(images.labels)
    keys = len(images.classes)
    if images.label_sets is not None:  # a multi-label set: each image by its rarest class
        labels, keys = split_keys(images.label_sets, keys), keys + 1
    train_idx, val_idx = [], []
    for c in range(keys):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(round(len(idx) * fraction))
        if fraction > 0 and len(idx) >= 2:
            n_val = min(max(n_val, 1), len(idx) - 1)
        else:
            n_val = 0
        val_idx.extend(sorted(idx[:n_val].tolist()))
        train_idx.extend(sorted(idx[n_val:].tolist()))
    if images.label_sets is not None:
        train_idx, val_idx = every_class_trained(images.label_sets, len(images.classes), train_idx, val_idx)
    return images.subset(sorted(train_idx)), images.subset(sorted(val_idx))
