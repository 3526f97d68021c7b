"""A CSV's split column: which rows train, which are held out (``--data-split``, ``--val-data-split``).

Many tables mark each row's split (Kaggle's and labelling tools' ``split``
column: ``train``, ``validation``, ``test``). When a CSV has such a column
(found by name, ``SPLIT_COLUMNS``, or named with ``--split-column``), its
training rows are the ``train`` split (or ``--data-split``) and its
held-out rows the first of ``HELD_OUT`` it has (or ``--val-data-split``):
``--data labels.csv`` alone trains on the one and holds out the other. An
image on rows of two splits is refused: it would be trained on and scored.
"""

from __future__ import annotations

from hvd_train.errors import UserError

SPLIT_COLUMNS = ("split", "subset", "partition")
TRAIN = "train"
HELD_OUT = ("validation", "val", "valid", "dev", "test")


def held_out_split(rows: list[tuple], has_splits: bool) -> str:
    """The split a CSV holds out by default: the first of ``HELD_OUT`` that its rows have ("": none)."""
    present = {row[3] for row in rows}
    return next((s for s in HELD_OUT if s in present), "") if has_splits else ""


def chosen(rows: list[tuple], has_splits: bool, split: str, held_out: bool, where: str, split_flag: str) -> list:
    """The rows of split ``split`` ("": ``train``, or held out the default held-out split); all rows when the
    CSV has no split column (and no split is asked for).

    Raises:
        UserError: a split asked of a CSV without the column, a split it does not have, or an image on rows of
            two splits.
    """
    if not has_splits:
        if split:
            raise UserError(
                f"{split_flag} {split} picks rows by their split, and {where} has no column of splits "
                f"({'/'.join(SPLIT_COLUMNS)}); name it with --split-column, or leave {split_flag} out."
            )
        return rows
    _refuse_leaks(rows, where)
    split = split or (held_out_split(rows, True) if held_out else TRAIN)
    picked = [row for row in rows if row[3] == split]
    if not picked:
        present = sorted({row[3] for row in rows})
        raise UserError(
            f"{where} has no rows of split {split or '(a held-out one)'!r}; its splits are: {', '.join(present)}. "
            f"Name one with {split_flag}."
        )
    return picked


def _refuse_leaks(rows: list[tuple], where: str) -> None:
    first: dict[str, tuple[int, str]] = {}
    for line, path, _, split in rows:
        seen = first.setdefault(path, (line, split))
        if seen[1] != split:
            raise UserError(
                f"{where}: {path} is on line {seen[0]} in split {seen[1]!r} and on line {line} in split "
                f"{split!r}; an image held out must not be trained on: give it one split."
            )
