"""Labels from a table: ``--data labels.csv``, local or ``s3://``.

A CSV (or TSV) with a header row names each image and its label::

    path,label
    img/0001.jpg,cat
    img/0002,dog

The columns are found by their usual names (``PATH_COLUMNS``,
``LABEL_COLUMNS``, any case) or named with ``--path-column`` and
``--label-column``. An image's path is relative to the image root: the
CSV's folder, or ``--image-root``. An absolute path or an ``s3://`` URL is
taken when it lies below that root, and refused otherwise, as is ``..``: a
row's path never leaves its root (a symbolic link below the root is
followed, as in a folder tree). A name without an image extension (Kaggle's
``id``) is found with the extensions read here, in any letter case.

The result is an ``ImageSet`` in the order a folder's listing has: by
class, then by path. So the same images given as a folder tree
(``ROOT/<label>/<file>``) or as a CSV of ``<label>/<file>,<label>`` rows
are the same list, the same hold-out and the same training.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass

import numpy as np

from hvd_train.data import storage, table_splits
from hvd_train.data.folder import ImageSet, PathList
from hvd_train.data.table_files import Listing
from hvd_train.data.table_labels import (
    MULTI_LABEL_COLUMNS,
    cell_labels,
    column_labels,
    counted_labels,
    multi_image_set,
    refuse,
    refuse_unknown,
    same_columns,
    warn_of_lookalikes,
)
from hvd_train.data.table_splits import SPLIT_COLUMNS
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("data")

TABLE_SUFFIXES = (".csv", ".tsv")
# Header names looked for, in this order, when no column is named (compared without case).
PATH_COLUMNS = (
    "path",
    "filepath",
    "file_path",
    "file",
    "filename",
    "file_name",
    "image",
    "image_path",
    "id",
    "image_id",
)
LABEL_COLUMNS = ("label", "class", "category", "class_name", "target")


@dataclass(frozen=True)
class TableOptions:
    """How a CSV of labels is read (``DataConfig``'s table fields).

    Attributes:
        path_column: the column of image paths ("": found by name).
        label_column: the column of labels ("": found by name).
        image_root: the folder or ``s3://`` prefix paths are relative to
            ("": the CSV's folder).
        min_per_label: fewest rows a label of the training set may have.
        split_column: the column of splits ("": found by name, if any: ``table_splits``).
        multi_label: each row labels its image with a set of classes (``table_labels``), split by
            ``label_separator`` ("": spaces).
    """

    path_column: str = ""
    label_column: str = ""
    image_root: str = ""
    min_per_label: int = 2
    split_column: str = ""
    split: str = ""  # the rows of this split ("": as ``table_splits.chosen`` picks); not a flag of its own
    multi_label: bool = False
    label_separator: str = ""

    def given(self) -> list[tuple[str, object]]:
        """``(flag, value)`` of each option that is not its default: what a command with no CSV refuses."""
        unset = TableOptions()
        flags = {
            "image_root": "--image-root",
            "path_column": "--path-column",
            "label_column": "--label-column",
            "min_per_label": "--min-images-per-label",
            "split_column": "--split-column",
        }
        return [
            (flag, getattr(self, name)) for name, flag in flags.items() if getattr(self, name) != getattr(unset, name)
        ]


def is_table(url: str) -> bool:
    """Whether ``--data`` names a table of labels (by its suffix) rather than a folder or a shard set."""
    return url.lower().endswith(TABLE_SUFFIXES)


def read_table(
    url: str, flag: str, s3=None, options: TableOptions | None = None, classes: list[str] | None = None
) -> ImageSet:
    """The images a CSV of labels names, checked against what is there.

    Args:
        url: the CSV, local or ``s3://``.
        flag: the option that named it, for error messages.
        s3: ``storage.S3Options`` for ``s3://`` tables or roots.
        options: the columns, the image root and the fewest rows per label.
        classes: the training classes, when reading held-out images: a label
            then indexes into these, and any other label is an error.

    Raises:
        UserError: in one line, for a table that cannot be read, a column
            that is not there, a row that breaks a rule (the first few
            named by line), a file that is not there, a label on too few
            images, or fewer than two labels.
    """
    options = options or TableOptions()
    held_out = classes is not None
    where, prefix, resolved = _resolved(url, flag, s3 or storage.S3Options(), options, True, held_out, classes)[:3]
    return _image_set(resolved, prefix, classes, options.min_per_label, where)


def read_table_pair(
    url: str, flag: str, s3, options: TableOptions, held_split: str = ""
) -> tuple[ImageSet, ImageSet | None]:
    """The training images of a CSV, and its held-out images when it has a split column with held-out rows
    (``held_split``, or the first of ``table_splits.HELD_OUT`` it has); the CSV read once."""
    s3 = s3 or storage.S3Options()
    where, prefix, resolved, rows, has_splits = _resolved(url, flag, s3, options, True, False)
    train = _image_set(resolved, prefix, None, options.min_per_label, where)
    held = held_split or table_splits.held_out_split(rows, has_splits)
    if not held:
        return train, None
    kept = table_splits.chosen(rows, has_splits, held, True, where, "--val-data-split")
    log.info("%s: training on its split %r, holding out its split %r", where, options.split or "train", held)
    resolved = _found(kept, prefix, s3, where)
    return train, _image_set(resolved, prefix, train.classes, options.min_per_label, where)


def table_images(url: str, flag: str, options: TableOptions | None = None) -> list[str]:
    """The image files a local CSV names, in the order of its rows, its labels not read (what ``predict`` takes).

    Raises:
        UserError: as ``read_table`` does, but for labels; and for a CSV or images in S3.
    """
    options = options or TableOptions()
    if storage.is_s3(url) or storage.is_s3(options.image_root):
        raise UserError(f"{flag} {storage.redact_url(url)}: the CSV and its images must be local; {flag} reads no S3.")
    where, prefix, resolved = _resolved(url, flag, storage.S3Options(), options, False, False)[:3]
    return [prefix + name for _, name, _ in resolved]


def _resolved(url: str, flag: str, s3, options: TableOptions, labelled: bool, held_out: bool, classes=None):
    """``(where, prefix, [(line, real path relative to prefix, label)], rows, has_splits)`` of the rows of a CSV
    (of its split, if it has a column of splits: ``table_splits``), in its order; ``classes``: the training ones,
    which a held-out multi-label CSV's 0/1 columns must be."""
    where = f"{flag} {storage.redact_url(url)}"
    prefix = _prefix(options.image_root or _folder_of(url), where)
    rows, has_splits = _rows(_text(url, s3, where), url, options, where, labelled, classes)
    kept = table_splits.chosen(rows, has_splits, options.split, held_out, where, f"{flag}-split") if labelled else rows
    return where, prefix, _found(kept, prefix, s3, where, labelled), rows, has_splits


def _found(rows: list[tuple], prefix: str, s3, where: str, labelled: bool = True) -> list[tuple[int, str, str]]:
    """``[(line, real path relative to prefix, label)]`` of ``rows``, each checked and found."""
    hint = _root_hint(prefix)
    wanted, problems = [], []
    for line, value, label, _ in rows:
        rel, why = _relative(value, prefix)
        if why:
            problems.append(f"line {line}: {why}")
        elif labelled and not label and not isinstance(label, tuple):  # a set may be empty
            problems.append(f"line {line}: no label for {value}")
        else:
            wanted.append((line, value, rel, label if isinstance(label, tuple) else storage.nfc(label)))
    refuse(problems, f"{where}: {{n}} row(s) cannot be used", hint)
    if not wanted:
        raise UserError(f"{where} names no images; add a row per image below its header.")
    if not storage.is_s3(prefix) and not os.path.isdir(prefix):
        raise UserError(f"{where}: the image root {_shown(prefix)} is not a folder; check --image-root.")
    listing = Listing(prefix, s3, where)
    listing.find({rel.rpartition("/")[0] for _, _, rel, _ in wanted})
    resolved, missing, unclear = [], [], []
    for line, value, rel, label in wanted:
        name, why = listing.resolve(rel)
        if name is not None:
            resolved.append((line, name, label))
        else:
            (unclear if why else missing).append(f"line {line}: {value}{why}")
    refuse(missing, f"{where}: {{n}} of {len(wanted)} image(s) it names are not in {_shown(prefix)}", hint)
    refuse(unclear, f"{where}: {{n}} row(s) name no one image file", "name each image's file")
    first_line: dict[str, int] = {}
    twice = []
    for line, name, _ in resolved:
        seen = first_line.setdefault(name, line)
        if seen != line:
            twice.append(f"{name} on lines {seen} and {line}")
    refuse(twice, f"{where}: {{n}} image(s) are on more than one row", "give each image one row")
    return resolved


def _text(url: str, s3, where: str) -> str:
    if storage.is_s3(url):
        bucket, _, key = url[len("s3://") :].partition("/")
        if not bucket or not key:
            raise UserError(f"{where} names no object; write s3://BUCKET/KEY.csv.")
        if not storage.S3Store(f"s3://{bucket}/", s3).exists(key):
            raise UserError(f"{where} does not exist; check the path.")
        data = storage.read_url(url, s3)
    else:
        if os.path.isdir(url):
            raise UserError(f"{where} is a folder; a table of labels is a CSV file.")
        try:
            with open(url, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise UserError(f"{where} does not exist; check the path.") from None
        except OSError as e:
            raise UserError(f"{where} cannot be read ({e.strerror}); check its permissions.") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(
            f"{where} is UTF-16 (Excel's Unicode text); save it as CSV UTF-8, or convert it (iconv -f utf-16 -t utf-8)."
        )
    try:
        return data.decode("utf-8-sig")  # a byte-order mark, as Excel writes one, is not part of the header
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{where} is not UTF-8 (byte {data[e.start]:#04x} on line {line}); save it as UTF-8 "
            f"(from Latin-1: iconv -f latin1 -t utf-8)."
        ) from None


def _rows(
    text: str, url: str, options: TableOptions, where: str, labelled: bool, classes=None
) -> tuple[list[tuple], bool]:
    """``(line, path, label, split)`` of each row below the header, stripped (the other columns are not kept),
    and whether the CSV has a column of splits; not ``labelled``: "" for a label, unless the CSV has a column of
    labels."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lower().startswith("sep=") and len(first.strip()) == 5:  # Excel's line naming the delimiter
        delimiter, text = first.strip()[4], text.replace(first, "", 1)
    elif url.lower().endswith(".tsv"):
        delimiter = "\t"
    else:
        try:
            delimiter = csv.Sniffer().sniff(first, delimiters=",;\t").delimiter
        except csv.Error:
            delimiter = ","
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header: list[str] | None = None
    rows = []
    try:
        for cells in reader:
            if not any(c.strip() for c in cells):
                continue  # blank lines
            if header is None:
                header = [c.strip() for c in cells]
                if len(header) == 1 and any(d in header[0] for d in ",;\t"):
                    raise UserError(
                        f"{where}: its header {header[0]!r} is one column split by no {delimiter!r}; write the "
                        f"table with one delimiter, commas in a .csv, tabs in a .tsv."
                    )
                path_at = _column(header, options.path_column, PATH_COLUMNS, "--path-column", "", where, False)
                usual = (*MULTI_LABEL_COLUMNS, *LABEL_COLUMNS) if options.multi_label else LABEL_COLUMNS
                needed = labelled and not options.multi_label  # a multi-label CSV may have a 0/1 column per class
                label_at = _column(header, options.label_column, usual, "--label-column", "labels", where, needed)
                if path_at < 0:
                    _no_column(header, PATH_COLUMNS, "--path-column", "image paths", where, labelled)
                split_at = _column(header, options.split_column, SPLIT_COLUMNS, "--split-column", "", where, False)
                class_at = [i for i in range(len(header)) if i not in (path_at, split_at)]
                if labelled and options.multi_label and label_at < 0 and not class_at:
                    _no_column(header, usual, "--label-column", "labels", where, True)
                if labelled and options.multi_label and label_at < 0 and classes is not None:
                    same_columns([header[i] for i in class_at], classes, where)
                continue
            if len(cells) != len(header):
                raise UserError(
                    f"{where}: line {reader.line_num} has {len(cells)} column(s) where its header has "
                    f"{len(header)} ({', '.join(header)}); quote a value that holds a {delimiter!r}, and end "
                    f"no row with one."
                )
            label = cells[label_at].strip() if label_at >= 0 else ""
            if labelled and options.multi_label:
                label = (
                    cell_labels(label, options.label_separator)
                    if label_at >= 0
                    else column_labels(header, cells, class_at, reader.line_num, where)
                )
            rows.append(
                (reader.line_num, cells[path_at].strip(), label, cells[split_at].strip() if split_at >= 0 else "")
            )
    except csv.Error as e:
        raise UserError(f"{where}: line {reader.line_num} cannot be read as CSV ({e}).") from None
    if header is None:
        example = "path,label" if labelled else "path"
        raise UserError(f"{where} is empty; it needs a header row (e.g. {example}) and a row per image.")
    return rows, split_at >= 0


def _column(
    header: list[str], named: str, usual: tuple[str, ...], option: str, what: str, where: str, needed: bool = True
) -> int:
    """The index of the column ``named`` or of the first ``usual`` one (-1: none, and not ``needed``)."""
    lowered = [h.lower() for h in header]
    if named:
        if named.lower() not in lowered:
            raise UserError(f"{where} has no column {named!r} ({option}); its columns are: {', '.join(header)}.")
        return lowered.index(named.lower())
    for name in usual:
        if name in lowered:
            return lowered.index(name)
    if needed:
        _no_column(header, usual, option, what, where, True)
    return -1


def _no_column(header: list[str], usual: tuple[str, ...], option: str, what: str, where: str, labelled: bool):
    example = "path,label" if labelled else "path"
    raise UserError(
        f"{where} has no column of {what} ({'/'.join(usual[:4])}, ...); its columns are: {', '.join(header)}. "
        f"Name it with {option}, or, if that row is the first image's, add a header such as {example} above it."
    )


def _prefix(folder: str, where: str) -> str:
    """The image root as the paths below it start: with its ``/`` (``/`` for the file system's root), an S3
    prefix as its store keys it (``s3://b//p`` is ``s3://b/p/``)."""
    if storage.is_s3(folder):
        bucket, _, key = folder[len("s3://") :].partition("/")
        if not bucket:
            raise UserError(f"{where}: the image root {folder} names no bucket; write s3://BUCKET/PREFIX.")
        key = key.strip("/")
        return f"s3://{bucket}/" + (key + "/" if key else "")
    folder = os.path.abspath(folder)
    return folder if folder.endswith("/") else folder + "/"


def _shown(prefix: str) -> str:
    return prefix.rstrip("/") or "/"


def _folder_of(url: str) -> str:
    if storage.is_s3(url):
        return url.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(url))


def _relative(value: str, prefix: str) -> tuple[str, str]:
    """``value`` as a path relative to the image root ``prefix``, or why it cannot be one."""
    if not value:
        return "", "no image path"
    if "\\" in value or "\0" in value:
        return "", f"{value!r} holds a backslash or a NUL; write paths with '/'"
    head, rel = "", value
    if storage.is_s3(value):
        head, rel = "s3://", value[len("s3://") :]
    elif value.startswith("/"):
        head = "/"
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        return "", f"{value} leaves the image root {_shown(prefix)} (..)"
    if head:  # an absolute path or a URL, written out as the root's paths are
        whole = head + "/".join(parts)
        if not whole.startswith(prefix):
            return "", f"{value} is not below the image root {_shown(prefix)}"
        parts = whole[len(prefix) :].split("/") if whole != prefix.rstrip("/") else []
    if not parts or not parts[-1]:
        return "", f"{value} names no file"
    hidden = next((p for p in parts if p.startswith(".")), None)
    if hidden:
        return "", f"{value} names a hidden file or folder ({hidden}), which a folder's listing passes over"
    return "/".join(parts), ""


def _root_hint(prefix: str) -> str:
    return f"paths are relative to {_shown(prefix)} (--image-root names another)"


def _image_set(resolved, prefix: str, classes: list[str] | None, least: int, where: str) -> ImageSet:
    if resolved and isinstance(resolved[0][2], tuple):
        return multi_image_set(resolved, prefix, classes, least, where)
    rows = [(line, (label,)) for line, _, label in resolved]
    if classes is None:
        names = counted_labels(rows, least, where)  # as class folders' names sort: the same classes and indices
        if len(names) < 2:
            raise UserError(f"{where} has {len(names)} label ({', '.join(names)}); a classifier needs at least 2.")
        warn_of_lookalikes(names, where)
        classes = names
    else:
        refuse_unknown(rows, classes, where)
    index = {c: i for i, c in enumerate(classes)}
    # Names alike in all but their Unicode form (a tie of the canonical key) in the order of their bytes.
    order = sorted(
        range(len(resolved)),
        key=lambda i: (index[resolved[i][2]], storage.canonical_key(resolved[i][1]), resolved[i][1]),
    )
    return ImageSet(
        PathList.of(prefix, [resolved[i][1] for i in order]),
        np.asarray([index[resolved[i][2]] for i in order], np.int32),
        list(classes),
        prefix=prefix,
    )
