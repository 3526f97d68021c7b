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

import functools
import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

from hvd_train.data import storage
from hvd_train.errors import UserError
from hvd_train.log import get_logger

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")

log = get_logger("data")


@dataclass(frozen=True)
class ImageSet:
    """Image files with integer labels into ``classes``.

    Attributes:
        paths: image file paths (or ``s3://`` URLs), in canonical order.
        labels: class index of each path.
        classes: class names; a label indexes into this list.
        ignored: files that were passed over because they are not images.
        prefix: what every path starts with: the listed root and a ``/``
            ("" for lists that were not made by listing a root).
    """

    paths: list[str]
    labels: list[int]
    classes: list[str]
    ignored: list[str] = field(default_factory=list)
    prefix: str = ""

    def __len__(self) -> int:
        return len(self.paths)

    def counts(self) -> list[int]:
        """Images per class, in class order."""
        return np.bincount(np.asarray(self.labels, dtype=np.int64), minlength=len(self.classes)).tolist()

    def subset(self, indices) -> ImageSet:
        return ImageSet(
            [self.paths[i] for i in indices], [self.labels[i] for i in indices], self.classes, prefix=self.prefix
        )

    def without(self, bad: set[str]) -> ImageSet:
        keep = [i for i, p in enumerate(self.paths) if p not in bad]
        return ImageSet(
            [self.paths[i] for i in keep], [self.labels[i] for i in keep], self.classes, self.ignored, self.prefix
        )

    def relative(self, i: int) -> str:
        """Path ``i`` relative to the listed root (NFC): the same for a local tree and its S3 copy."""
        return storage.nfc(self.paths[i][len(self.prefix) :])

    @functools.cached_property
    def digest(self) -> str:
        """A digest of the classes and of every image's relative path and label, in order.

        Equal for the same tree on local disk and in S3; different as soon as
        an image is added, removed, renamed or relabelled, or the split changes.
        """
        h = hashlib.sha256()
        h.update("\0".join(self.classes).encode() + b"\n")
        for i, label in enumerate(self.labels):
            h.update(f"{label}\t{self.relative(i)}\n".encode())
        return h.hexdigest()[:16]


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def list_folder(root: str, flag: str = "--data", classes: list[str] | None = None, s3=None) -> ImageSet:
    """Lists a labelled image folder, on local disk or in S3.

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
    for rel, _size in store.list(flag):
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        if "/" not in rel:
            stray.append(rel)
            continue
        images, others = files.setdefault(rel.split("/", 1)[0], ([], []))
        (images if is_image_name(rel) else others).append(store.full(rel))
    if not files and not stray:
        raise UserError(f"no objects below {store.url}; check the bucket and prefix in {flag}.")
    prefix = store.url if store.url.endswith("/") else store.url + "/"
    return _labelled(prefix, list(files), stray, lambda name: files[name], flag, classes)


def _labelled(prefix, found, stray, walk, flag, classes) -> ImageSet:
    """The ImageSet of class folders ``found`` below ``prefix`` (``walk(folder)``: its images, others)."""
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
    paths: list[str] = []
    labels: list[int] = []
    for name in found:
        images, others = walk(folder_of[name])
        ignored.extend(sorted(others, key=lambda path: storage.canonical_key(path[len(prefix) :])))
        if not images:
            raise UserError(
                f"class {name!r} ({root}/{folder_of[name]}) has no images "
                f"({', '.join(e.lstrip('.') for e in IMAGE_EXTENSIONS)}); add images or remove the folder."
            )
        images.sort(key=lambda path: storage.canonical_key(path[len(prefix) :]))
        paths.extend(images)
        labels.extend([index[name]] * len(images))
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
    return ImageSet(paths, labels, list(classes), ignored, prefix)


def _walk(prefix: str, folder: str) -> tuple[list[str], list[str]]:
    """Images and other files below ``prefix + folder``, as ``prefix + relative path`` (any order)."""
    images, others = [], []
    for dirpath, dirnames, filenames in os.walk(prefix + folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            (images if is_image_name(name) else others).append(os.path.join(dirpath, name))
    return images, others


def split_per_class(images: ImageSet, fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
    """Holds out ``fraction`` of each class (MATLAB's splitEachLabel).

    The split depends only on the file list and ``seed``, so every rank and
    every resumed run makes the same one. Each class keeps at least one
    training image and, when it has two or more, gives at least one.

    Returns:
        ``(train, held_out)``.
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(images.labels)
    train_idx, val_idx = [], []
    for c in range(len(images.classes)):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(round(len(idx) * fraction))
        if fraction > 0 and len(idx) >= 2:
            n_val = min(max(n_val, 1), len(idx) - 1)
        else:
            n_val = 0
        val_idx.extend(sorted(idx[:n_val].tolist()))
        train_idx.extend(sorted(idx[n_val:].tolist()))
    return images.subset(sorted(train_idx)), images.subset(sorted(val_idx))
