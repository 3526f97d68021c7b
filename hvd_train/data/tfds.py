"""Prepared TFDS folders as data: ``--data ~/tensorflow_datasets/imagenet2012/5.1.0``, local or ``s3://``.

``tensorflow_datasets`` prepares a dataset into a folder of TFRecord shards
and the JSON that describes them: ``dataset_info.json`` (the splits, each
with its file name template and records per shard), ``features.json`` (the
features: which one is the image, which the class label) and
``<label>.labels.txt`` (the class names). That is all this module reads;
``tensorflow_datasets`` itself is not imported. A split's files are then
read as other tools' TFRecords are (``data.records``): through an index of
their offsets, made once.

The split is ``--data-split`` (default ``train``) for training data, and for
held-out data ``--val-data-split`` or evaluate's ``--data-split`` (default
``validation``, else ``test``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hvd_train.data import storage
from hvd_train.data.record_classes import check_names
from hvd_train.errors import UserError
from hvd_train.files import plain_name

INFO, FEATURES = "dataset_info.json", "features.json"
TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"  # TFDS's default file names
HELD_OUT = ("validation", "test")


@dataclass(frozen=True)
class Split:
    """One split of a prepared TFDS folder: its files, records per file, and the features to read."""

    name: str
    files: tuple[str, ...]
    lengths: tuple[int, ...]
    image_key: str
    label_key: str
    classes: tuple[str, ...]


def is_tfds(store: storage.Store) -> bool:
    """Whether ``store`` (a folder of TFRecord files) is a prepared TFDS folder."""
    return store.exists(INFO)


def held_out_name(store: storage.Store) -> str:
    """The first of ``HELD_OUT`` that the TFDS folder ``store`` has as a split ("": none, or no readable
    description: reading the training split says why)."""
    try:
        return _held_out(_splits(json.loads(store.read(INFO))))
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError, UserError):
        return ""


def _splits(info: dict) -> dict[str, dict]:
    """A description's splits by name."""
    return {s.get("name"): s for s in info.get("splits", []) if isinstance(s, dict)}


def _held_out(splits: dict) -> str:
    """The first of ``HELD_OUT`` among ``splits`` ("": none)."""
    return next((s for s in HELD_OUT if s in splits), "")


def split_of(store: storage.Store, split: str, held_out: bool, flag: str, split_flag: str) -> Split:
    """The split ``split`` of the TFDS folder ``store`` (``""``: ``train``, or held out ``validation``/``test``).

    Raises:
        UserError: naming the folder and the fix, for a split it lacks, files
            in another format, features that are no image and class label, or
            a description that is not as TFDS writes it.
    """
    where = f"{flag} {storage.redact_url(store.url)}"
    try:
        return _split_of(store, split, held_out, where, split_flag)
    except (ValueError, TypeError, AttributeError, KeyError, UnicodeDecodeError, OverflowError, RecursionError) as e:
        raise UserError(
            f"{where}: its {INFO} or {FEATURES} is not as TFDS writes it ({type(e).__name__}: {e}); prepare the "
            f"dataset again."
        ) from None


def _split_of(store: storage.Store, split: str, held_out: bool, where: str, split_flag: str) -> Split:
    info = _json(store, INFO, where)
    fmt = info.get("fileFormat") or "tfrecord"
    if fmt != "tfrecord":
        raise UserError(
            f"{where} is a TFDS folder of {fmt} files; only TFRecord files are read: prepare it with "
            f"file_format='tfrecord'."
        )
    splits = _splits(info)
    if not split:
        split = (_held_out(splits) or HELD_OUT[0]) if held_out else "train"
    if split not in splits:
        raise UserError(
            f"{where} has no split {split!r}; its splits are: {', '.join(sorted(map(str, splits))) or 'none'}. "
            f"Name one with {split_flag}."
        )
    lengths = tuple(int(n) for n in splits[split].get("shardLengths", []))
    template = splits[split].get("filepathTemplate") or TEMPLATE
    count = len(lengths)
    files = tuple(
        template.replace("{DATASET}", str(info.get("name", "")))
        .replace("{SPLIT}", split)
        .replace("{FILEFORMAT}", fmt)
        .replace("{SHARD_INDEX}", f"{i:05d}")
        .replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{count:05d}")
        .replace("{NUM_SHARDS}", f"{count:05d}")
        for i in range(count)
    )
    if not files:
        raise UserError(f"{where}: {INFO} names no files of split {split!r}; prepare the dataset again.")
    if not all(map(plain_name, files)):
        raise UserError(
            f"{where}: {INFO} names the files of split {split!r} as {files[0]!r}, not files of its own folder, "
            f"which are all that is read."
        )
    image_key, label_key, classes = _features(store, info, where)
    return Split(split, files, lengths, image_key, label_key, classes)


def _features(store: storage.Store, info: dict, where: str) -> tuple[str, str, tuple[str, ...]]:
    """The image's and the class label's feature keys, and the class names."""
    described = _json(store, FEATURES, where) if store.exists(FEATURES) else info.get("features", {})
    features = described.get("featuresDict", {}).get("features", {})
    kinds = {key: str(f.get("pythonClassName", "")).rsplit(".", 1)[-1] for key, f in features.items()}
    supervised = [i.get("featureKey") for i in info.get("supervisedKeys", {}).get("tuple", {}).get("items", [])]

    def one(kind: str, what: str) -> str:
        named = [k for k in supervised if kinds.get(k) == kind]
        found = named or [k for k, v in kinds.items() if v == kind]
        if len(found) != 1:
            have = ", ".join(f"{k} ({v})" for k, v in sorted(kinds.items())) or "none"
            raise UserError(
                f"{where} has {len(found) or 'no'} {kind} features where one {what} is read; its features: {have}."
            )
        return found[0]

    image_key, label_key = one("Image", "image"), one("ClassLabel", "class label")
    names_file = f"{label_key.replace('/', '-')}.labels.txt"
    if store.exists(names_file):
        classes = tuple(line.strip() for line in store.read(names_file).decode("utf-8").splitlines() if line.strip())
        check_names(list(classes), store.full(names_file), "prepare the dataset again")
    else:
        count = int(features[label_key].get("classLabel", {}).get("numClasses", 0))
        classes = tuple(str(i) for i in range(count))
    if not classes:
        raise UserError(f"{where}: the class label {label_key!r} names no classes; prepare the folder again.")
    return image_key, label_key, classes


def _json(store: storage.Store, name: str, where: str) -> dict:
    try:
        found = json.loads(store.read(name))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {store.full(name)} ({e}) ({where}); prepare the TFDS folder again.") from None
    if not isinstance(found, dict):
        raise UserError(f"{store.full(name)} is no TFDS description ({where}); prepare the TFDS folder again.")
    return found
