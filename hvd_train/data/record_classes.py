"""The classes of other tools' TFRecords and of TFDS splits, from the labels their index holds.

String labels are their own names, sorted (or in the order of
``--class-names``). Integer labels, less ``--label-offset``, index the lines
of ``--class-names`` or a TFDS folder's names; else the records' text
(``record_index.TEXT_KEYS``) names them when each label has one text of its
own, else the numbers do. Held-out data may lack classes: its names come
from the labels it has.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hvd_train.data import record_index, storage
from hvd_train.errors import UserError


def own_classes(entries: list[dict], found, s3, where: str, trained: int = 0) -> tuple[list[str], Callable]:
    """The set's own classes in label order, and ``labels_of(entry)``: an entry's labels as indices into them.

    Args:
        entries: the index entries of the set's files.
        found: the set's ``records.Source``.
        where: ``"<flag> <url>"``, for messages.
        trained: for held-out data (which need not have every class), the number of training classes; 0 for
            training data.
    """
    options = found.options
    kinds = {type(e["labels"][0]) for e in entries}
    if len(kinds) > 1:
        raise UserError(
            f"the labels of {where} ({options.label_key}) are integers in some files and strings in others; give "
            f"files of one kind."
        )
    names = list(found.split.classes) if found.split is not None else None
    if options.class_list:
        names = list(options.class_list)
    elif options.class_names:
        names = names_file(options.class_names, s3)
    if kinds == {str}:
        present = sorted({label for e in entries for label in e["labels"]})
        own = names if names is not None else present
        position = {c: i for i, c in enumerate(own)}
        missing = [c for c in present if c not in position]
        if missing:
            raise UserError(
                f"label {missing[0]!r} of {where} is not in --class-names {options.class_names} ({len(missing)} "
                f"labels are not); add it there."
            )
        return own, lambda e: [position[label] for label in e["labels"]]
    offset = options.label_offset
    present = sorted({label - offset for e in entries for label in e["labels"]})
    if present[0] < 0:
        if found.split is not None:
            raise UserError(
                f"split {found.split.name!r} of {where} holds records without a label ({present[0]}); choose a "
                f"labelled split with {where.split(' ')[0]}-split."
            )
        raise UserError(
            f"{where} has the label {present[0] + offset} ({options.label_key}), below --label-offset {offset}; "
            f"{'pass --label-offset 0' if present[0] + offset == 0 else 'check --label-offset'}."
        )
    high = present[-1]
    if names is not None:
        if high >= len(names):
            named = f"--class-names {options.class_names}" if options.class_names else "its folder"
            raise UserError(
                f"{where} has the label {high + offset}, and {named} names {len(names)} classes (labels {offset} to "
                f"{len(names) - 1 + offset}); check --label-offset."
            )
        return names, lambda e: [label - offset for label in e["labels"]]
    gap = next((i for i, label in enumerate(present) if label != i), None)
    if gap is not None and not trained:
        first = present[0] + offset
        fix = f"if they count from {first}, pass --label-offset {first}" if gap == 0 else "write labels without gaps"
        raise UserError(
            f"{where} has no record of label {gap + offset} and has one of {present[gap] + offset} ({len(present)} "
            f"labels of {offset} to {high + offset} have records); integer labels name classes from "
            f"--label-offset ({offset}) on, each with records: {fix}, or give string labels."
        )
    if trained and high >= trained + 1024:  # numbered classes beyond the model's: too many to list, none to map
        raise UserError(
            f"{where} has the label {high + offset}, and the model has {trained} classes; check --label-offset "
            f"and --class-names."
        )
    own = _text_names(entries, offset, high + 1, present) or [str(i) for i in range(high + 1)]
    return own, lambda e: [label - offset for label in e["labels"]]


def _text_names(entries: list[dict], offset: int, count: int, present: list[int]) -> list[str] | None:
    """Class names from the records' own text: one per label that has records, all distinct (the labels without
    records are named by their number, and never looked up)."""
    for key in record_index.TEXT_KEYS:
        seen: dict[int, set[str]] = {}
        for e in entries:
            for label, texts in e["texts"].get(key, {}).items():
                seen.setdefault(int(label) - offset, set()).update(texts)
        texts = [seen.get(i, set()) for i in present]
        if all(len(t) == 1 for t in texts) and len({next(iter(t)) for t in texts}) == len(present):
            names = [str(i) for i in range(count)]
            for i, t in zip(present, texts):
                names[i] = next(iter(t))
            return names
    return None


def names_file(path: str, s3) -> list[str]:
    """The lines of a ``--class-names`` file, one class a line (blank lines ignored)."""
    try:
        text = (storage.read_url(path, s3) if storage.is_s3(path) else open(path, "rb").read()).decode("utf-8-sig")
    except OSError as e:
        raise UserError(f"cannot read --class-names {path} ({e.strerror or e}).") from None
    except UnicodeDecodeError:
        raise UserError(f"--class-names {path} is not UTF-8 text; save it as UTF-8, one class a line.") from None
    names = [line.strip() for line in text.splitlines() if line.strip()]
    check_names(names, f"--class-names {path}", "give one distinct class a line, in label order")
    return names


def check_names(names: list[str], what: str, fix: str) -> None:
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if not names or twice:
        why = f"names {twice[0]!r} twice" if twice else "names no class"
        raise UserError(f"{what} {why}; {fix}.")
