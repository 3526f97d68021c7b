"""From ``--data`` / ``--val-data`` to checked lists of images that all ranks share.

Rank 0 lists the folders (local or S3) or reads the shard set's manifest
once and shares the result; then every rank decodes its share of a folder's
images once to find unreadable ones, and all ranks agree on what is skipped
(``hvd-train pack`` checked the images of a shard set already). The result
is identical on every rank, which is what makes sharding and step counts
agree.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hvd_train.data import packed, storage
from hvd_train.data.checks import CheckCache, stamps, suspects
from hvd_train.data.features import RecordOptions
from hvd_train.data.folder import ImageSet, list_folder
from hvd_train.data.images import find_bad_images, report_bad_images
from hvd_train.data.packed import ShardSet
from hvd_train.data.records import is_records, tfds_held_out
from hvd_train.data.records import load as load_records
from hvd_train.data.records import prepare as prepare_records
from hvd_train.data.storage import S3Options
from hvd_train.data.table import TableOptions, is_table, read_table, read_table_pair
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.log import Ticker, get_logger

log = get_logger("data")


Data = ImageSet | ShardSet


def open_data(
    url: str,
    flag: str,
    s3: S3Options,
    classes: list[str] | None = None,
    table: TableOptions | None = None,
    records: RecordOptions | None = None,
) -> Data:
    """The image folder, CSV of labels (read with ``table``), shard set or other tools' TFRecords (read with
    ``records``) at ``url`` (local or ``s3://``)."""
    if is_table(url):
        return read_table(url, flag, s3, table, classes)
    if is_records(url, s3):
        return load_records(url, flag, s3, records, classes)
    if packed.is_shard_set(url, s3):
        return packed.load(url, flag, s3, classes)
    return list_folder(url, flag, classes=classes, s3=s3)


def own_held_out(
    url: str, s3: S3Options, table: TableOptions, records: RecordOptions, split: str = ""
) -> tuple[Data, Data | None]:
    """``--data`` given alone: its images, and the held-out images it names itself, if any: a CSV's rows of a
    held-out split (its column of splits), a TFDS folder's held-out split (``split``, else validation, else
    test). None for data that names none."""
    if is_table(url):
        return read_table_pair(url, "--data", s3, table, split)
    train = open_data(url, "--data", s3, table=table, records=records)
    if not (isinstance(train, ShardSet) and train.features.kind == "tfds"):
        return train, None
    held = tfds_held_out(url, s3, split)
    if not held:
        return train, None
    log.info("--data %s: training on its split %r, holding out its split %r", url, records.split or "train", held)
    options = dataclasses.replace(records, split=held)
    return train, load_records(url, "--data", s3, options, train.classes)


def evaluation_set(
    path: str,
    classes: list[str],
    flag: str,
    policy: str,
    ctx: Context,
    threads: int = 0,
    s3: S3Options | None = None,
    check: str = "quick",
    table: TableOptions | None = None,
    records: RecordOptions | None = None,
) -> Data:
    """Held-out images of ``path``, labelled with the trained ``classes``."""
    s3 = s3 or S3Options()
    prepare_records(path, flag, s3, records or RecordOptions(), ctx, held_out=True)
    images = ctx.on_root(
        lambda: open_data(path, flag, s3, classes=classes, table=table, records=records), name="list_eval"
    )
    return checked(images, flag, policy, ctx, threads, s3, check)


def checked(
    images: Data,
    flag: str,
    policy: str,
    ctx: Context,
    threads: int = 0,
    s3: S3Options | None = None,
    check: str = "quick",
) -> Data:
    """``images`` without the ones found unreadable by ``check`` (see ``checks``), the same on every rank.

    Each rank checks every ``size``-th image; the lists of failures are
    gathered so all ranks skip (or fail on) the same images, which the
    result keeps as ``skipped``. Shard sets were checked when they were
    packed.
    """
    if isinstance(images, ShardSet) or check == "none" or len(images) == 0:
        return images
    remote = storage.is_s3(images.paths[0])
    if check == "full" and not remote and images.prefix:  # a listed local folder: cached verdicts
        bad = _full_check(images, flag, ctx, threads)
    else:
        mine = images.paths[ctx.rank :: ctx.size]
        if check == "quick":
            # S3: a request per object is no quick check; training meets what is broken.
            mine = [] if remote else suspects(mine, flag)
        mine_bad = ctx.agree(lambda: find_bad_images(mine, threads, s3), name=f"check{flag}")
        bad = sorted(item for part in ctx.allgather_object(mine_bad, name=f"bad{flag}") for item in part)
    try:
        report_bad_images(bad, policy, flag, log if ctx.is_root else None)
    except UserError as e:
        raise UserError(str(e), agreed=True) from None
    if not bad:
        return images
    kept = images.without(bad)
    empty = [c for c, n in zip(kept.classes, kept.counts()) if n == 0]
    if empty and flag == "--data":
        raise UserError(
            f"class {empty[0]!r} has no readable images left after skipping bad ones ({flag}); "
            f"add readable images or remove the class folder.",
            agreed=True,
        )
    return kept


def _full_check(images: ImageSet, flag: str, ctx: Context, threads: int) -> list[tuple[str, str]]:
    """Every image decoded, except those whose verdict is cached for the same size and mtime.

    Rank 0 looks the files up in its cache; the ranks decode a share each of
    the rest; rank 0 writes the new verdicts back.
    """
    cache = CheckCache(images.prefix)
    relatives = list(images.paths.relatives())
    looked_up: dict = {}

    def lookup():
        known = looked_up["known"] = cache.load()
        found = looked_up["stamps"] = stamps(list(images.paths), flag)
        todo, bad = [], []
        for i, (rel, stamp) in enumerate(zip(relatives, found)):
            entry = known.get(rel)
            if stamp is not None and entry is not None and entry[:2] == stamp:
                if entry[2] is not None:
                    bad.append((images.paths[i], entry[2]))
            else:
                todo.append(i)
        if len(todo) < len(relatives):
            log.info(
                "checking %s (full): %d of %d images known from %s",
                flag,
                len(relatives) - len(todo),
                len(relatives),
                cache.path,
            )
        return np.asarray(todo, np.int64), bad

    todo, cached_bad = ctx.on_root(lookup, name=f"check_cache{flag}")
    mine = [images.paths[i] for i in todo[ctx.rank :: ctx.size].tolist()]
    with Ticker(log, f"checking {flag} (full): decoding", len(mine), "images") as ticker:
        mine_bad = ctx.agree(lambda: find_bad_images(mine, threads, ticker=ticker), name=f"check{flag}")
    found = [item for part in ctx.allgather_object(mine_bad, name=f"bad{flag}") for item in part]
    if ctx.is_root:
        # The training and held-out images of one root share its cache: update this set's entries, keep the rest.
        reasons, decoded, known = dict(found), set(todo.tolist()), looked_up["known"]
        fresh = dict(known)
        for i, (rel, stamp) in enumerate(zip(relatives, looked_up["stamps"])):
            if stamp is None:  # a file that cannot be read now is checked again next time
                fresh.pop(rel, None)
            elif i in decoded:
                fresh[rel] = (*stamp, reasons.get(images.paths[i]))
        if decoded:
            cache.save(fresh)
    return sorted(cached_bad + found)
