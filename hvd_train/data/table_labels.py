"""A CSV's labels as sets, for multi-label sets (``TableOptions.multi_label``).

A row names its labels in one cell, split by ``label_separator`` (default:
spaces; ``|`` as ChestX-ray14 writes them, ``;``), or with a 0/1 column per
class when the CSV has no column of labels (every column but the path and
the split is then a class). An image may have no label. The classes are
the labels sorted (or the columns, sorted); the images are in path order.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from hvd_train.data import storage
from hvd_train.data.folder import ImageSet, PathList
from hvd_train.data.label_sets import LabelSets
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("data")
SHOWN = 3  # rows or labels named in an error or a warning

MULTI_LABEL_COLUMNS = ("labels", "tags")  # looked for before the single-label names


def cell_labels(cell: str, separator: str) -> tuple[str, ...]:
    """The labels of one cell, each stripped, sorted, without repeats."""
    parts = cell.split(separator) if separator else cell.split()
    return tuple(sorted({storage.nfc(p.strip()) for p in parts if p.strip()}))


def column_labels(header: list[str], cells: list[str], class_at: list[int], line: int, where: str) -> tuple:
    """The classes whose 0/1 column holds 1 in this row."""
    found = []
    for i in class_at:
        value = cells[i].strip()
        try:
            number = float(value) if value else 0.0
        except ValueError:
            number = -1.0
        if number not in (0.0, 1.0):
            raise UserError(
                f"{where}: line {line} has {value!r} in the column {header[i]!r}, where a class's column holds 0 or "
                f"1; name the column of paths and splits if it is one (--path-column, --split-column)."
            )
        if number == 1.0:
            found.append(storage.nfc(header[i]))
    return tuple(sorted(found))


def same_columns(columns: list[str], classes: list[str], where: str) -> None:
    """Refuses a held-out multi-label CSV of 0/1 columns without a column for each training class (each image
    would count as a negative of that class). A column that is no class may be there (one the training CSV had,
    never 1): a row holding 1 in it is refused by ``refuse_unknown``, by line."""
    named = {storage.nfc(c) for c in columns}
    missing = [c for c in classes if c not in named]
    if missing:
        more = " and more" if len(missing) > SHOWN else ""
        raise UserError(
            f"{where}: its columns of 0/1 have none for {len(missing)} of the run's {len(classes)} classes "
            f"({', '.join(map(repr, missing[:SHOWN]))}{more}); give a column per class, named as in training "
            f"(labels.json)."
        )


def refuse(problems: list[str], what: str, fix: str) -> None:
    """One error naming the first ``SHOWN`` of ``problems`` and counting the rest (``what`` holds ``{n}``)."""
    if problems:
        more = f" and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise UserError(
            f"{what.format(n=len(problems))}: {'; '.join(problems[:SHOWN])}{more}" + (f"; {fix}." if fix else ".")
        )


def counted_labels(rows, least: int, where: str) -> list[str]:
    """The labels of ``rows`` (``(line, labels)`` pairs), sorted as class folders' names sort; a label on fewer
    than ``least`` images is refused, at its first line."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for line, labels in rows:
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
            first.setdefault(label, line)
    names = sorted(counts)
    refuse(
        [f"{n!r} on {counts[n]} (line {first[n]})" for n in names if counts[n] < least],
        f"{where}: {{n}} label(s) are on fewer than {least} images",
        "a typo? fix or remove those rows, or pass --min-images-per-label 1",
    )
    return names


def refuse_unknown(rows, classes: list[str], where: str, hint: str = "") -> None:
    """Refuses the first label of ``rows`` (``(line, labels)`` pairs) that is not a training class."""
    unknown = next(((line, label) for line, labels in rows for label in labels if label not in classes), None)
    if unknown:
        raise UserError(
            f"{where}: line {unknown[0]} has label {unknown[1]!r}, which is not a training class{hint}; training "
            f"classes are: {', '.join(classes)}."
        )


def multi_image_set(resolved: list, prefix: str, classes: list[str] | None, least: int, where: str) -> ImageSet:
    """The ImageSet of rows ``(line, path, labels)`` whose labels are sets: its ``label_sets`` into the classes."""
    rows = [(line, labels) for line, _, labels in resolved]
    if classes is None:
        classes = counted_labels(rows, least, where)
        if not classes:
            raise UserError(f"{where} labels no image; a multi-label set needs at least one label.")
    else:
        refuse_unknown(rows, classes, where, " (a multi-label cell is split as the run's --label-separator says)")
    index = {c: i for i, c in enumerate(classes)}
    order = sorted(range(len(resolved)), key=lambda i: (storage.canonical_key(resolved[i][1]), resolved[i][1]))
    sets = LabelSets.of([index[label] for label in resolved[i][2]] for i in order)
    return ImageSet(
        PathList.of(prefix, [resolved[i][1] for i in order]),
        np.zeros(len(order), np.int32),  # replaced by each set's lowest class
        list(classes),
        prefix=prefix,
        label_sets=sets,
    )


def warn_of_lookalikes(names: list[str], where: str) -> None:
    """A warning for labels that differ only in case, spaces or the form of a number (``Cat``/``cat``, ``1``/``1.0``),
    which are as many classes."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        key = " ".join(name.casefold().split())
        try:
            key = repr(float(key))
        except ValueError:
            pass
        groups[key].append(name)
    alike = ["/".join(repr(n) for n in group) for group in groups.values() if len(group) > 1]
    if alike:
        log.warning(
            "%s: labels %s differ only in case, spaces or the form of a number, and are as many classes; make them "
            "one label in the CSV if they name one class",
            where,
            ", ".join(alike[:SHOWN]),
        )
